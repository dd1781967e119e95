"""fbt-serve under load: generated tokens/s, requests/s and time to first token at 1, 8 and 32
concurrent clients per decoding mode, against the same requests sent one by one to fbt-decode's
Python path (`decode.generate`), and what sharing one pool across modes costs.

A pool of 32 slots on a random-weight model (tiny and cpu_medium of bench_configs) is served over
HTTP by uvicorn in this process, as `fbt-serve` serves it. Each client is an async HTTP client
streaming `/v1/completions` requests one after another from a shared list (prompts of 8 to 32
tokens, `--new-tokens` greedy tokens each, no stop): the time to first token is from sending a
request to its first text chunk; tokens/s and requests/s are totals over the wall time of the
whole list. The baseline runs each request alone through `decode.generate` (compiled for every
prompt length first). Under load, soft/standard per token is the ratio of their tokens/s at the
most clients. The shared pool's step (every slot's mode as data: the fusion computed for all, kept
for soft and fused slots) is timed against a standard-only decode step of the same batch and cache
(`decode.step`), the cost of serving the modes from one pool instead of three. The KV cache's
occupancy (tokens held / positions allocated, averaged over decode steps) is what a paged cache
would reclaim (docs/serving.md).

    python benchmarks/serve_throughput.py [--requests 64] [--new-tokens 32] [--smoke] [--write-docs PATH]

`--smoke` runs the tiny model with 1 and 2 clients, 4 requests of 4 tokens (seconds);
`--write-docs PATH` rewrites the `benchmarks/serve_throughput.py` block of PATH (see docs_block.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402
from bench_configs import cpu_medium_config, tiny_config  # noqa: E402

from fbt_jax import decode  # noqa: E402
from fbt_jax.model import ModelConfig, build_model  # noqa: E402
from fbt_jax.serve import engine  # noqa: E402
from fbt_jax.serve.api import Served, create_app  # noqa: E402
from fbt_jax.serve.metrics import Metrics  # noqa: E402
from fbt_jax.serve.pool import Pool  # noqa: E402
from fbt_jax.serve.text import Codec  # noqa: E402

SHAPE = {"slots": 32, "context": 64, "buckets": (32,), "prompts": (8, 16, 24, 32)}
SMOKE_SHAPE = {"slots": 4, "context": 16, "buckets": (), "prompts": (8,)}  # one prefill bucket, one length


def requests_for(count: int, vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, lengths[i % len(lengths)]).tolist() for i in range(count)]


async def load(url: str, model: str, prompts: list[list[int]], new_tokens: int, clients: int) -> dict[str, float]:
    """`clients` streaming clients working through `prompts`; totals and time-to-first-token quantiles."""
    import httpx

    queue = list(reversed(prompts))
    first_token, tokens = [], 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while queue:
            prompt = queue.pop()
            body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True}
            sent, first = time.perf_counter(), None
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                text = ""
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])["choices"][0]
                        if first is None and chunk["text"]:
                            first = time.perf_counter() - sent
                        text += chunk["text"]
            first_token.append(first)
            tokens += len(text.split())

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients + 1)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    wall = time.perf_counter() - start
    if tokens != len(prompts) * new_tokens:
        raise RuntimeError(f"{model}: {tokens} tokens came back, not {len(prompts) * new_tokens}")
    ttft = sorted(first_token)
    return {"clients": clients, "tokens_per_second": tokens / wall, "requests_per_second": len(prompts) / wall,
            "ttft_p50_seconds": float(np.percentile(ttft, 50)), "ttft_p99_seconds": float(np.percentile(ttft, 99)),
            "wall_seconds": wall}  # fmt: skip


def one_by_one(model, prompts: list[list[int]], new_tokens: int, mode: str) -> dict[str, float]:
    """Each request alone through decode.generate (fbt-decode's path), timed on a second pass over the
    requests (the first compiled every prompt length)."""
    for prompt in prompts:
        jax.block_until_ready(
            decode.generate(model, jnp.asarray([prompt]), jnp.asarray([len(prompt)]), new_tokens, mode)
        )
    start, first = time.perf_counter(), []
    for prompt in prompts:
        sent = time.perf_counter()
        tokens, _ = decode.generate(model, jnp.asarray([prompt]), jnp.asarray([len(prompt)]), new_tokens, mode)
        jax.block_until_ready(tokens)
        first.append(time.perf_counter() - sent)  # a batch-CLI answer arrives whole
    wall = time.perf_counter() - start
    return {"tokens_per_second": len(prompts) * new_tokens / wall, "requests_per_second": len(prompts) / wall,
            "ttft_p50_seconds": float(np.percentile(first, 50)), "ttft_p99_seconds": float(np.percentile(first, 99))}  # fmt: skip


def shared_step_cost(pool: Pool, repeats: int) -> dict[str, float]:
    """The pool's step (standard slots, modes as data) against decode.step in standard mode alone."""
    model, S = pool.model, pool.num_slots
    state = decode.DecodeState(pool.slots.cache_L, pool.slots.lengths_S + 1, pool.slots.h_last_SD, pool.slots.logits_SV)
    plain = jax.jit(decode.step, static_argnums=(3,))
    tokens = jnp.zeros((S,), jnp.int32)
    sampling = engine.Sampling(*(np.zeros((S,), d) for d in (np.float32,)), np.ones((S,), np.float32),
                               *(np.zeros((S,), np.int32) for _ in range(3)))  # fmt: skip
    slots = engine.empty_slots(model, S, pool.context_len)
    jax.block_until_ready(plain(model, state, tokens, "standard"))
    slots, _ = engine.steps(pool.graphdef, 1, pool.params, slots, sampling)
    times = {"shared": [], "standard_only": []}
    for _ in range(repeats):  # interleaved
        start = time.perf_counter()
        slots, chosen = engine.steps(pool.graphdef, 1, pool.params, slots, sampling)
        jax.block_until_ready(chosen.token_S)
        times["shared"].append(time.perf_counter() - start)
        start = time.perf_counter()
        jax.block_until_ready(plain(model, state, tokens, "standard"))
        times["standard_only"].append(time.perf_counter() - start)
    shared, alone = statistics.median(times["shared"]), statistics.median(times["standard_only"])
    return {"shared_step_seconds": shared, "standard_step_seconds": alone, "shared_over_standard": shared / alone}


def main() -> None:
    args = docs_block.arguments(
        __doc__,
        "serve_throughput",
        "the tiny model, 1 and 2 clients, 4 requests of 4 tokens: checks that it runs",
        extra=[
            ("--requests", dict(type=int, default=64)),
            ("--new-tokens", dict(type=int, default=32)),
            ("--repeats", dict(type=int, default=3)),
        ],
    )
    configs, client_counts = (("tiny", tiny_config()), ("cpu_medium", cpu_medium_config())), (1, 8, 32)
    if args.smoke:
        configs, client_counts, args.requests, args.new_tokens, args.repeats = configs[:1], (1, 2), 4, 4, 1
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    out = {"sizes": {**shape, "prompts": list(shape["prompts"]), "buckets": list(shape["buckets"]), "requests": args.requests,
                     "new_tokens": args.new_tokens, "repeats": args.repeats}, "results": {}}  # fmt: skip
    for name, config in configs:
        model = build_model(ModelConfig.from_config(config.model), seed=0)
        prompts = requests_for(args.requests, model.cfg.vocab_size, shape["prompts"])
        out["results"][name] = serve_model(
            model, shape, prompts, args.new_tokens, client_counts, args.repeats, args.smoke
        )
        out["results"][name] |= {"embed_dim": config.model.embed_dim, "num_layers": config.model.num_layers}
    for name, r in out["results"].items():
        print(
            f"{name}: compile {r['compile_seconds']:.1f} s; shared/standard step {r['step']['shared_over_standard']:.3f}"
        )
        for mode in decode.MODES:
            base = r[mode]["one_by_one"]
            print(f"  {mode:<9} one by one {base['tokens_per_second']:8.1f} tok/s")
            for row in r[mode]["served"]:
                print(f"  {mode:<9} {row['clients']:>3} clients {row['tokens_per_second']:8.1f} tok/s "
                      f"{row['requests_per_second']:6.2f} req/s ttft p50 {row['ttft_p50_seconds'] * 1e3:7.1f} ms "
                      f"p99 {row['ttft_p99_seconds'] * 1e3:7.1f} ms")  # fmt: skip
    if args.write_docs:
        docs_block.write_block(args.write_docs, "serve_throughput", docs_text(out, args.smoke))
    print(json.dumps(out))


def serve_model(model, shape: dict, prompts: list[list[int]], new_tokens: int, client_counts: tuple[int, ...], repeats: int,
                smoke: bool) -> dict:  # fmt: skip
    """Every mode at every client count through one served pool (`repeats` times, the modes' order
    rotated each time; medians), then the one-by-one baselines and the shared step's cost."""
    from fbt_jax.serve.cli import running

    slots, context = shape["slots"], shape["context"]
    metrics = Metrics(slots)
    pool = Pool(model, slots, context, buckets=shape["buckets"] or None, metrics=metrics)
    programs, compile_seconds = pool.compile()
    served = Served("bench", pool, Codec(types.SimpleNamespace(source="task")), model.cfg.vocab_size)
    counter = lambda name: metrics.registry.get_sample_value(name) or 0.0
    rows: dict[tuple[str, int], list[dict]] = {}
    with running(create_app(served)) as url:
        asyncio.run(load(url, "bench", prompts[:2], 2, 1))  # the HTTP path warmed once
        modes = list(zip(decode.MODES, served.model_ids()))
        for r in range(repeats):
            for mode, model_id in modes[r % 3 :] + modes[: r % 3]:
                for n in client_counts:
                    held, steps = counter("fbt_kv_positions_held_total"), counter("fbt_decode_steps_total")
                    row = asyncio.run(load(url, model_id, prompts, new_tokens, n))
                    steps = counter("fbt_decode_steps_total") - steps
                    row["kv_occupancy"] = (counter("fbt_kv_positions_held_total") - held) / (steps * slots * context)
                    rows.setdefault((mode, n), []).append(row)
    median = lambda values: {key: statistics.median(v[key] for v in values) for key in values[0]}
    out: dict = {"programs": programs, "compile_seconds": compile_seconds}
    for mode in decode.MODES:
        baseline = [one_by_one(model, prompts, new_tokens, mode) for _ in range(repeats)]
        out[mode] = {"served": [median(rows[mode, n]) for n in client_counts], "one_by_one": median(baseline)}
    most = -1
    out["soft_over_standard_per_token"] = (
        out["standard"]["served"][most]["tokens_per_second"] / out["soft"]["served"][most]["tokens_per_second"]
    )
    out["step"] = shared_step_cost(pool, 5 if smoke else 50)
    return out


def docs_text(out: dict, smoke: bool) -> str:
    sizes = out["sizes"]
    intro = (
        f"{sizes['requests']} streaming requests per row (prompts of {'/'.join(map(str, sizes['prompts']))} tokens in "
        f"turn, {sizes['new_tokens']} greedy tokens each, no stop) over HTTP to one pool of {sizes['slots']} slots "
        f"(context {sizes['context']}), random weights, one device. *One by one*: the same requests, each alone "
        "through `decode.generate` (fbt-decode's path), compiled first; its time to first token is the whole answer's. "
        "Time to first token (TTFT) is from sending a request to its first text chunk. Medians of "
        f"{sizes['repeats']} repeat{'s' * (sizes['repeats'] != 1)}, the modes' order rotated:"
    )
    header = ["model", "mode", "clients", "tokens/s", "requests/s", "TTFT p50", "TTFT p99", "× one by one",
              "KV occupancy"]  # fmt: skip
    rows = []
    for name, r in out["results"].items():
        for mode in decode.MODES:
            base = r[mode]["one_by_one"]
            rows.append([f"{name} (D={r['embed_dim']}, L={r['num_layers']})", mode, "one by one",
                         docs_block.rate(base["tokens_per_second"]), f"{base['requests_per_second']:.2f}",
                         docs_block.ms(base["ttft_p50_seconds"]), docs_block.ms(base["ttft_p99_seconds"]), "1",
                         "–"])  # fmt: skip
            for row in r[mode]["served"]:
                rows.append([f"{name} (D={r['embed_dim']}, L={r['num_layers']})", mode, row["clients"],
                             docs_block.rate(row["tokens_per_second"]), f"{row['requests_per_second']:.2f}",
                             docs_block.ms(row["ttft_p50_seconds"]), docs_block.ms(row["ttft_p99_seconds"]),
                             f"{row['tokens_per_second'] / base['tokens_per_second']:.2f}",
                             f"{row['kv_occupancy']:.0%}"])  # fmt: skip
    cost_header = ["model", "soft/standard per token (most clients)", "shared step / standard-only step",
                   "programs", "compile"]  # fmt: skip
    cost_rows = [[name, f"{r['soft_over_standard_per_token']:.3f}", f"{r['step']['shared_over_standard']:.3f}",
                  r["programs"], f"{r['compile_seconds']:.1f} s"] for name, r in out["results"].items()]  # fmt: skip
    notes = [
        "Soft/standard per token: standard's tokens/s over soft's at the most clients. Shared/standard-only step: "
        "the pool's decode step over all slots (each slot's mode as data) against `decode.step` in standard mode on "
        "the same batch and cache, medians of interleaved runs: what one pool for the three modes costs over a "
        "standard-only pool's step.",
        "KV occupancy: cache positions holding a token over positions allocated (slots × context), averaged over "
        "the row's decode steps; a paged cache would give the rest to more requests.",
    ]
    tables = [intro, docs_block.table(header, rows), docs_block.table(cost_header, cost_rows)]
    machine = docs_block.machine_line(jax.devices()[:1], smoke=smoke)
    return docs_block.block("serve_throughput", docs_block.run_arguments(sys.argv[1:]), machine, tables, notes)


if __name__ == "__main__":
    main()
