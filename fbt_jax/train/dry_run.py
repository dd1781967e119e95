"""`fbt-train --config=... --config.dry_run=True`: check a configuration at full size, cheaply.

Builds the model abstractly on the configured mesh (with `dry_run_devices` simulated CPU devices
for a pod-sized mesh), compiles the train program of every pass count K from abstract shapes and
reports sizes, FLOPs and per-device memory. No weights are allocated and no data is read.
"""

from __future__ import annotations

import jax
import ml_collections

from fbt_jax import sharding
from fbt_jax.flops import forward_flops, forward_flops_per_token
from fbt_jax.hardware import chip_hbm_gib
from fbt_jax.model import count_params
from fbt_jax.schedule import PassSchedule
from fbt_jax.train.programs import TrainPrograms
from fbt_jax.validation import validate_config


def dry_run(config: ml_collections.ConfigDict) -> tuple[str, dict[str, dict[str, float]]]:
    """The dry run's report as text, and the compile report of every program."""
    if config.dry_run_devices:
        # Must happen before the first use of any backend in this process.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", int(config.dry_run_devices))
    config = config.copy_and_resolve_references()
    config.eval.num_batches = 0  # the train programs are what must fit
    schedule = validate_config(config, num_devices=len(jax.devices()))
    lines: list[str] = []
    packed = config.data.source != "task"  # text and TFDS sources are packed (segment ids, positions)
    programs = TrainPrograms(config, schedule, jax.devices(), packed, log=lines.append)
    cfg, seq_len = programs.model_cfg, config.data.seq_len
    state_bytes = sharding.per_device_bytes(programs.abstract_state, programs.state_shardings)
    param_bytes = sharding.per_device_bytes(programs.abstract_state.params, programs.state_shardings.params)
    out = [
        f"dry run of {config.workdir}: {count_params(programs.abstract_state.params):,} parameters",
        "mesh "
        + " × ".join(f"{a}={n}" for a, n in programs.mesh.shape.items())
        + f" over {programs.mesh.size} {jax.devices()[0].platform} devices; sharding rules: {config.sharding.rules}",
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
    hbm_gib = config.dry_run_hbm_gib or (chip_hbm_gib(config.dry_run_chip) if config.dry_run_chip else 0.0)
    if hbm_gib:
        out += memory_fit(config, schedule, programs, report, hbm_gib)
    out.append("dry run complete: nothing was allocated")
    return "\n".join(out), report


def memory_fit(
    config: ml_collections.ConfigDict,
    schedule: PassSchedule,
    programs: TrainPrograms,
    report: dict[str, dict[str, float]],
    hbm_gib: float,
) -> list[str]:
    """Per K: the per-device memory against `hbm_gib`, and the largest microbatch that fits.

    Memory is modelled as fixed + per-example × (examples per device per microbatch), from this
    compile and one more with twice the microbatches (when the batch splits that far).
    """
    chip = f" ({config.dry_run_chip})" if config.dry_run_chip and not config.dry_run_hbm_gib else ""
    dp = programs.batch_sharding.mesh.size // max(1, _non_batch_devices(programs))
    batch, microbatches = config.train.batch_size, config.train.microbatches
    examples = batch // (microbatches * dp)  # per device per microbatch
    doubled = None
    if batch % (2 * microbatches * dp) == 0:
        other = config.copy_and_resolve_references()
        other.train.microbatches = 2 * microbatches
        doubled = TrainPrograms(other, schedule, list(programs.mesh.devices.flat), programs.packed, log=lambda *_: None)
    lines = [
        f"memory per device against {hbm_gib:g} GiB{chip}, at train.microbatches={microbatches} "
        f"({examples} examples per device per microbatch):",
        "| K | GiB per device | fits | largest microbatch that fits |",
        "|---|---|---|---|",
    ]
    for k in schedule.pass_counts:
        used = report[f"train_K{k}"].get("device_bytes", 0.0) / 2**30
        largest = "–"
        if doubled is not None:
            half = doubled.compile((k,))[f"train_K{k}"].get("device_bytes", 0.0) / 2**30
            per_example = (used - half) / (examples - examples // 2)
            fixed = used - per_example * examples
            fitting = int((hbm_gib - fixed) / per_example) if per_example > 0 else examples
            choices = [m for m in range(1, batch // dp + 1) if batch % (m * dp) == 0 and batch // (m * dp) <= fitting]
            largest = f"{batch // (choices[0] * dp)} examples (train.microbatches={choices[0]})" if choices else "none"
        lines.append(f"| {k} | {used:.3g} | {'yes' if used <= hbm_gib else 'no'} | {largest} |")
    return lines


def _non_batch_devices(programs: TrainPrograms) -> int:
    """Devices along mesh axes that do not split the batch (e.g. tensor parallelism)."""
    spec = programs.batch_sharding.spec[0]
    batch_axes = set(spec if isinstance(spec, tuple) else (spec,) if spec else ())
    size = 1
    for axis, n in programs.mesh.shape.items():
        if axis not in batch_axes:
            size *= n
    return size
