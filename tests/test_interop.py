"""Hugging Face interop: imported models compute what transformers computes, round trips are
bitwise, exports are what transformers writes, and a model directory is data, never code.

The references under tests/interop/reference/ were written by transformers itself
(tests/interop/make_reference.py, versions in versions.json): four tiny random models (Llama with
grouped kv heads, Llama 3 rotary scaling and a tokenizer; an untied Llama with an explicit head
dim and linear scaling, sharded into three files; Mistral with a 5-token sliding window and one
kv head; Qwen2 with q/k/v biases) and their logits on a 2 × 13 batch and a 7-token prompt; and
`llama_extended`, the Llama after a new phase (two new tokens at the mean row, a longer context by a
higher rope theta and llama3 factor), with its logits on a 2 × 40 batch.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, small_model_config, tree_snapshot
from etils import epath
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from fbt_jax.data.tokenizers import load_tokenizer
from fbt_jax.errors import ConfigError
from fbt_jax.interop import exporter, hf_config, importer, tensors
from fbt_jax.model import ModelConfig, build_model
from fbt_jax.trained import load_model

REFERENCE = os.path.join(ROOT, "tests", "interop", "reference")
ARCHS = ["llama", "llama_untied", "mistral", "qwen2"]
quiet = lambda *a: None  # noqa: E731


def ref(name: str) -> str:
    return os.path.join(REFERENCE, name)


def hf_tensors(directory: str) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors") and f.startswith("model"):
            handle = safe_open(os.path.join(directory, f), "numpy")
            out.update({k: handle.get_tensor(k) for k in handle.keys()})
    return out


def params(run: str) -> list[tuple[tuple, np.ndarray]]:
    model, _ = load_model(run, log=quiet)
    return [(p, np.asarray(v.get_value())) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def standard_logits(model, tokens) -> np.ndarray:
    return np.asarray(model.logits(model.stack(model.embed(jnp.asarray(tokens)))))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Each reference imported once, on one device."""
    root = tmp_path_factory.mktemp("imported")
    return {name: importer.import_model(ref(name), str(root / name), log=quiet).workdir for name in ARCHS}


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHS)
def test_an_imported_model_gives_the_hugging_face_logits(imported, name):
    model, config = load_model(imported[name], log=quiet)
    reference = load_file(os.path.join(ref(name), "reference_logits.safetensors"))
    np.testing.assert_allclose(standard_logits(model, reference["tokens"]), reference["logits"], atol=1e-4, rtol=0)
    prefix = reference["tokens"][:1, :7]  # a shorter, odd prompt on its own
    np.testing.assert_allclose(standard_logits(model, prefix), reference["logits_prefix"], atol=1e-4, rtol=0)
    assert config.model.scale_logits is False and json.loads(config.hf_config) == json.load(
        open(os.path.join(ref(name), "config.json"))
    )


def test_both_rotary_conventions_read_the_same_model():
    new = json.load(open(os.path.join(ref("llama"), "config.json")))
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    scaling = dict(new["rope_parameters"])
    old["rope_theta"] = scaling.pop("rope_theta")
    old["rope_scaling"] = {"type": scaling.pop("rope_type"), **scaling}  # the oldest spelling of the key
    cfg = hf_config.model_config_from_hf(new, "new")
    assert hf_config.model_config_from_hf(old, "old") == cfg
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_positions) == ("llama3", 8.0, 8)
    # Written back in the convention it came in.
    assert hf_config.hf_config_from_model(cfg, old, "float32", {})["rope_scaling"]["rope_type"] == "llama3"


@pytest.mark.parametrize("name", ARCHS)
def test_import_export_import_is_bitwise(imported, name, tmp_path):
    out = str(tmp_path / "hf")
    exporter.export_run(imported[name], out, max_shard_size="60KB", log=quiet)
    original, exported = hf_tensors(ref(name)), hf_tensors(out)
    assert exported.keys() == original.keys()  # the tensor names transformers writes
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
    assert json.load(open(os.path.join(out, "config.json"))) == json.load(open(os.path.join(ref(name), "config.json")))
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))  # 60KB shards
    again = importer.import_model(out, str(tmp_path / "again"), log=quiet).workdir
    first, second = params(imported[name]), params(again)
    assert [p for p, _ in first] == [p for p, _ in second]
    for (path, x), (_, y) in zip(first, second):
        assert np.array_equal(x, y), path  # the fusion too, from fbt_fusion.safetensors


@pytest.mark.slow
def test_a_run_trained_here_exports_as_a_llama(trained_run, tmp_path):
    """A model trained from scratch (scaled tied readout) is a Llama with the scale folded into its
    final norm; read back with the fbt files it is the same model bitwise."""
    out = str(tmp_path / "hf")
    exporter.export_run(trained_run, out, log=quiet)
    written = json.load(open(os.path.join(out, "config.json")))
    reference = json.load(open(os.path.join(ref("llama"), "config.json")))
    assert set(written) == set(reference) - {"transformers_version"}
    assert written["model_type"] == "llama" and written["vocab_size"] == 6 and written["tie_word_embeddings"]
    assert hf_tensors(out).keys() == {n for n in hf_tensors(ref("llama")) if not n.startswith("model.layers.")} | {
        n.replace("layers.0", f"layers.{i}") for n in hf_tensors(ref("llama")) if "layers.0." in n for i in (0, 1)
    }
    back = importer.import_model(out, str(tmp_path / "back"), log=quiet).workdir
    for (path, x), (_, y) in zip(params(trained_run), params(back)):
        assert np.array_equal(x, y), path
    # Without the fbt files it is an ordinary Llama: the same logits, the scale now in the norm.
    for name in (importer.SIDECAR_CONFIG, importer.SIDECAR_WEIGHTS):
        os.remove(os.path.join(out, name))
    plain = importer.import_model(out, str(tmp_path / "plain"), log=quiet).workdir
    tokens = np.array([[1, 2, 3, 4, 5, 0, 1, 2, 3]], np.int32)
    ours, theirs = load_model(trained_run, log=quiet)[0], load_model(plain, log=quiet)[0]
    np.testing.assert_allclose(standard_logits(theirs, tokens), standard_logits(ours, tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_phase_with_new_tokens_and_a_longer_context_exports_what_transformers_computes(imported, tmp_path):
    """init_from's changes (fbt_jax/init_from.py) on the imported Llama: two new tokens (their rows the
    mean of the old), rope theta 2e6 and llama3 factor 16 over 16 positions, a 128-token context.
    fbt-export writes them so that transformers computes our logits: its own, stored in llama_extended/."""
    from fbt_jax import trained
    from fbt_jax.config import config_from_dict
    from fbt_jax.model import abstract_model

    config = config_from_dict(json.load(open(os.path.join(imported["llama"], "config.json"))))
    config.model.update(vocab_size=130, rope_theta=2e6, rope_scaling_factor=16.0, rope_original_max_positions=16)
    config.data.seq_len = 128
    one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = nnx.split(abstract_model(ModelConfig.from_config(config.model)), nnx.Param)[1]
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), abstract)
    params = trained.load_params(imported["llama"], abstract, config, log=quiet)
    phase, out = str(tmp_path / "phase"), str(tmp_path / "hf")
    importer._write_run(epath.Path(phase), config, params, None, [])
    exporter.export_run(phase, out, log=quiet)
    expected = json.load(open(os.path.join(ref("llama_extended"), "config.json")))
    assert json.load(open(os.path.join(out, "config.json"))) == expected  # rope, vocabulary and context included
    for key, value in hf_tensors(ref("llama_extended")).items():
        np.testing.assert_allclose(hf_tensors(out)[key], value, rtol=0, atol=1e-7, err_msg=key)
    back, _ = load_model(importer.import_model(out, str(tmp_path / "back"), log=quiet).workdir, log=quiet)
    reference = load_file(os.path.join(ref("llama_extended"), "reference_logits.safetensors"))
    np.testing.assert_allclose(standard_logits(back, reference["tokens"]), reference["logits"], atol=1e-4, rtol=0)


def _run_on(tokenizer: str, workdir: str) -> str:
    """A run whose config trains on `tokenizer`: a random tiny model at step 0, written as fbt-import writes
    one, but with no Hugging Face config (as trained here). What fbt-export reads, without training it."""
    cfg = small_model_config(vocab_size=1000)
    config = importer.run_config(cfg, {}, workdir, 32, tokenizer)
    config.hf_config = ""
    importer._write_run(epath.Path(workdir), config, nnx.state(build_model(cfg, seed=0), nnx.Param), None, [])
    return workdir


def test_a_run_on_a_bare_tokenizer_json_exports_the_eos_and_bos_it_trained_with(bpe_tokenizer_json, tmp_path):
    """A bare tokenizer.json names no end-of-text token; transformers reads eos/bos from tokenizer_config.json,
    and without one lm-eval's hf backend had eos_token=None (issue #43). The export names our tokenizer's."""
    from tokenizers import Tokenizer, processors

    with_bos = Tokenizer.from_file(bpe_tokenizer_json)  # the same file, its post-processor adding <s> first
    with_bos.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", with_bos.token_to_id("<s>"))]
    )
    with_bos.save(str(tmp_path / "with_bos.json"))
    for i, spec in enumerate((bpe_tokenizer_json, str(tmp_path / "with_bos.json"))):
        out = str(tmp_path / f"hf{i}")
        exporter.export_run(_run_on(spec, str(tmp_path / f"run{i}")), out, log=quiet)
        ours, vocab = load_tokenizer(spec), Tokenizer.from_file(spec)
        written = json.load(open(os.path.join(out, "tokenizer_config.json")))
        assert written["eos_token"] == vocab.id_to_token(ours.eos_id) == "<|endoftext|>"
        assert written.get("bos_token") == (None if ours.bos_id is None else vocab.id_to_token(ours.bos_id))
        assert written["tokenizer_class"] == "PreTrainedTokenizerFast"  # the file's encoding, no class defaults
        assert load_tokenizer(out).identity == ours.identity  # read back as the same ids
    assert written["bos_token"] == "<s>"


def test_a_sharded_import_reads_each_block_once_into_its_place(imported, tmp_path):
    """On 8 devices (fsdp 4 × tensor 2) every parameter has its rule's sharding and the values of
    the single-device import, and each device's block is read from the file alone."""
    mesh = importer.default_config().mesh
    mesh.fsdp, mesh.tensor = 4, 2
    importer.import_model(ref("llama"), str(tmp_path / "sharded"), mesh_cfg=mesh, log=quiet)
    for (path, x), (_, y) in zip(params(imported["llama"]), params(str(tmp_path / "sharded"))):
        assert np.array_equal(x, y), path
    q = next(m for m in tensors.tensor_maps(ModelConfig(**_llama_fields())) if m.path[-1] == "q_DNH")
    full = np.arange(np.prod(q.hf_shape), dtype=np.float32).reshape(q.hf_shape)
    requested = []

    class Recording:
        def __getitem__(self, index):
            requested.append(index)
            return full[index]

    block = (slice(0, 16), slice(2, 4), slice(None))  # half of D, heads 2 and 3
    np.testing.assert_array_equal(q.read_block(lambda name: Recording(), block), q.to_fbt(full)[block])
    H = q.split[1]
    assert requested == [(slice(2 * H, 4 * H), slice(0, 16))]  # only those heads' rows, half the columns


def _llama_fields() -> dict:
    return hf_config.dataclasses.asdict(
        hf_config.model_config_from_hf(json.load(open(ref("llama") + "/config.json")), "")
    )


def test_scanned_layers_import_the_same_model(imported, tmp_path):
    run = importer.import_model(ref("qwen2"), str(tmp_path / "scanned"), scan_layers=True, log=quiet).workdir
    model, _ = load_model(run, log=quiet)
    reference = load_file(os.path.join(ref("qwen2"), "reference_logits.safetensors"))
    np.testing.assert_allclose(standard_logits(model, reference["tokens"]), reference["logits"], atol=1e-4, rtol=0)
    exporter.export_run(run, str(tmp_path / "hf"), log=quiet)  # the stacked layers written back one by one
    original, exported = hf_tensors(ref("qwen2")), hf_tensors(str(tmp_path / "hf"))
    assert exported.keys() == original.keys() and all(np.array_equal(exported[k], original[k]) for k in original)


def test_the_upcycle_config_names_a_missing_import_in_one_line(tmp_path):
    from conftest import cpu_env, run_command

    for arg, expected in (("", "give the imported run"), (":runs/nope", "import the model first")):
        result = run_command(["fbt-train", f"--config=configs/upcycle.py{arg}"], cpu_env(1))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], result.stderr


def test_readout_fusion_starts_where_the_pretrained_stack_reads_embeddings():
    """Tied: W_U is a multiple of the identity and W_G = 0; untied: W_U maps readout rows onto
    embedding rows; W_U h has the embeddings' RMS for an h of the final norm's RMS."""
    key = jax.random.split(jax.random.key(0), 2)
    e_VD = jax.random.normal(key[0], (200, 16))
    scale_D = jnp.full((16,), 2.0)
    state, gate = importer.readout_fusion(e_VD, e_VD, scale_D, "glu")
    np.testing.assert_allclose(state, state[0, 0] * np.eye(16), atol=1e-4)
    assert not np.any(gate)
    r_VD = e_VD @ jax.random.normal(key[1], (16, 16))
    state, _ = importer.readout_fusion(e_VD, r_VD, scale_D, "glu")
    mapped = r_VD @ state
    cosine = jnp.sum(mapped * e_VD, -1) / (jnp.linalg.norm(mapped, axis=-1) * jnp.linalg.norm(e_VD, axis=-1))
    assert float(jnp.min(cosine)) > 0.999
    h = jax.random.normal(key[0], (4000, 16)) * 2.0
    np.testing.assert_allclose(
        float(jnp.sqrt(jnp.mean((h @ state) ** 2))), 2 * float(jnp.sqrt(jnp.mean(e_VD**2))), rtol=0.1
    )


# --- a model directory is data ----------------------------------------------------------------------------

MARKER = "/tmp/fbt-interop-code-ran"  # created only if code from a model directory ran


def _copy(name: str, tmp_path) -> str:
    out = str(tmp_path / name)
    shutil.copytree(ref(name), out)
    return out


def test_nothing_from_the_directory_runs(tmp_path, capsys):
    if os.path.exists(MARKER):
        os.remove(MARKER)
    code = f"open({MARKER!r}, 'w').write('ran')\n"
    pickled = str(tmp_path / "pickled")
    os.makedirs(pickled)
    shutil.copy(os.path.join(ref("qwen2"), "config.json"), pickled)

    class Payload:
        def __reduce__(self):
            return (exec, (code,))

    import pickle

    with open(os.path.join(pickled, "pytorch_model.bin"), "wb") as f:
        pickle.dump(Payload(), f)
    _refused(["fbt-import", pickled, str(tmp_path / "out")], "convert them to safetensors", capsys)
    custom = _copy("qwen2", tmp_path)
    with open(os.path.join(custom, "modeling_custom.py"), "w") as f:
        f.write(code)
    config = json.load(open(os.path.join(custom, "config.json")))
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.Qwen2ForCausalLM"}
    json.dump(config, open(os.path.join(custom, "config.json"), "w"))
    importer.main([custom, str(tmp_path / "custom-out")])  # imports as the built-in architecture
    assert not os.path.exists(MARKER)


def _refused(argv: list[str], expected: str, capsys, out: str | None = None) -> None:
    before = tree_snapshot(argv[1]) if os.path.isdir(argv[1]) else None
    main = importer.main if argv[0] == "fbt-import" else exporter.main
    with pytest.raises(SystemExit) as exit_info:
        main(argv[1:])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and err[0].startswith(f"{argv[0]}: "), err
    assert expected in err[0], err[0]
    if before is not None:
        assert tree_snapshot(argv[1]) == before
    target = out or argv[2]
    assert not os.path.exists(target) or os.listdir(target) == ["keep"], "something was written"


def _edit_config(directory: str, **changes) -> None:
    path = os.path.join(directory, "config.json")
    config = json.load(open(path)) | changes
    json.dump({k: v for k, v in config.items() if v is not ...}, open(path, "w"))


def _edit_tensors(directory: str, edit) -> None:
    path = os.path.join(directory, "model.safetensors")
    tensors_ = load_file(path)
    edit(tensors_)
    save_file(tensors_, path)


BAD_IMPORTS = {
    "no_config": (lambda d: os.remove(os.path.join(d, "config.json")), "has no config.json"),
    "no_weights": (lambda d: os.remove(os.path.join(d, "model.safetensors")), "has no weights"),
    "architecture": (lambda d: _edit_config(d, architectures=["GPT2LMHeadModel"]), "'GPT2LMHeadModel'"),
    "rope_yarn": (
        lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}),
        "rotary scaling 'yarn'",
    ),
    "moe": (lambda d: _edit_config(d, num_local_experts=8), "num_local_experts=8 (a mixture of experts)"),
    "qwen_windows": (lambda d: _edit_config(d, use_sliding_window=True), "use_sliding_window=true"),
    "missing": (
        lambda d: _edit_tensors(d, lambda t: t.pop("model.norm.weight")),
        "tensor model.norm.weight is missing",
    ),
    "extra": (
        lambda d: _edit_tensors(
            d, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((48, 32), np.float32)})
        ),
        "tensor model.layers.2.mlp.up_proj.weight",
    ),
    "shape": (
        lambda d: _edit_tensors(d, lambda t: t.update({"model.norm.weight": np.ones(31, np.float32)})),
        "model.norm.weight has shape [31]",
    ),
    "dtype": (
        lambda d: _edit_tensors(d, lambda t: t.update({"model.norm.weight": np.ones(32, np.int8)})),
        "model.norm.weight is I8",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_IMPORTS))
def test_bad_model_directories_are_one_line_before_anything_is_written(case, tmp_path, capsys):
    directory = _copy("qwen2", tmp_path)
    BAD_IMPORTS[case][0](directory)
    _refused(["fbt-import", directory, str(tmp_path / "out")], BAD_IMPORTS[case][1], capsys)


def test_a_sharded_index_naming_a_missing_file_is_one_line(tmp_path, capsys):
    directory = _copy("llama_untied", tmp_path)
    os.remove(os.path.join(directory, "model-00002-of-00003.safetensors"))
    _refused(["fbt-import", directory, str(tmp_path / "out")], "names 'model-00002-of-00003.safetensors'", capsys)


def test_export_refuses_a_non_empty_directory_and_a_model_without_counterpart(imported, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep").write_text("mine")
    _refused(["fbt-export", imported["qwen2"], str(taken)], "exists and is not an empty directory", capsys)
    assert (taken / "keep").read_text() == "mine"
    _refused(["fbt-export", imported["qwen2"], str(tmp_path / "hf"), "--max-shard-size=lots"], "is not a size", capsys)
    with pytest.raises(ConfigError, match="no Hugging Face counterpart"):
        hf_config.export_architecture(ModelConfig(qkv_bias=True, head_dim=32), None)
    with pytest.raises(ConfigError, match="no Hugging Face counterpart"):
        hf_config.export_architecture(ModelConfig(qkv_bias=True, sliding_window=8), None)
    llama = json.load(open(os.path.join(ref("llama"), "config.json")))
    with pytest.raises(ConfigError, match="needs MistralForCausalLM"):
        hf_config.export_architecture(ModelConfig(sliding_window=8), llama)


@pytest.mark.slow
def test_two_processes_import_the_same_parameters(imported, tmp_path):
    """Two processes × 2 devices (fsdp 4), each reading its own devices' blocks, write one
    checkpoint equal to the single-device import."""
    import socket

    from conftest import cpu_env, start_command

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "two")
    procs = [
        start_command(
            [
                "fbt-import",
                ref("llama"),
                out,
                "--fsdp=4",
                f"--coordinator-address=127.0.0.1:{port}",
                "--num-processes=2",
                f"--process-id={i}",
            ],  # fmt: skip
            cpu_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outputs]
    for (path, x), (_, y) in zip(params(imported["llama"]), params(out)):
        assert np.array_equal(x, y), path


def test_an_empty_out_directory_is_kept_as_it_is(imported, tmp_path, monkeypatch):
    """An existing empty OUT (a group-shared 2775 directory) keeps its inode, mode and group, and the files
    take its group (issue #43); a failed export leaves it empty; a new OUT keeps the setgid bit it is made with."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o2775)
    if os.geteuid() == 0:  # a group of its own, so that files taking the parent's group would show
        os.chown(shared, -1, 4242)
    before = os.stat(shared)
    rename = os.rename

    def full_disk(src, dst):  # the last file's move fails: those moved before it must go too
        if str(dst).endswith("config.json"):
            raise OSError("No space left on device")
        rename(src, dst)

    with monkeypatch.context() as patch, pytest.raises(OSError, match="No space"):
        patch.setattr(os, "rename", full_disk)
        exporter.export_run(imported["llama"], str(shared), log=quiet)
    assert os.listdir(shared) == [] and os.stat(shared).st_ino == before.st_ino
    # Sharded: the index is among the files returned, which are what an export to gs:// uploads.
    files = exporter.export_run(imported["llama"], str(shared), max_shard_size="60KB", log=quiet)
    after = os.stat(shared)
    assert (after.st_ino, after.st_mode, after.st_gid) == (before.st_ino, before.st_mode, before.st_gid)
    assert stat.S_IMODE(after.st_mode) == 0o2775 and {"tokenizer.json", "model.safetensors.index.json"} <= set(files)
    assert sorted(os.listdir(shared)) == sorted(files)  # and nothing else: the staging directory is gone
    assert {os.stat(shared / f).st_gid for f in files} == {before.st_gid}
    exporter.export_run(imported["llama"], str(shared / "new"), log=quiet)
    assert os.stat(shared / "new").st_mode & stat.S_ISGID and os.stat(shared / "new").st_gid == before.st_gid
    left = tmp_path / "killed"
    (left / ".fbt-export-partial-123").mkdir(parents=True)
    with pytest.raises(ConfigError, match="left by an interrupted fbt-export; remove it"):
        exporter.check_out(str(left))
