"""What the hardware offers: peak FLOP/s (for MFU) and memory per chip (for the dry run's fit).

Peaks are dense bf16 FLOP/s per chip, the figure MFU is usually quoted against; on a CPU, where no
table applies, a jitted fp32 matmul's rate is measured instead.
"""

from __future__ import annotations

import time
from typing import Any

from fbt_jax.errors import ConfigError

# Per chip, matched in order against the lowercased `device_kind`: the name a user gives
# (--config.dry_run_chip) and the dense bf16 peak FLOP/s.
CHIPS = (
    ("tpu v6", "v6e", 918e12),  # Trillium
    ("tpu v5 lite", "v5e", 197e12),
    ("tpu v5e", "v5e", 197e12),
    ("tpu v5", "v5p", 459e12),
    ("tpu v4", "v4", 275e12),
    ("h200", "h200", 989e12),
    ("h100", "h100", 989e12),  # SXM; the PCIe card is lower (756e12): override with train.peak_flops_per_device
    ("a100", "a100", 312e12),
    ("b200", "b200", 2250e12),
)

# Nominal memory per chip in GiB (a v4 chip's two cores share its 32 GiB).
CHIP_HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32, "a100": 80, "h100": 80, "h200": 141, "b200": 192}


def chip_hbm_gib(name: str) -> float:
    if name.lower() not in CHIP_HBM_GIB:
        raise ConfigError(f"dry_run_chip={name!r} is unknown; use one of {sorted(CHIP_HBM_GIB)} or set dry_run_hbm_gib")
    return float(CHIP_HBM_GIB[name.lower()])


def hbm_gib_of_kind(device_kind: str) -> float:
    """A chip's nominal memory from its `device_kind` ("TPU v5 lite" → 16); 0 where unknown."""
    kind = device_kind.lower()
    return float(next((CHIP_HBM_GIB[chip] for name, chip, _ in CHIPS if name in kind), 0))


def peak_flops_per_device(device: Any, measure_on_cpu: bool = True) -> tuple[float, str]:
    """(peak FLOP/s of one device, where that figure comes from): the table for a known
    accelerator; on a CPU, a jitted fp32 matmul's rate measured now (best of a few runs)."""
    kind = str(getattr(device, "device_kind", "")).lower()
    for name, _, peak in CHIPS:
        if name in kind:
            return peak, f"{device.device_kind}: {peak / 1e12:g} TFLOP/s dense bf16 (table)"
    if device.platform == "cpu" and measure_on_cpu:
        peak = measured_matmul_flops(device)
        return peak, f"cpu: {peak / 1e9:.1f} GFLOP/s (jitted fp32 matmul, measured)"
    return 0.0, f"{device.device_kind}: unknown peak (set train.peak_flops_per_device)"


def measured_matmul_flops(device: Any, n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an n×n fp32 matmul on `device`, best of `repeats` (the rate a CPU reaches)."""
    import jax
    import jax.numpy as jnp

    a = jax.device_put(jnp.ones((n, n), jnp.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best
