"""`fbt-train --config=... --config.dry_run=True`: check a configuration at full size, cheaply.

Builds the model abstractly on the configured mesh and compiles every program the run would use —
the train step of every pass count K, the eval step, the contraction monitor — from abstract
shapes, reporting sizes, FLOPs, compile times and per-device memory. No weights are allocated and
no data is read. The devices compiled for:
- `dry_run_topology` (`v5e:8x8`, `v5p:4x4x4`, `h100:8`; `dry_run_num_slices` for multi-slice): a
  TPU slice or GPU node's compile-only devices, with its real compiler (`fbt_jax.targets`) — its
  memory figures and out-of-memory verdicts, the kernels it lowered and the collectives of a step;
- else `dry_run_devices` simulated CPU devices (a pod-sized mesh), or this machine's devices: the
  CPU compiler's figures, which an accelerator's compiler does not reproduce.
"""

from __future__ import annotations

import math

import jax
import ml_collections

from fbt_jax import attention, sharding, targets
from fbt_jax.data.plan import plan_data
from fbt_jax.errors import ConfigError
from fbt_jax.flops import forward_flops, forward_flops_per_token
from fbt_jax.hardware import chip_hbm_gib
from fbt_jax.model import count_params
from fbt_jax.schedule import PassSchedule
from fbt_jax.train import program_facts
from fbt_jax.train.programs import TrainPrograms
from fbt_jax.validation import validate_config


def dry_run(config: ml_collections.ConfigDict) -> tuple[str, dict[str, dict[str, float]]]:
    """The dry run's report as text, and the compile report of every program."""
    target = None
    if config.dry_run_topology:
        jax.config.update("jax_platforms", "cpu")  # this machine only compiles; it runs nothing
        check_slices(config)
        target = targets.target(config.dry_run_topology, int(config.dry_run_num_slices))
        devices = target.devices
    else:
        if config.dry_run_devices:
            # Must happen before the first use of any backend in this process.
            jax.config.update("jax_platforms", "cpu")
            jax.config.update("jax_num_cpu_devices", int(config.dry_run_devices))
        devices = jax.devices()
    config = config.copy_and_resolve_references()
    data = plan_data(config)
    schedule = validate_config(config, num_devices=len(devices), data=data)
    lines: list[str] = []
    programs = TrainPrograms(config, schedule, devices, data.packed, log=lines.append)
    programs.keep_going_out_of_memory = True
    cfg, seq_len = programs.model_cfg, data.seq_len
    state_bytes = sharding.per_device_bytes(programs.abstract_state, programs.state_shardings)
    param_bytes = sharding.per_device_bytes(programs.abstract_state.params, programs.state_shardings.params)
    platform = devices[0].platform
    out = [
        f"dry run of {config.workdir}: {count_params(programs.abstract_state.params):,} parameters",
        "figures from: "
        + (
            target.describe()
            if target
            else f"the CPU compiler over {len(devices)} {platform} devices (a TPU's or GPU's compiler gives other "
            "figures: --config.dry_run_topology=v5e:8x8 compiles for that slice)"
        ),
        "mesh "
        + " × ".join(f"{a}={n}" for a, n in programs.mesh.shape.items())
        + f" over {programs.mesh.size} {platform} devices; sharding rules: {config.sharding.rules}",
        f"per-device parameters {param_bytes / 2**30:.3f} GiB, parameters + optimizer state "
        f"{state_bytes / 2**30:.3f} GiB",
        f"forward FLOPs per token, one pass (seq_len {seq_len}): "
        + ", ".join(f"{k} {v / 1e9:.3f} G" for k, v in forward_flops_per_token(cfg, seq_len).items()),
    ]
    for k in schedule.pass_counts:
        out.append(
            f"  K={k}: {forward_flops(cfg, seq_len, k) / 1e9:.3f} GFLOP/token forward, "
            f"{3 * forward_flops(cfg, seq_len, k) / 1e9:.3f} GFLOP/token train"
        )
    report = programs.compile()
    out += lines
    if target is not None:
        out += program_lines(programs, seq_len)
        hbm_gib, memory = target.hbm_bytes / 2**30, f"{target.devices[0].device_kind}, {target.hbm_source}"
        if target.platform == "gpu":
            out.append("(the GPU compiler compiles what does not fit without refusing it: `fits` compares its figure)")
        if config.dry_run_hbm_gib:  # a tighter budget the user sets (headroom)
            hbm_gib, memory = config.dry_run_hbm_gib, "dry_run_hbm_gib"
    else:
        chip = config.dry_run_chip if config.dry_run_chip and not config.dry_run_hbm_gib else ""
        hbm_gib = config.dry_run_hbm_gib or (chip_hbm_gib(config.dry_run_chip) if config.dry_run_chip else 0.0)
        memory = chip
    if hbm_gib:
        out += memory_fit(config, schedule, programs, report, hbm_gib, memory)
    out.append("dry run complete: nothing was allocated")
    return "\n".join(out), report


def check_slices(config: ml_collections.ConfigDict) -> None:
    """The slices compiled for and the mesh's across-slice (DCN) sizes must agree."""
    slices = int(config.dry_run_num_slices)
    dcn = math.prod(int(config.mesh[f"dcn_{axis}"]) for axis in sharding.MESH_AXES)
    if slices != dcn:
        raise ConfigError(
            f"dry_run_num_slices={slices} but mesh.dcn_data × dcn_fsdp × dcn_tensor = {dcn}: the mesh must span the "
            f"slices; set --config.mesh.dcn_data={slices} (data parallel across slices) or "
            f"--config.dry_run_num_slices={dcn}"
        )


def program_lines(programs: TrainPrograms, seq_len: int) -> list[str]:
    """Per compiled program: the attention it holds (kernel calls, any (T, T) array) and the
    collectives of one execution."""
    cfg = programs.model_cfg
    call = attention.spec.Call(
        programs.mesh.devices.flat[0].platform, cfg.compute_dtype, programs.packed, cfg.sliding_window, cfg.head_size
    )
    chosen = attention.resolve(cfg.attention_impl, call)
    heads = scores_heads(programs, seq_len)
    compiled = {f"train step K={k}": program for k, program in programs.train.items() if program is not None}
    compiled |= {"eval": programs.eval} if programs.eval is not None else {}
    compiled |= {"contraction monitor": programs.contraction} if programs.contraction is not None else {}
    lines = []
    for name, program in compiled.items():
        hlo = program.as_text()
        kernels = program_facts.kernel_calls(hlo)
        squares = program_facts.square_buffers(hlo, seq_len, heads)
        held = ", ".join(f"{n} {kernel} kernel calls" for kernel, n in kernels.items()) or "no kernel call"
        whole = f"{squares} arrays of (T, T) = ({seq_len}, {seq_len})" if squares else "no (T, T) array"
        traffic = program_facts.describe_collectives(program_facts.collectives(hlo), call.platform)
        lines.append(f"{name}: attention {chosen} ({held}, {whole}); collectives per execution: {traffic}")
    return lines


def scores_heads(programs: TrainPrograms, seq_len: int) -> set[int]:
    """The head counts an attention-scores array (…, heads, T, T) may show (all heads, kv heads,
    heads per group; per device under tensor parallelism). Where T equals a model width (the 1B
    config: T = D = 2048) a (…, rows, T, D) activation looks the same: head counts that equal a
    device's rows are then left out (the scores still show their heads per group)."""
    cfg, config = programs.model_cfg, programs.config
    tensor = programs.mesh.shape["tensor"]
    heads = {cfg.num_heads, cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads}
    heads |= {n // tensor for n in heads if n % tensor == 0}
    widths = {cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size, cfg.num_heads * cfg.head_size}
    if seq_len in widths:
        dp = programs.mesh.size // tensor
        batches = (
            config.train.batch_size,
            config.train.batch_size // config.train.microbatches,
            config.eval.batch_size,
        )
        heads -= {b // dp for b in batches} | {b // dp * 2 for b in batches}  # also a pass pair's
    return heads


def memory_fit(
    config: ml_collections.ConfigDict,
    schedule: PassSchedule,
    programs: TrainPrograms,
    report: dict[str, dict[str, float]],
    hbm_gib: float,
    memory: str = "",
) -> list[str]:
    """Per K: the per-device memory against `hbm_gib` (`memory`: whose), and the largest
    microbatch that fits.

    Memory is modelled as fixed + per-example × (examples per device per microbatch), from this
    compile and one more with twice the microbatches (when the batch splits that far). A program
    the compiler refused counts what it said it needed (its temporaries) plus the train state.
    """
    chip = f" ({memory})" if memory else ""
    state_gib = sharding.per_device_bytes(programs.abstract_state, programs.state_shardings) / 2**30
    dp = programs.batch_sharding.mesh.size // max(1, _non_batch_devices(programs))
    batch, microbatches = config.train.batch_size, config.train.microbatches
    examples = batch // (microbatches * dp)  # per device per microbatch
    doubled = None
    if batch % (2 * microbatches * dp) == 0:
        other = config.copy_and_resolve_references()
        other.train.microbatches = 2 * microbatches
        other.eval.num_batches, other.eval.contraction_passes = 0, 0  # only the train steps are compared
        doubled = TrainPrograms(other, schedule, list(programs.mesh.devices.flat), programs.packed, log=lambda *_: None)
        doubled.keep_going_out_of_memory = True
    lines = [
        f"memory per device against {hbm_gib:.4g} GiB{chip}, at train.microbatches={microbatches} "
        f"({examples} examples per device per microbatch):",
        "| K | GiB per device | fits | largest microbatch that fits |",
        "|---|---|---|---|",
    ]
    for k in schedule.pass_counts:
        used = _used_gib(report[f"train_K{k}"], state_gib)
        largest = "–"
        if doubled is not None:
            half = _used_gib(doubled.compile((k,))[f"train_K{k}"], state_gib)
            per_example = (used - half) / (examples - examples // 2)
            fixed = used - per_example * examples
            fitting = int((hbm_gib - fixed) / per_example) if per_example > 0 else examples
            choices = [m for m in range(1, batch // dp + 1) if batch % (m * dp) == 0 and batch // (m * dp) <= fitting]
            largest = f"{batch // (choices[0] * dp)} examples (train.microbatches={choices[0]})" if choices else "none"
        fits = used <= hbm_gib and f"train_K{k}" not in programs.refused
        shown = f"{used:.3g}" if f"train_K{k}" not in programs.refused else f"≥ {used:.3g} (refused)"
        lines.append(f"| {k} | {shown} | {'yes' if fits else 'no'} | {largest} |")
    return lines


def _used_gib(report: dict[str, float], state_gib: float) -> float:
    if "device_bytes" in report:
        return report["device_bytes"] / 2**30
    return report.get("required_gib", 0.0) + state_gib


def _non_batch_devices(programs: TrainPrograms) -> int:
    """Devices along mesh axes that do not split the batch (e.g. tensor parallelism)."""
    spec = programs.batch_sharding.spec[0]
    batch_axes = set(spec if isinstance(spec, tuple) else (spec,) if spec else ())
    size = 1
    for axis, n in programs.mesh.shape.items():
        if axis not in batch_axes:
            size *= n
    return size
