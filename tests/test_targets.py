"""Compiling for a TPU slice or GPU node from this machine (issue #44): the real compiler's verdict
through the dry run — the Mosaic Splash kernel in the program (not its interpret-mode emulation),
meshes that lay out on every topology, two slices with their across-slice traffic, a program that
does not fit reported as such, and one-line errors for what cannot be compiled (fbt-train's own:
tests/test_bad_inputs.py).

libtpu (the test extra installs it) compiles for TPU topologies on the CPU; the GPU tests need
jax's CUDA plugin (`fbt-jax[cuda]`) and are skipped with that reason without it.
"""

import importlib.metadata
import re

import jax
import pytest
from conftest import load_config

from fbt_jax import sharding, targets
from fbt_jax.attention.spec import triton_attention_missing
from fbt_jax.errors import ConfigError
from fbt_jax.train import program_facts
from fbt_jax.train.dry_run import check_slices, dry_run, program_lines, scores_heads
from fbt_jax.train.programs import TrainPrograms
from fbt_jax.validation import validate_config


def _has(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


needs_libtpu = pytest.mark.skipif(not _has("libtpu"), reason="libtpu is not installed: pip install 'fbt-jax[tpu]'")
needs_cuda_plugin = pytest.mark.skipif(
    not (_has("jax-cuda13-plugin") or _has("jax-cuda12-plugin")),
    reason="jax's CUDA plugin is not installed: pip install 'fbt-jax[cuda]'",
)


def tiny(**overrides):
    config = load_config("tiny")
    config.data.seq_len = 32  # not the head size (16): a (T, T) array is then the scores, nothing else
    config.model.attention_impl = "splash"
    for field, value in overrides.items():
        node = config
        *parents, leaf = field.split(".")
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return config


def compiled_k1(config, target):
    """The train step of K=1 alone, compiled for `target`."""
    config.eval.num_batches, config.eval.contraction_passes = 0, 0
    schedule = validate_config(config, num_devices=len(target.devices))
    programs = TrainPrograms(config, schedule, target.devices, packed=False, log=lambda *_: None)
    programs.keep_going_out_of_memory = True
    report = programs.compile((1,))
    return programs, report


@pytest.mark.slow
@needs_libtpu
def test_the_dry_run_compiles_every_program_for_a_tpu_slice_with_the_mosaic_splash_kernel():
    # One row per device: the batch cannot split further, so the memory table needs no second
    # compile (its largest-microbatch model is the CPU dry run's, tests/test_dry_run.py).
    text, report = dry_run(tiny(dry_run_topology="v5e:2x2", **{"train.batch_size": 4}))
    version = importlib.metadata.version("libtpu")
    assert f"figures from: TPU compiler (libtpu {version}), topology v5e:2x2, 4 × TPU v5 lite, 15.75 GiB" in text
    assert "over 4 tpu devices" in text
    for k in (1, 2, 3):
        assert re.search(rf"compiled train step K={k}: compiled in [\d.]+s, per-device memory [\d.,]+ MiB", text)
    assert "compiled eval (K up to 3): compiled in" in text and "compiled contraction monitor" in text
    programs = re.findall(
        r"^(train step K=\d|eval|contraction monitor): attention splash \((\d+) Mosaic kernel calls, "
        r"no \(T, T\) array\); collectives per execution: ICI: .*all-reduce",
        text,
        re.MULTILINE,
    )
    assert [name for name, _ in programs] == [
        "train step K=1",
        "train step K=2",
        "train step K=3",
        "eval",
        "contraction monitor",
    ], text
    calls = [int(n) for _, n in programs]
    assert calls[0] > 0 and calls[0] < calls[1] < calls[2], calls  # one kernel per pass per layer, and its backward
    rows = re.findall(r"^\| (\d) \| ([\d.]+) \| (yes|no) \| – \|$", text, re.MULTILINE)
    assert [(k, fits) for k, _, fits in rows] == [("1", "yes"), ("2", "yes"), ("3", "yes")], text
    assert "against 15.75 GiB (TPU v5 lite, available to programs, the compiler's figure)" in text
    assert all(report[f"train_K{k}"]["device_bytes"] > 0 for k in (1, 2, 3))


@needs_libtpu
def test_the_reference_attention_shows_as_no_kernel_and_a_t_by_t_array():
    """The dry run's evidence can say "not the kernel": xla's program holds the (T, T) scores."""
    programs, _ = compiled_k1(tiny(**{"model.attention_impl": "xla"}), targets.target("v5e:2x2"))
    (line,) = program_lines(programs, 32)  # the train step's
    assert "attention xla (no kernel call, " in line and "arrays of (T, T) = (32, 32)" in line, line


@needs_libtpu
def test_where_t_equals_the_width_a_head_count_equal_to_a_devices_rows_is_no_evidence():
    """T = D: a (…, rows, T, D) activation is shaped like (…, heads, T, T) scores when a device's
    rows equal a head count; such counts are left out, the heads per group still show the scores."""
    config = tiny(**{"data.seq_len": 64, "model.num_heads": 8, "model.num_kv_heads": 4, "train.batch_size": 16})
    target = targets.target("v5e:2x2")
    programs = TrainPrograms(config, validate_config(config, 4), target.devices, packed=False, log=lambda *_: None)
    assert scores_heads(programs, 32) == {8, 4, 2}  # T = 32 is no width: every head count
    assert scores_heads(programs, 64) == {2}  # 4 rows per device (8 for two passes) look like heads


@needs_libtpu
def test_two_slices_compile_with_dcn_data_and_their_traffic_crosses_dcn():
    config = tiny(**{"mesh.fsdp": 2, "mesh.dcn_data": 2, "dry_run_topology": "v5e:2x2", "dry_run_num_slices": 2})
    check_slices(config)
    target = targets.target("v5e:2x2", 2)
    assert target.num_slices == 2 and len(target.devices) == 8
    programs, report = compiled_k1(config, target)
    assert dict(programs.mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}
    # Each slice's devices stay together: the data axis splits across the two slices.
    slice_of = [[d.slice_index for d in row.flat] for row in programs.mesh.devices]
    assert slice_of[:2] != slice_of[2:] and all(len(set(s)) == 1 for s in slice_of)
    traffic = program_facts.collectives(programs.train[1].as_text())
    assert traffic[("all-reduce", "DCN")].count > 0 and traffic[("all-gather", "ICI")].count > 0
    (line,) = program_lines(programs, 32)
    assert "ICI: " in line and "; DCN: all-reduce" in line, line


def test_slices_and_the_meshs_dcn_sizes_must_agree():
    with pytest.raises(
        ConfigError,
        match=r"dry_run_num_slices=2 but mesh\.dcn_data × dcn_fsdp × dcn_tensor = 1.*"
        r"--config\.mesh\.dcn_data=2",
    ):
        check_slices(tiny(dry_run_num_slices=2))


@needs_libtpu
def test_the_1b_mesh_lays_out_on_a_v5p_slice_and_compiles():
    """data 8 × fsdp 8 on a 4×4×4 torus: 8 is no product of whole torus axes, so an axis is split
    (create_device_mesh alone refused it)."""
    target = targets.target("v5p:4x4x4")
    mesh = sharding.make_mesh(load_config("fbt_1b").mesh, target.devices)
    assert dict(mesh.shape) == {"data": 8, "fsdp": 8, "tensor": 1}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in target.devices)
    programs, report = compiled_k1(tiny(**{"mesh.fsdp": 8, "train.batch_size": 64}), target)
    assert report["train_K1"]["device_bytes"] > 0 and "train_K1" not in programs.refused


@needs_libtpu
@pytest.mark.parametrize(
    "topology, slices, fsdp, devices",
    [
        ("v4:2x2x2", 1, 8, 8),
        ("v5e:4x4", 1, 8, 16),
        ("v5p:2x2x2", 2, 4, 16),
        ("v6e:4x4", 2, 8, 32),
    ],
)
def test_meshes_build_on_every_chip_we_name(topology, slices, fsdp, devices):
    target = targets.target(topology, slices)
    assert len(target.devices) == devices and target.hbm_bytes > 0
    config = tiny(**{"mesh.fsdp": fsdp, "mesh.dcn_data": slices})
    mesh = sharding.make_mesh(config.mesh, target.devices)
    assert mesh.shape["fsdp"] == fsdp and mesh.size == devices


@needs_libtpu
def test_a_mesh_that_cannot_lay_out_is_one_line_naming_sizes_that_do(monkeypatch):
    """Every data × fsdp × tensor split of v5e/v5p/v6e slices lays out (an axis split where need be);
    where jax refuses both ways, the error is one line with sizes that map onto the torus."""

    def refuse(*args, **kwargs):
        raise NotImplementedError("The size of each axis in your logical mesh must be equal to ...")

    target = targets.target("v5p:4x4x4")
    monkeypatch.setattr(sharding.mesh_utils, "create_device_mesh", refuse)
    with pytest.raises(ConfigError) as error:
        sharding.make_mesh(load_config("fbt_1b").mesh, target.devices)
    assert str(error.value).startswith("mesh data×fsdp×tensor = 8×8×1 per slice cannot be laid out on the 4×4×4 TPU")
    assert str(error.value).endswith("--config.mesh.data=-1 --config.mesh.fsdp=4 --config.mesh.tensor=1")


@needs_libtpu
def test_a_program_that_does_not_fit_is_reported_with_the_compilers_figure_not_a_traceback():
    # A 2^24-row embedding table: 4 GiB of parameters on each device, 12 GiB with Adam's moments,
    # and the gradient's temporaries on top (quick to compile: the model is otherwise tiny).
    config = tiny(**{"model.vocab_size": 2**24})
    programs, report = compiled_k1(config, targets.target("v5e:2x2"))
    assert "Ran out of memory" in programs.refused["train_K1"] and "\n" not in programs.refused["train_K1"]
    assert report["train_K1"]["required_gib"] > 15.75 and programs.train[1] is None
    from fbt_jax.train.programs import describe

    assert describe(report["train_K1"], programs.refused["train_K1"]).startswith("does not fit (refused in ")


@needs_libtpu
def test_making_a_target_leaves_the_environment_as_it_was():
    """libtpu writes its metadata warnings into the environment (TPU_WORKER_ID="WARNING: …"): every
    later command of the process (fbt-prepare reads TPU_WORKER_ID) would fail on them."""
    import subprocess
    import sys

    check = "import os, subprocess; from fbt_jax import targets; b = dict(os.environ); targets.target('v5p:2x2x1'); "
    check += "assert dict(os.environ) == b, set(os.environ.items()) ^ set(b.items()); "
    # What a command started from here inherits: also what libtpu set from C, unseen by os.environ.
    check += "seen = subprocess.run(['env'], capture_output=True, text=True).stdout; "
    check += "assert 'TPU_WORKER_ID' not in seen and 'CLOUD_TPU' not in seen, seen"
    # In a fresh process: libtpu writes the environment when it first loads.
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_without_libtpu_a_topology_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setattr(targets, "_installed", lambda name: None)
    with pytest.raises(ConfigError, match=r"libtpu\), which is not installed; pip install 'fbt-jax\[tpu\]'"):
        targets.target("v5e:8x8")
    with pytest.raises(ConfigError, match=r"pip install 'fbt-jax\[cuda\]'"):
        targets.target("h100:8")


@needs_libtpu
@pytest.mark.parametrize(
    "name, says",
    [
        ("v5x:2x2", "is not a TPU topology or GPU node; use CHIP:AxB"),
        ("v5e8x8", "is not a TPU topology or GPU node"),
        ("v5e:3x3", "the TPU compiler rejects it (INVALID_ARGUMENT"),
    ],
)
def test_a_topology_the_compiler_rejects_is_one_line_with_the_accepted_form(name, says):
    with pytest.raises(ConfigError) as error:
        targets.target(name)
    assert says in str(error.value) and "v5e:8x8, v5p:4x4x4, v6e:16x16, v4:2x2x2" in str(error.value)
    assert "\n" not in str(error.value)


@needs_cuda_plugin
@pytest.mark.skipif(triton_attention_missing(), reason=f"jax {jax.__version__} has no Pallas-Triton attention op")
def test_a_gpu_node_compiles_with_the_triton_kernel_not_its_emulation():
    target = targets.target("h100:8")
    # jax preallocates 75% of a GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION): what a program may use.
    assert target.platform == "gpu" and len(target.devices) == 8 and target.hbm_bytes == 0.75 * 84978434048
    programs, report = compiled_k1(tiny(**{"model.attention_impl": "pallas_gpu"}), target)
    hlo = programs.train[1].as_text()
    assert program_facts.kernel_calls(hlo).get("Triton", 0) > 0 and " while(" not in hlo
    assert report["train_K1"]["device_bytes"] > 0
