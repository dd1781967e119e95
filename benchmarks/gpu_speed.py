"""gpu_check's speed part: train-step rows (attention × remat × packing) and generation per mode.

A row is `impl:remat[:unpacked][@FWD/BWD]` (e.g. `auto:none`, `xla:block`, `cudnn:none:unpacked`,
`auto:none@64/32`: the Pallas-Triton kernel's forward and backward blocks, where it runs): the
production train step (`fbt_jax.train.step.train_step`, compiled per K by the Trainer) of the
shape's config with that attention implementation and remat policy, on packed rows (documents with
segment ids and positions, as text data trains) unless `unpacked`. Per K: the median step time of
interleaved rounds, tokens/s, MFU by two counts (attention's full T×T, and causal attention counted
as half, what MaxText reports) against the table peak and the bf16 matmul rate measured in the same
run, t(K)/(K·t(1)), compiled and peak memory. A row that does not fit says so and the run goes on.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from bench_configs import every_k_trainer, fbt_1b_config, sized_config, tiny_config

from fbt_jax import attention, decode
from fbt_jax.attention import pallas_gpu
from fbt_jax.flops import train_step_flops
from fbt_jax.model import ModelConfig, build_model

PASS_COUNTS = (1, 2, 3)


def shape_config(shape: str, smoke: bool, batch_size: int = 0):
    """The config a shape's rows train: `344m` (D1024 L24 H16, T2048, batch 8, vocabulary 32768)
    or `1b` (configs/fbt_1b.py's model on one device); the tiny config on a smoke run."""
    if smoke:
        config = tiny_config()
        config.train.batch_size = batch_size or config.train.batch_size
        return config
    if shape == "1b":
        config = fbt_1b_config()
        config.mesh.data, config.mesh.fsdp, config.dry_run_devices, config.dry_run_chip = 1, 1, 0, ""
        config.train.microbatches = 1
        config.train.batch_size = batch_size or 8
        return config
    return sized_config(
        seq_len=2048,
        batch_size=batch_size or 8,
        vocab_size=32768,
        embed_dim=1024,
        num_layers=24,
        num_heads=16,
        num_kv_heads=16,
        mlp_dim=2816,
        compute_dtype="bfloat16",
        scan_layers=True,
        loss_chunk_size=512,
    )


@dataclasses.dataclass(frozen=True)
class Row:
    impl: str
    remat: str
    packed: bool
    pallas_blocks: tuple[int, int] | None = None  # (forward, backward) of the Pallas-Triton kernel

    @classmethod
    def parse(cls, text: str) -> Row:
        spec, _, blocks = text.partition("@")
        impl, *parts = spec.split(":")
        remat, rest = (parts[0] if parts else "block"), parts[1:]
        sizes = blocks.split("/") if blocks else []
        if impl not in attention.IMPLS or rest not in ([], ["unpacked"]) or not all(s.isdigit() for s in sizes):
            raise SystemExit(
                f"gpu_check.py: row {text!r} is not impl:remat[:unpacked][@FWD/BWD] with impl in {attention.IMPLS}"
            )
        return cls(impl, remat, not rest, tuple(int(s) for s in sizes) if len(sizes) == 2 else None)

    def __str__(self) -> str:
        blocks = "" if self.pallas_blocks is None else "@{}/{}".format(*self.pallas_blocks)
        return f"{self.impl}:{self.remat}" + ("" if self.packed else ":unpacked") + blocks


def packed_batch(batch: dict, seq_len: int) -> dict:
    """The Trainer's batch made packed rows: each row documents of 1/2, 1/4 and 1/4 of the row."""
    cuts = [0, seq_len // 2, 3 * seq_len // 4, seq_len]
    segments = np.concatenate([np.full(b - a, i + 1) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))])
    positions = np.concatenate([np.arange(b - a) for a, b in zip(cuts, cuts[1:])])
    rows = batch["inputs"].shape[0]
    extra = {"segment_ids": np.tile(segments, (rows, 1)), "positions": np.tile(positions, (rows, 1))}
    return batch | {k: jax.device_put(v.astype(np.int32), batch["inputs"].sharding) for k, v in extra.items()}


def train_row(row: Row, shape: str, device: Any, smoke: bool, rounds: int, peaks: dict, batch_size: int = 0) -> dict:
    """One row's figures per K, or {"error": why} when it does not compile or fit."""
    config = shape_config(shape, smoke, batch_size)
    config.model.attention_impl, config.model.remat = row.impl, row.remat
    defaults = pallas_gpu.FORWARD_BLOCK, pallas_gpu.BACKWARD_BLOCK
    if row.pallas_blocks:  # read when the kernel is traced: set for this row's compiles only
        pallas_gpu.FORWARD_BLOCK, pallas_gpu.BACKWARD_BLOCK = row.pallas_blocks
    # The smoke run times K = 1 (the t(K)/(K·t(1)) baseline) and 2 (feedback): K = 3 is a third
    # compile of the same program that would add only time.
    pass_counts = (1, 2) if smoke else PASS_COUNTS
    try:
        return _time_row(config, row, device, rounds, peaks, pass_counts)
    except Exception as error:  # out of memory, or a kernel this device cannot compile: the row says so
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}
    finally:
        pallas_gpu.FORWARD_BLOCK, pallas_gpu.BACKWARD_BLOCK = defaults


def _time_row(config, row: Row, device: Any, rounds: int, peaks: dict, pass_counts: tuple[int, ...]) -> dict:
    packed = row.packed  # the Trainer reads the built-in task; packing is added to its batch
    trainer = every_k_trainer(config, [device])
    trainer.programs.packed = packed
    compiled = trainer.compile(pass_counts)
    trainer.init_state()
    batch = trainer.batch("train", 0, config.train.batch_size)
    if packed:
        batch = packed_batch(batch, config.data.seq_len)
    state, peak_in_use, samples = trainer.state, {}, {k: [] for k in pass_counts}
    for k in pass_counts:  # warm up each program; the device's running peak after each K
        for _ in range(2):
            state, metrics = trainer.programs.train[k](state, batch)
        jax.block_until_ready(metrics)
        stats = device.memory_stats() or {}  # None on a CPU
        peak_in_use[k] = stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None
    for _ in range(rounds):
        for k in pass_counts:
            start = time.perf_counter()
            state, metrics = trainer.programs.train[k](state, batch)
            jax.block_until_ready((state, metrics))
            samples[k].append(time.perf_counter() - start)
    cfg = ModelConfig.from_config(config.model)
    B, T = config.train.batch_size, config.data.seq_len
    chosen = attention.describe(cfg.attention_impl, device.platform, cfg.compute_dtype, packed, 0, cfg.head_size)
    by_k = {}
    for k in pass_counts:
        t = statistics.median(samples[k])
        flops, flops_half = (train_step_flops(cfg, B, T, k, causal_half=c) for c in (False, True))
        by_k[k] = {
            "median_step_seconds": t,
            "tokens_per_second": B * T / t,
            "mfu": flops / t / peaks["table"],
            "mfu_measured_peak": flops / t / peaks["measured"],
            "mfu_causal_half_measured_peak": flops_half / t / peaks["measured"],
            "ratio_to_k_times_one_pass": t / (k * statistics.median(samples[1])),
            "compiled_device_gib": compiled[f"train_K{k}"].get("device_bytes", 0.0) / 2**30,
            "peak_in_use_gib": peak_in_use[k],
        }
    params = sum(x.size for x in jax.tree.leaves(state.params))
    return {"attention": chosen, "params": params, "batch_size": B, "tokens_per_step": B * T, "by_k": by_k}


def largest_batch(shape: str, row: Row, device: Any, smoke: bool, candidates=(32, 24, 16, 12, 8, 4, 2, 1)) -> int:
    """The largest per-device batch whose K = 3 program (the largest) compiles within the device's
    memory, from the compiler's own figure (each candidate is compiled, never run)."""
    limit = (device.memory_stats() or {}).get("bytes_limit", 0)
    for batch_size in (32,) if smoke else candidates:
        config = shape_config(shape, smoke, batch_size)
        config.model.attention_impl, config.model.remat = row.impl, row.remat
        try:
            report = every_k_trainer(config, [device]).compile((3,))
        except Exception:  # resource exhausted while compiling: try a smaller batch
            continue
        if not limit or report["train_K3"].get("device_bytes", 0) <= 0.92 * limit:
            return batch_size
    raise SystemExit(f"gpu_check.py: no batch of {candidates} fits {shape} with {row} on {device.device_kind}")


def generation(shape: str, device: Any, smoke: bool, batches=(1, 64), prompt: int = 128, new: int = 128) -> list:
    """Generated tokens/s per decoding mode at each batch (random weights, greedy, no stop token),
    and each mode's time per token relative to standard (what feedback costs per token)."""
    config = shape_config(shape, smoke)
    cfg = dataclasses.replace(ModelConfig.from_config(config.model), remat="none")
    repeats = 3
    if smoke:
        batches, prompt, new, repeats = (2,), 8, 8, 1
    with jax.default_device(device):
        model = build_model(cfg, 0)
        rows = []
        for B in batches:
            prompts = jax.random.randint(jax.random.PRNGKey(B), (B, prompt), 0, cfg.vocab_size)
            lengths = jnp.full((B,), prompt, jnp.int32)
            seconds = {}
            for mode in decode.MODES:
                decode.generate(model, prompts, lengths, new, mode)[0].block_until_ready()  # compile
                runs = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    decode.generate(model, prompts, lengths, new, mode)[0].block_until_ready()
                    runs.append(time.perf_counter() - start)
                seconds[mode] = statistics.median(runs)
            for mode, t in seconds.items():
                rows.append({"batch": B, "mode": mode, "tokens_per_second": B * new / t,
                             "time_vs_standard": t / seconds["standard"]})  # fmt: skip
    return rows
