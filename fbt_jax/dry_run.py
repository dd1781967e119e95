"""`fbt-train --config=... --config.dry_run=True`: check a configuration at full size, cheaply.

Builds the model abstractly on the configured mesh (with `dry_run_devices` simulated CPU devices
for a pod-sized mesh), compiles the train program of every pass count K from abstract shapes and
reports sizes, FLOPs and per-device memory. No weights are allocated.
"""

from __future__ import annotations

import jax
import ml_collections

from fbt_jax import sharding
from fbt_jax.flops import forward_flops, forward_flops_per_token
from fbt_jax.model import count_params


def dry_run(config: ml_collections.ConfigDict) -> str:
    if config.dry_run_devices:
        # Must happen before the first use of any backend in this process.
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", int(config.dry_run_devices))
    from fbt_jax.train import Trainer  # after the device set-up above

    config = config.copy_and_resolve_references()
    config.eval.num_batches = 0  # the train programs are what must fit
    lines: list[str] = []
    trainer = Trainer(config, log=lines.append)
    cfg, seq_len = trainer.model_cfg, config.data.seq_len
    state_bytes = sharding.per_device_bytes(trainer.abstract_state, trainer.state_shardings)
    param_bytes = sharding.per_device_bytes(trainer.abstract_state.params, trainer.state_shardings.params)
    out = [
        f"dry run of {config.workdir}: {count_params(trainer.abstract_state.params):,} parameters",
        "mesh "
        + " × ".join(f"{a}={n}" for a, n in trainer.mesh.shape.items())
        + f" over {trainer.mesh.size} {jax.devices()[0].platform} devices; sharding rules: {config.sharding.rules}",
        f"per-device parameters {param_bytes / 2**30:.3f} GiB, parameters + optimizer state "
        f"{state_bytes / 2**30:.3f} GiB",
        f"forward FLOPs per token, one pass (seq_len {seq_len}): "
        + ", ".join(f"{k} {v / 1e9:.3f} G" for k, v in forward_flops_per_token(cfg, seq_len).items()),
    ]
    for k in trainer.schedule.pass_counts:
        out.append(
            f"  K={k}: {forward_flops(cfg, seq_len, k) / 1e9:.3f} GFLOP/token forward, "
            f"{3 * forward_flops(cfg, seq_len, k) / 1e9:.3f} GFLOP/token train"
        )
    report = trainer.compile()
    out += lines
    out.append("dry run complete: nothing was allocated")
    trainer.dry_run_report = report
    return "\n".join(out)
