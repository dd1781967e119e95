"""GPU check: the accelerator computes what the CPU computes, then its speed and memory per K.

    bash benchmarks/gpu_check.sh             # on a machine with a GPU: every check, both shapes (< 10 min on one H200)
    python benchmarks/gpu_check.py [--smoke] [--shape 344m|1b] [--rows auto:none,xla:block,...]
                                   [--generation] [--rounds 5] [--write-docs PATH]

1. Equality with the CPU reference. A small model (vocabulary 512, packed rows, prefix mix-in)
   computes its K-pass loss and gradients for K = 1, 2, 3 on the accelerator with every attention
   implementation the device offers (fbt_jax/attention: the reference, `dot_product`, and on a GPU
   cuDNN (bf16, rows not packed) and the Pallas-Triton kernel, on a TPU Splash), and the CPU computes
   them with the reference attention in the same compute dtype. fp32 runs at the highest matmul
   precision (no TF32) and must agree to 1e-4 (relative to the largest entry of each result). bf16 is
   measured against the CPU's fp32 result and must be within 5e-2 of it or at most twice as far as
   the CPU's own bf16 result (see `equality`). The logits of the three decoding modes (prefill, then
   teacher-forced cached steps) are compared the same way. A mismatch ends the run with exit status 1.
2. Speed and memory (benchmarks/gpu_speed.py): each `--rows` entry `impl:remat[:unpacked][@FWD/BWD]` trains
   the shape's config (`344m`: D1024 L24 H16, T2048, batch 8, vocabulary 32768, bf16 compute,
   scanned layers; `1b`: configs/fbt_1b.py's model at the largest batch that fits, `--batch 0`) on
   packed rows for K = 1, 2, 3: median step time, tokens/s, MFU by two counts against the table peak
   and a bf16 matmul measured in the same run, t(K)/(K·t(1)), memory. `--generation`: generated
   tokens/s per decoding mode at batch 1 and 64, and each mode's time per token against standard.

`--smoke` runs every part on whatever device there is (on a CPU-only machine: CPU against CPU, one
variant at K = 2 and fused decoding over two steps, the tiny config's rows at K = 1 and 2 and its
generation), to check the script itself; it is what the tests run. Last line: one JSON object.
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
import gpu_speed  # noqa: E402

from fbt_jax import attention, decode  # noqa: E402
from fbt_jax.attention.spec import Call, unsupported  # noqa: E402
from fbt_jax.feedback import kpass_loss  # noqa: E402
from fbt_jax.hardware import peak_flops_per_device  # noqa: E402
from fbt_jax.model import ModelConfig, build_model  # noqa: E402

PASS_COUNTS = (1, 2, 3)
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}  # relative to the reference's largest entry
# The speed rows gpu_check.sh measures per shape, most wanted first (a run stopped by its time limit
# keeps the rows it finished): the attention `auto` picks without remat, cuDNN on rows that are not
# packed (the flash bound), the other remat policies, other Pallas-Triton blocks.
DEFAULT_ROWS = {
    "344m": "auto:none,cudnn:none:unpacked,auto:block,auto:save_matmuls,auto:none@128/64",
    "1b": "auto:block",
}


def variants(platform: str, smoke: bool) -> list[tuple[str, str, bool]]:
    """(attention_impl, compute dtype, packed rows) for every implementation the device offers:
    on packed rows where it can, else on rows that are not packed (cuDNN)."""
    if smoke:
        return [("dot_product", "bfloat16", True)]
    offered = []
    for impl in ("xla", "dot_product", *attention.spec.KERNELS):
        for dtype in TOLERANCE:
            for packed in (True, False):
                if unsupported(impl, Call(platform, dtype, packed, 0, check_config().head_size)) is None:
                    offered.append((impl, dtype, packed))
                    break
    return offered


def check_config() -> ModelConfig:
    return ModelConfig(vocab_size=512, embed_dim=128, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=384)


def check_batch(cfg: ModelConfig, batch_size: int = 4, seq_len: int = 64, packed: bool = True) -> dict:
    """Two packed documents per row (unless not `packed`: one document), a few masked targets, and
    every row its own fuse-from index."""
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch_size, seq_len), 0, cfg.vocab_size)
    half = seq_len // 2
    positions = jnp.tile(jnp.concatenate([jnp.arange(half), jnp.arange(seq_len - half)]), (batch_size, 1))
    segment_ids = jnp.tile(jnp.repeat(jnp.array([1, 2]), jnp.array([half, seq_len - half])), (batch_size, 1))
    weights = (jax.random.uniform(jax.random.PRNGKey(2), (batch_size, seq_len)) > 0.1).astype(jnp.float32)
    batch = {
        "inputs": tokens,
        "targets": jnp.where(weights > 0, jnp.roll(tokens, -1, 1), -100),
        "weights": weights,
        "fuse_from": jnp.array([1, 3, 7, 12], jnp.int32)[:batch_size],
    }
    if not packed:
        return batch
    return batch | {"positions": positions.astype(jnp.int32), "segment_ids": segment_ids.astype(jnp.int32)}


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
    reference runs on the CPU with the reference attention in the variant's compute dtype. In bf16
    two correct implementations round differently, and the feedback recurrence (soft and fused
    decoding feed each step's state to the next) grows that difference step by step; so there both
    are measured against the CPU's fp32 result, and the accelerator passes where it is within the
    tolerance of it or at most twice as far from it as the CPU's own bf16 result is."""
    cpu = jax.devices("cpu")[0]
    base = dataclasses.replace(check_config(), attention_impl="xla")
    params = nnx.state(build_model(base, 0), nnx.Param)
    on = {
        (d, packed): jax.device_put((params, check_batch(base, packed=packed)), d)
        for d in {cpu, device}
        for packed in (True, False)
    }
    # The smoke run checks the script, not a device: one variant, one K, one decoding mode, and two
    # teacher-forced steps (each step is unrolled into the compiled program: eight cost compile time).
    forced_steps = 2 if smoke else 8
    prompts, forced = on[cpu, True][1]["inputs"][:, :24], on[cpu, True][1]["inputs"][:, 24 : 24 + forced_steps]
    pass_counts, modes = ((2,), ("fused",)) if smoke else (PASS_COUNTS, decode.MODES)

    references: dict[tuple, Any] = {}  # (what, dtype): the CPU's reference result, computed once

    def on_cpu(what: str, run: Callable, dtype: str) -> Any:
        if (what, dtype) not in references:
            references[what, dtype] = run(dataclasses.replace(base, compute_dtype=dtype), cpu)
        return references[what, dtype]

    def compare(what: str, run: Callable, cfg: ModelConfig) -> tuple[float, float]:
        tol = TOLERANCE[cfg.compute_dtype]
        reference, result = on_cpu(what, run, cfg.compute_dtype), run(cfg, device)
        if cfg.compute_dtype == "float32":
            return max_error(result, reference), tol
        truth = on_cpu(what, run, "float32")
        return max_error(result, truth), max(tol, 2 * max_error(reference, truth))

    results = {}
    with jax.default_matmul_precision("highest"):
        for impl, dtype, packed in variants(device.platform, smoke):
            cfg = dataclasses.replace(base, attention_impl=impl, compute_dtype=dtype)
            rows = "" if packed else "_unpacked"
            for k in pass_counts:
                train = lambda c, d, k=k, p=packed: loss_and_grads(c, *on[d, p], k)
                results[f"train{rows}_{impl}_{dtype}_K{k}"] = compare(f"train{rows}_K{k}", train, cfg)
            for mode in modes:
                logits = lambda c, d, m=mode: decode_logits(c, on[d, True][0], *jax.device_put((prompts, forced), d), m)
                results[f"decode_{mode}_{impl}_{dtype}"] = compare(f"decode_{mode}", logits, cfg)
    return results


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


def main() -> None:
    args = docs_block.arguments(
        __doc__,
        "gpu_check",
        "tiny sizes and one round: checks that it runs",
        extra=[
            ("--rounds", dict(type=int, default=5)),
            ("--shape", dict(choices=tuple(DEFAULT_ROWS), default="344m")),
            ("--rows", dict(default="", help="impl:remat[:unpacked][@FWD/BWD],... (default: DEFAULT_ROWS)")),
            ("--batch", dict(type=int, default=-1, help="per-device batch; 0: the largest that fits (1b's default)")),
            ("--generation", dict(action="store_true", help="also generated tokens/s per decoding mode")),
            ("--skip-equality", dict(action="store_true", help="only the speed part (a second shape's run)")),
        ],
        variant=variant,
    )
    device = jax.devices()[0]
    if device.platform == "cpu" and not args.smoke:
        sys.exit("gpu_check.py: no accelerator here (jax.devices() lists only CPUs); run it where a GPU is, or --smoke")
    rows = [
        gpu_speed.Row.parse(r)
        for r in (args.rows or ("auto:none" if args.smoke else DEFAULT_ROWS[args.shape])).split(",")
    ]
    print(f"device: {device.device_kind} ({device.platform}); reference: {jax.devices('cpu')[0].device_kind}")
    peak, peak_source = peak_flops_per_device(device)
    peaks = {"table": peak, "measured": measured_peak(device, args.smoke)}
    peak_line = f"{peak_source}; bf16 matmul measured: {peaks['measured'] / 1e12:.3g} TFLOP/s"
    checks = {} if args.skip_equality else equality(device, args.smoke)
    failed = [name for name, (error, tol) in checks.items() if error > tol]
    figures = {"checks": len(checks), "max_errors": {n: f"{e:.3e}" for n, (e, _) in checks.items()},
               "peaks": peaks, "rows": {}}  # fmt: skip

    def write(final: bool = False) -> None:
        """The block as measured so far: rewritten after every part, so that a run stopped by its
        time limit (gpu_check.sh) still leaves what it measured."""
        tables = [check_table(checks, failed)] if checks else []
        if figures["rows"]:
            tables.append(speed_table(figures["rows"]))
        if "generation" in figures:
            tables.append(generation_table(figures["generation"]))
        if final:
            print("\n\n".join(tables))
        if args.write_docs:
            machine = docs_block.machine_line([device], peak_line, args.smoke)
            notes = [] if final else ["Partial: the run stopped before its remaining rows."]
            body = docs_block.block("gpu_check", docs_block.run_arguments(sys.argv[1:]), machine, tables, notes)
            docs_block.write_block(args.write_docs, "gpu_check", body, variant=variant(args))

    write()
    batch = args.batch if args.batch >= 0 else (0 if args.shape == "1b" or args.smoke else 8)
    if batch == 0:  # the smoke run checks the search too
        batch = gpu_speed.largest_batch(args.shape, rows[0], device, args.smoke)
    figures["batch_size"] = batch
    print(f"shape {'tiny (smoke)' if args.smoke else args.shape}, batch {batch} per device; peak {peak_line}")
    for row in rows:
        figures["rows"][str(row)] = gpu_speed.train_row(row, args.shape, device, args.smoke, args.rounds, peaks, batch)
        write()
    if args.generation or args.smoke:
        figures["generation"] = gpu_speed.generation(args.shape, device, args.smoke)
    write(final=True)
    print(json.dumps(figures, default=float))
    if failed:
        sys.exit(f"gpu_check.py: {len(failed)} result(s) differ from the CPU reference: {', '.join(failed)}")


def variant(args) -> str:
    """The docs block a run writes: the 344m shape's, or the 1b shape's own."""
    return "" if args.shape == "344m" else f"--shape={args.shape}"


def check_table(checks: dict, failed: list) -> str:
    rows = [[name, f"{error:.2e}", f"{tol:.3g}", "FAIL" if name in failed else "ok"]
            for name, (error, tol) in checks.items()]  # fmt: skip
    return docs_block.table(["check (accelerator against CPU)", "max error", "tolerance", ""], rows)


def generation_table(generation: list) -> str:
    rows = [[g["batch"], g["mode"], f"{g['tokens_per_second']:,.0f}", f"{g['time_vs_standard']:.3f}"]
            for g in generation]  # fmt: skip
    return docs_block.table(["batch", "mode", "generated tokens/s", "time per token / standard's"], rows)


def speed_table(results: dict) -> str:
    header = ["row (attention:remat)", "attention run", "K", "median step", "tokens/s", "MFU (table)",
              "MFU (measured)", "MFU causal ½ (measured)", "t(K)/(K·t(1))", "GiB compiled", "GiB peak"]  # fmt: skip
    lines = []
    for name, result in results.items():
        if "error" in result:
            lines.append([name, "did not run: " + result["error"].replace("|", "/"), *[""] * 9])
            continue
        for k, r in result["by_k"].items():
            peak_gib = "n/a" if r["peak_in_use_gib"] is None else f"{r['peak_in_use_gib']:.1f}"
            lines.append([
                name, result["attention"].removeprefix("attention: "), k, docs_block.ms(r["median_step_seconds"]),
                f"{r['tokens_per_second']:,.0f}", f"{r['mfu']:.1%}", f"{r['mfu_measured_peak']:.1%}",
                f"{r['mfu_causal_half_measured_peak']:.1%}", f"{r['ratio_to_k_times_one_pass']:.3f}",
                f"{r['compiled_device_gib']:.1f}", peak_gib,
            ])  # fmt: skip
    return docs_block.table(header, lines)


if __name__ == "__main__":
    main()
