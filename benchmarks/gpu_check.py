"""GPU check: the accelerator computes what the CPU computes, then its speed and memory per K.

    bash benchmarks/gpu_check.sh             # on a machine with a GPU: about 3 minutes on one H200
    python benchmarks/gpu_check.py [--smoke] [--rounds 5] [--write-docs PATH]

1. Equality with the CPU reference. A small model (vocabulary 512, packed rows, prefix mix-in)
   computes its K-pass loss and gradients for K = 1, 2, 3 on the accelerator, with each attention
   implementation, and the CPU computes them with einsum attention in the same compute dtype.
   fp32 runs at the highest matmul precision (no TF32) and must agree to 1e-4 (relative to the
   largest entry of each result). bf16 (`dot_product` attention) is measured against the CPU's
   fp32 result and must be within 5e-2 of it or at most twice as far as the CPU's own bf16
   result (see `equality`). The logits of the three decoding modes (prefill, then teacher-forced
   cached steps) are compared the same way. A mismatch ends the run with exit status 1.
2. Speed and memory. The production train step (`fbt_jax.train.step.train_step`, compiled per K
   by the Trainer) of a ~350M-parameter config (D1024 L24 H16, T2048, vocabulary 32768, bf16
   compute, `dot_product` attention, scanned layers), timed for K = 1, 2, 3 in interleaved rounds:
   median step time, tokens/s, MFU against the device's table peak (fbt_jax/hardware.py) and
   against the rate of a large bf16 matmul on random data measured in the same run (the chip as
   found: clocks, power), t(K)/(K·t(1)), the compiled per-device memory and the peak memory the
   device reports.

`--smoke` runs both parts on whatever device there is (on a CPU-only machine: CPU against CPU,
bf16 `dot_product` attention against einsum at K = 2 and fused decoding, then the tiny config's
steps), to check the script itself; it is what the tests run. Last line: one JSON object.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402
from bench_configs import every_k_trainer, sized_config, tiny_config  # noqa: E402

from fbt_jax import decode  # noqa: E402
from fbt_jax.feedback import kpass_loss  # noqa: E402
from fbt_jax.flops import train_step_flops  # noqa: E402
from fbt_jax.hardware import peak_flops_per_device  # noqa: E402
from fbt_jax.model import ModelConfig, build_model  # noqa: E402

PASS_COUNTS = (1, 2, 3)
# (attention_impl, compute_dtype, tolerance relative to the reference's largest entry)
VARIANTS = (("einsum", "float32", 1e-4), ("dot_product", "float32", 1e-4), ("dot_product", "bfloat16", 5e-2))


def check_config() -> ModelConfig:
    return ModelConfig(vocab_size=512, embed_dim=128, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=384)


def check_batch(cfg: ModelConfig, batch_size: int = 4, seq_len: int = 64) -> dict[str, jax.Array]:
    """Two packed documents per row, a few masked targets, and every row's own fuse-from index."""
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch_size, seq_len), 0, cfg.vocab_size)
    half = seq_len // 2
    positions = jnp.tile(jnp.concatenate([jnp.arange(half), jnp.arange(seq_len - half)]), (batch_size, 1))
    segment_ids = jnp.tile(jnp.repeat(jnp.array([1, 2]), jnp.array([half, seq_len - half])), (batch_size, 1))
    weights = (jax.random.uniform(jax.random.PRNGKey(2), (batch_size, seq_len)) > 0.1).astype(jnp.float32)
    return {
        "inputs": tokens,
        "targets": jnp.where(weights > 0, jnp.roll(tokens, -1, 1), -100),
        "weights": weights,
        "positions": positions.astype(jnp.int32),
        "segment_ids": segment_ids.astype(jnp.int32),
        "fuse_from": jnp.array([1, 3, 7, 12], jnp.int32)[:batch_size],
    }


def loss_and_grads(cfg: ModelConfig, params: nnx.State, batch: dict, num_passes: int) -> tuple:
    graphdef = nnx.graphdef(build_model(cfg, 0))

    @jax.jit
    def run(params: nnx.State, batch: dict) -> tuple:
        def loss(params: nnx.State) -> jax.Array:
            examples = {k: v for k, v in batch.items() if k != "fuse_from"}
            return kpass_loss(nnx.merge(graphdef, params), examples, batch["fuse_from"], num_passes)[0]

        return jax.value_and_grad(loss)(params)

    return run(params, batch)


def decode_logits(cfg: ModelConfig, params: nnx.State, prompts: jax.Array, forced: jax.Array, mode: str) -> jax.Array:
    """Logits after the prefill and after each teacher-forced cached step, (steps + 1, B, V)."""
    graphdef = nnx.graphdef(build_model(cfg, 0))

    @jax.jit
    def run(params: nnx.State, prompts: jax.Array, forced: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, params)
        lengths = jnp.full((prompts.shape[0],), prompts.shape[1], jnp.int32)
        state = decode.prefill(model, prompts, lengths, prompts.shape[1] + forced.shape[1], mode)
        out = [state.logits_BV]
        for i in range(forced.shape[1]):
            state = decode.step(model, state, forced[:, i], mode)
            out.append(state.logits_BV)
        return jnp.stack(out).astype(jnp.float32)

    return run(params, prompts, forced)


def max_error(result, reference) -> float:
    """Largest |result − reference| over the tree, relative to the reference's largest entry."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(result), jax.tree.leaves(reference), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30))
    return worst


def equality(device: jax.Device, smoke: bool) -> dict:
    """Accelerator against CPU: loss and gradients per K and variant, then decoding logits. The
    reference runs on the CPU with einsum attention in the variant's compute dtype. In bf16 two
    correct implementations round differently, and the feedback recurrence (soft and fused decoding
    feed each step's state to the next) grows that difference step by step; so there both are
    measured against the CPU's fp32 result, and the accelerator passes where it is within the
    tolerance of it or at most twice as far from it as the CPU's own bf16 result is."""
    cpu = jax.devices("cpu")[0]
    base = check_config()
    params = nnx.state(build_model(base, 0), nnx.Param)
    on = {d: jax.device_put((params, check_batch(base)), d) for d in {cpu, device}}
    prompts, forced = on[cpu][1]["inputs"][:, :24], on[cpu][1]["inputs"][:, 24:32]
    # The smoke run checks the script, not a device: one variant, one K, one decoding mode.
    variants, pass_counts, modes = (VARIANTS[2:], (2,), ("fused",)) if smoke else (VARIANTS, PASS_COUNTS, decode.MODES)

    references: dict[tuple[str, str], Any] = {}  # (what, dtype): the CPU's einsum result, computed once

    def on_cpu(what: str, run: Callable, dtype: str) -> Any:
        if (what, dtype) not in references:
            references[what, dtype] = run(dataclasses.replace(base, compute_dtype=dtype), cpu)
        return references[what, dtype]

    def compare(what: str, run: Callable, cfg: ModelConfig, tol: float) -> tuple[float, float]:
        reference, result = on_cpu(what, run, cfg.compute_dtype), run(cfg, device)
        if cfg.compute_dtype == "float32":
            return max_error(result, reference), tol
        truth = on_cpu(what, run, "float32")
        return max_error(result, truth), max(tol, 2 * max_error(reference, truth))

    results = {}
    with jax.default_matmul_precision("highest"):
        for impl, dtype, tol in variants:
            cfg = dataclasses.replace(base, attention_impl=impl, compute_dtype=dtype)
            for k in pass_counts:
                train = lambda c, d, k=k: loss_and_grads(c, *on[d], k)
                results[f"train_{impl}_{dtype}_K{k}"] = compare(f"train_K{k}", train, cfg, tol)
            for mode in modes:
                logits = lambda c, d, mode=mode: decode_logits(c, on[d][0], *jax.device_put((prompts, forced), d), mode)
                results[f"decode_{mode}_{impl}_{dtype}"] = compare(f"decode_{mode}", logits, cfg, tol)
    return results


def speed_config(smoke: bool):
    if smoke:
        return tiny_config()
    config = sized_config(
        seq_len=2048,
        batch_size=8,
        vocab_size=32768,
        embed_dim=1024,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        mlp_dim=2816,
        compute_dtype="bfloat16",
        attention_impl="dot_product",
        scan_layers=True,
        loss_chunk_size=512,
        # jax.nn.dot_product_attention falls back to XLA's T×T attention for packed rows' masks
        # (first H200 run: 106 GiB at K=1 without remat): keep only block inputs for the backward.
        remat="block",
    )
    return config


def measured_peak(device: jax.Device, smoke: bool, repeats: int = 10) -> float:
    """FLOP/s of an n×n×n bf16 matmul on random data (never zeros: they run faster), the median of
    `repeats` after a warm-up; n = 8192 (256 on the smoke run)."""
    n = 256 if smoke else 8192
    a, b = (jax.device_put(jax.random.normal(jax.random.PRNGKey(i), (n, n), jnp.bfloat16), device) for i in (3, 4))
    matmul = jax.jit(lambda x, y: x @ y)
    for _ in range(3):
        matmul(a, b).block_until_ready()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        samples.append(time.perf_counter() - start)
    return 2.0 * n**3 / statistics.median(samples)


def speed(device: jax.Device, smoke: bool, rounds: int) -> dict:
    config = speed_config(smoke)
    trainer = every_k_trainer(config, [device])
    compiled = trainer.compile(PASS_COUNTS)
    trainer.init_state()
    batch = trainer.batch("train", 0, config.train.batch_size)
    state = trainer.state
    peak_in_use = {}
    for k in PASS_COUNTS:  # warm up each program; the device's running peak after each K
        for _ in range(2):
            state, metrics = trainer.programs.train[k](state, batch)
        jax.block_until_ready(metrics)
        stats = device.memory_stats() or {}  # None on a CPU
        peak_in_use[k] = stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None
    samples = {k: [] for k in PASS_COUNTS}
    for _ in range(rounds):
        for k in PASS_COUNTS:
            start = time.perf_counter()
            state, metrics = trainer.programs.train[k](state, batch)
            jax.block_until_ready((state, metrics))
            samples[k].append(time.perf_counter() - start)
    peak, peak_source = peak_flops_per_device(device)
    matmul_peak = measured_peak(device, smoke)
    cfg = ModelConfig.from_config(config.model)
    tokens = config.train.batch_size * config.data.seq_len
    rows = {}
    for k in PASS_COUNTS:
        t = statistics.median(samples[k])
        flops = train_step_flops(cfg, config.train.batch_size, config.data.seq_len, k)
        rows[k] = {
            "median_step_seconds": t,
            "tokens_per_second": tokens / t,
            "mfu": flops / t / peak,
            "mfu_measured_peak": flops / t / matmul_peak,
            "ratio_to_k_times_one_pass": t / (k * statistics.median(samples[1])),
            "compiled_device_gib": compiled[f"train_K{k}"].get("device_bytes", 0.0) / 2**30,
            "peak_in_use_gib": peak_in_use[k],
        }
    params = sum(x.size for x in jax.tree.leaves(state.params))
    return {"params": params, "tokens_per_step": tokens, "peak_flops": peak, "peak_source": peak_source,
            "measured_peak_flops": matmul_peak, "by_k": rows}  # fmt: skip


def main() -> None:
    args = docs_block.timing_arguments(__doc__, "gpu_check", rounds=5, steps_per_round=1)
    device = jax.devices()[0]
    if device.platform == "cpu" and not args.smoke:
        sys.exit("gpu_check.py: no accelerator here (jax.devices() lists only CPUs); run it where a GPU is, or --smoke")
    print(f"device: {device.device_kind} ({device.platform}); reference: {jax.devices('cpu')[0].device_kind}")
    checks = equality(device, args.smoke)
    failed = [name for name, (error, tol) in checks.items() if error > tol]
    check_rows = [[name, f"{error:.2e}", f"{tol:.3g}", "FAIL" if name in failed else "ok"]
                  for name, (error, tol) in checks.items()]  # fmt: skip
    check_table = docs_block.table(["check (accelerator against CPU)", "max error", "tolerance", ""], check_rows)
    print(check_table)
    perf = speed(device, args.smoke, args.rounds)
    peaks = f"{perf['peak_source']}; bf16 matmul measured: {perf['measured_peak_flops'] / 1e12:.3g} TFLOP/s"
    print(f"{perf['params'] / 1e6:.1f}M parameters, {perf['tokens_per_step']} tokens per step; peak {peaks}")
    header = ["K", "median step", "tokens/s", "MFU (table)", "MFU (measured)", "t(K)/(K·t(1))", "GiB compiled",
              "GiB peak in use"]  # fmt: skip
    rows = [
        [
            k,
            docs_block.ms(r["median_step_seconds"]),
            f"{r['tokens_per_second']:,.0f}",
            f"{r['mfu']:.1%}",
            f"{r['mfu_measured_peak']:.1%}",
            f"{r['ratio_to_k_times_one_pass']:.3f}",
            f"{r['compiled_device_gib']:.1f}",
            "n/a" if r["peak_in_use_gib"] is None else f"{r['peak_in_use_gib']:.1f}",
        ]
        for k, r in perf["by_k"].items()
    ]
    table = docs_block.table(header, rows)
    print(table)
    if args.write_docs:
        machine = docs_block.machine_line([device], peaks, args.smoke)
        docs_block.write_block(
            args.write_docs,
            "gpu_check",
            docs_block.block("gpu_check", docs_block.run_arguments(sys.argv[1:]), machine, [check_table, table]),
        )
    figures = {
        "checks": len(checks),
        "max_errors": {name: f"{error:.3e}" for name, (error, _) in checks.items()},  # 0 on CPU against CPU
        "speed": {k: v for k, v in perf.items() if k != "peak_source"},
    }
    print(json.dumps(figures))
    if failed:
        sys.exit(f"gpu_check.py: {len(failed)} result(s) differ from the CPU reference: {', '.join(failed)}")


if __name__ == "__main__":
    main()
