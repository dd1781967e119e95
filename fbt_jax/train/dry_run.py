"""`fbt-train --config=... --config.dry_run=True`: check a configuration at full size, cheaply.

Builds the model abstractly on the configured mesh (with `dry_run_devices` simulated CPU devices
for a pod-sized mesh), compiles the train program of every pass count K from abstract shapes and
reports sizes, FLOPs and per-device memory. No weights are allocated and no data is read.
"""

from __future__ import annotations

import jax
import ml_collections

from fbt_jax import sharding
from fbt_jax.config import validate_config
from fbt_jax.flops import forward_flops, forward_flops_per_token
from fbt_jax.model import count_params
from fbt_jax.train.programs import TrainPrograms


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
    out.append("dry run complete: nothing was allocated")
    return "\n".join(out), report
