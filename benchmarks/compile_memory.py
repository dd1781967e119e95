"""The 1B config's memory per chip, from the chip's own compiler: remat policy × microbatches × K
for a v5e, v5p and v6e slice (the TPU compiler), or with `--gpu` an 8×H100 and an 8×H200 node (the
GPU compiler), and the least recompute that fits each.

    python benchmarks/compile_memory.py [--gpu] [--smoke] [--write-docs docs/launch.md] [--resume PATH]

Compiles configs/fbt_1b.py's train step of every K for the compile-only devices of the slice or
node (libtpu: `pip install 'fbt-jax[tpu]'`; jax's CUDA plugin for `--gpu`: `fbt-jax[cuda]`; no
chip needed) and reads each program's per-device memory; a program XLA:TPU refuses for lack of HBM
counts as not fitting, with the figure it named (XLA:GPU refuses nothing: its figure is compared
with the GPU's memory). Per chip and policy the microbatches double until every K fits; the
largest K is compiled first, and a setting it does not fit is not compiled for the others (–).
The choice per chip is the least recompute (none < save_matmuls_no_batch < block), then the
fewest microbatches, whose every K fits with HEADROOM of the chip's HBM left free. `--resume PATH`
keeps each compiled row in PATH and skips it on the next run (a TPU run compiles ~30 programs of
up to 3 min each on 2 cores). `--smoke` compiles the tiny config for v5e:2x2 (h100:2 with `--gpu`).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this machine compiles only

import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import docs_block  # noqa: E402

from fbt_jax import sharding, targets  # noqa: E402
from fbt_jax.train.programs import TrainPrograms  # noqa: E402
from fbt_jax.validation import validate_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHIPS = ("v5e:8x8", "v5p:4x4x4", "v6e:8x8")
GPU_NODES = ("h100:8", "h200:8")
POLICIES = ("none", "save_matmuls_no_batch", "block")  # least recompute first
MICROBATCHES = (1, 2, 4)  # a slice's 64 chips: up to 2 examples per chip per microbatch
GPU_MICROBATCHES = (1, 2, 4, 8, 16)  # a node's 8 GPUs share the same 512 rows
# HBM left free by a chosen setting: the compiler's figure leaves out what the runtime holds beside
# the program (the next batch in flight, checkpoint copies, the programs' code) and fragmentation.
HEADROOM = 0.10


def load_config(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def compile_row(base, target, policy: str, microbatches: int) -> dict:
    """Per K: GiB per device (or the compiler's figure for a refused program), whether it fits, compile s."""
    hbm_gib = target.hbm_bytes / 2**30
    config = base.copy_and_resolve_references()
    config.model.remat, config.train.microbatches = policy, microbatches
    config.eval.num_batches, config.eval.contraction_passes = 0, 0
    schedule = validate_config(config, num_devices=len(target.devices))
    # Packed rows with segment ids, as a real run reads a prepared text dataset.
    programs = TrainPrograms(config, schedule, target.devices, packed=True, log=lambda *_: None)
    programs.keep_going_out_of_memory = True
    state_gib = 0.0
    row = {"policy": policy, "microbatches": microbatches, "K": {}}
    for k in sorted(schedule.pass_counts, reverse=True):  # the largest K needs the most memory
        report = programs.compile((k,))[f"train_K{k}"]
        refused = f"train_K{k}" in programs.refused
        if refused and not state_gib:  # the compiler names its temporaries; the train state comes on top
            state_gib = sharding.per_device_bytes(programs.abstract_state, programs.state_shardings) / 2**30
        gib = report["device_bytes"] / 2**30 if not refused else report["required_gib"] + state_gib
        row["K"][str(k)] = {"gib": gib, "refused": refused, "compile_seconds": report["compile_seconds"]}
        if refused or gib > hbm_gib:
            break  # this setting cannot serve every K: the smaller K are not compiled ("–")
    return row


def fits(row: dict, hbm_gib: float, headroom: float = 0.0) -> bool:
    return all(not k["refused"] and k["gib"] <= hbm_gib * (1 - headroom) for k in row["K"].values())


def measure(base, chips, policies, microbatches, resume: str | None) -> dict:
    done = json.load(open(resume)) if resume and os.path.exists(resume) else {}
    results = {}
    for chip in chips:
        target = targets.target(chip)
        hbm_gib = target.hbm_bytes / 2**30
        rows = []
        for policy in policies:
            for m in microbatches:
                if base.train.batch_size % (m * len(target.devices)):
                    break
                key = f"{chip}/{policy}/{m}"
                if key not in done:
                    print(f"compiling {key} ...", file=sys.stderr, flush=True)
                    done[key] = compile_row(base, target, policy, m)
                    if resume:
                        json.dump(done, open(resume, "w"), indent=1)
                rows.append(done[key])
                if fits(done[key], hbm_gib, HEADROOM):
                    break  # more microbatches only cost speed
        results[chip] = {
            "describe": target.describe(),
            "hbm_gib": hbm_gib,
            "rows": rows,
            "chosen": choose(rows, hbm_gib),
        }
    return results


def choose(rows: list[dict], hbm_gib: float) -> dict | None:
    """The least recompute, then the fewest microbatches, that fits every K with HEADROOM free."""
    fitting = [r for r in rows if fits(r, hbm_gib, HEADROOM)]
    return min(fitting, key=lambda r: (POLICIES.index(r["policy"]), r["microbatches"]), default=None)


def table(results: dict) -> str:
    lines = []
    for chip, result in results.items():
        ks = sorted({k for row in result["rows"] for k in row["K"]})
        lines += [
            f"**{chip}** — {result['describe']}",
            "",
            "| remat | microbatches | "
            + " | ".join(f"K={k} GiB" for k in ks)
            + f" | every K fits ({HEADROOM:.0%} free) | compile s |",
            "|---|---|" + "---|" * len(ks) + "---|---|",
        ]
        for row in result["rows"]:
            cells = [_cell(row["K"].get(k)) for k in ks]
            seconds = sum(v["compile_seconds"] for v in row["K"].values())
            verdict = "no"
            if fits(row, result["hbm_gib"]):
                verdict = "yes" if fits(row, result["hbm_gib"], HEADROOM) else "only without the headroom"
            lines.append(
                f"| {row['policy']} | {row['microbatches']} | " + " | ".join(cells) + f" | {verdict} | {seconds:.0f} |"
            )
        chosen = result["chosen"]
        pick = (
            f"`model.remat={chosen['policy']}`, `train.microbatches={chosen['microbatches']}`"
            if chosen
            else "nothing fits"
        )
        lines += ["", f"Least recompute with {HEADROOM:.0%} of HBM free on {chip}: {pick}.", ""]
    return "\n".join(lines)


def _cell(figures: dict | None) -> str:
    if figures is None:
        return "–"
    return f"{figures['gib']:.2f}" if not figures["refused"] else f"≥ {figures['gib']:.1f} (refused)"


def main() -> None:
    extra = (
        ("--gpu", {"action": "store_true", "help": "GPU nodes (8×H100, 8×H200) with jax's CUDA plugin"}),
        ("--resume", {"metavar": "PATH", "help": "keep compiled rows in PATH and skip them next time"}),
    )
    args = docs_block.arguments(
        __doc__, "compile_memory", "the tiny config on v5e:2x2: checks that it runs", extra, lambda a: "--gpu" * a.gpu
    )
    start = time.perf_counter()
    if args.smoke:
        base = load_config("tiny")
        base.model.attention_impl = "pallas_gpu" if args.gpu else "splash"
        base.passes.schedule = "0:1"  # K=1 only: two programs
        results = measure(base, ("h100:2" if args.gpu else "v5e:2x2",), ("none", "block"), (1, 2), args.resume)
    elif args.gpu:
        results = measure(load_config("fbt_1b"), GPU_NODES, POLICIES, GPU_MICROBATCHES, args.resume)
    else:
        results = measure(load_config("fbt_1b"), CHIPS, POLICIES, MICROBATCHES, args.resume)
    wall = time.perf_counter() - start
    text = table(results)
    print(text)
    if args.write_docs:
        command = f"python benchmarks/compile_memory.py{' --gpu' if args.gpu else ''}{' --smoke' if args.smoke else ''}"
        seconds = sum(k["compile_seconds"] for r in results.values() for row in r["rows"] for k in row["K"].values())
        machine = f"Machine: {os.cpu_count()} CPU cores, compiling only: {seconds / 60:.0f} min of compiles."
        if args.smoke:
            machine += " Smoke run (tiny config): these figures only show that the benchmark runs."
        body = f"Written by `{command}`. {machine}\n\n{text}"
        docs_block.write_block(args.write_docs, "compile_memory", body, variant="--gpu" * args.gpu)
    figures = {
        chip: {f"{r['policy']}@{r['microbatches']}": {k: v["gib"] for k, v in r["K"].items()} for r in result["rows"]}
        for chip, result in results.items()
    }
    print(json.dumps({"wall_seconds": wall, "gib_per_device": figures}))


if __name__ == "__main__":
    main()
