"""Depth stability: does a {1, 2}-trained map diverge beyond its passes, and a {1, 2, 3}-trained one
contract to a fixed point?

Two sets of models, three seeds each, {1, 2} (`k12`) and the paper's 75/22/3 (`paper`):

- the S3 models of `experiments/state_tracking.py` (16 tokens), run for k = 1 … 32 passes;
- very narrow S3 models trained at 1024 tokens (`configs/sweeps/depth_1024.py`), run for
  k = 1 … 1000 passes (the states become the exact recurrence at pass T = 1024).

For each k: held-out loss, and the relative per-pass change ‖Hᵏ − Hᵏ⁻¹‖ / ‖Hᵏ‖ over the positions
pass k can still change (`fbt_jax.evaluate.depth_sweep`); the contraction monitor's verdict for
passes 4–7 (`fbt_jax.contraction`).

    python experiments/depth_stability.py --write-docs docs/results.md
"""

from __future__ import annotations

import os
from typing import Any

import common
import numpy as np

from fbt_jax import contraction
from fbt_jax.data.pipeline import make_source
from fbt_jax.evaluate import depth_sweep
from fbt_jax.trained import load_model

NAME = "depth_stability"
LONG_SPEC = os.path.join(common.REPO, "configs", "sweeps", "depth_1024.py")
SCHEDULES = ("k12", "paper")


def sweep_depths(rows: list[dict[str, Any]], max_depth: int, num_sequences: int) -> None:
    """Adds each row's depth sweep and monitor verdict (passes 4–7) on held-out sequences."""
    for row in rows:
        model, config = load_model(row["workdir"], log=lambda *_: None)
        batch = make_source(config, "validation").examples(np.arange(num_sequences))
        row["depth"] = depth_sweep(model, batch, max_depth, progress=False)
        sums = {f"{key}_{k}": row["depth"][key][k - 1] for key in ("change_sq", "state_sq") for k in range(4, 8)}
        row["monitor"] = contraction.summarize(sums, 4, 7)


def table(rows: list[dict[str, Any]], depths: list[int]) -> str:
    header = ["mixture", *[f"loss k={k}" for k in depths], *[f"change k={k}" for k in depths[1:]]]
    header += ["rate, passes 4–7", "contracting"]
    lines = []
    for schedule, seeds in common.by_label(rows, "schedule").items():
        cells = [schedule]
        cells += [common.mean_std([r["depth"]["loss"][k - 1] for r in seeds]) for k in depths]
        cells += [common.mean_std([r["depth"]["change"][k - 1] for r in seeds], 4) for k in depths[1:]]
        cells.append(common.mean_std([r["monitor"]["contraction_rate"] for r in seeds]))
        cells.append(f"{sum(int(r['monitor']['contracting']) for r in seeds)} of {len(seeds)}")
        lines.append(cells)
    return common.docs_block.table(header, lines)


def plot(parts: list[tuple[str, list[dict[str, Any]]]], path: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(2, len(parts), figsize=(6 * len(parts), 8), squeeze=False)
    for column, (title, rows) in enumerate(parts):
        for i, (schedule, seeds) in enumerate(common.by_label(rows, "schedule").items()):
            for j, r in enumerate(seeds):
                ks = np.arange(1, len(r["depth"]["loss"]) + 1)
                label = schedule if j == 0 else None
                axes[0, column].semilogx(ks, r["depth"]["loss"], color=f"C{i}", alpha=0.7, label=label)
                change = np.maximum(r["depth"]["change"][1:], 1e-8)
                axes[1, column].loglog(ks[1:], change, color=f"C{i}", alpha=0.7, label=label)
        axes[0, column].set(title=title, xlabel="feedback depth k (passes)", ylabel="held-out loss")
        axes[1, column].set(xlabel="k", ylabel="‖Hᵏ − Hᵏ⁻¹‖ / ‖Hᵏ‖ (positions still open)")
        axes[0, column].legend()
        axes[1, column].legend()
    common.save_figure(fig, path)


def main() -> None:
    args = common.arguments(__doc__, NAME)
    timer = common.Timer()
    long_spec = LONG_SPEC
    if args.smoke:
        long_spec = common.smoke_spec(LONG_SPEC, args.sweeps_dir, SCHEDULES, data__seq_len=64)
    # The 16-token models are the state-tracking experiment's (trained there, or here if not yet).
    short = [r for r in common.state_tracking_runs(args) if r["label.run"] == "S3"]
    short = [r for r in short if r["label.schedule"] in SCHEDULES]
    long = common.run_sweep(long_spec, os.path.join(args.dir, "depth_1024"))
    sizes = common.load_spec(long_spec)["overrides"]
    train_minutes = common.sweep_minutes(os.path.join(args.dir, "depth_1024"))
    short_len, long_len = 16, (64 if args.smoke else 1024)
    long_depth = 60 if args.smoke else 1000
    sweep_depths(short, 2 * short_len, 64)
    sweep_depths(long, long_depth, 2)  # 1000 passes over 1024 positions: two sequences keep it to minutes
    figure = common.plot_path(args, NAME)
    plot([(f"S3, trained at T={short_len}", short), (f"S3, trained at T={long_len}", long)], figure)
    long_depths = [1, 2, 3, 4, 8, 32, 128, long_depth] if not args.smoke else [1, 2, 3, 4, 8, long_depth]
    body = [
        f"Written by `python experiments/{NAME}.py{' --smoke' if args.smoke else ''}` on {common.machine()} in "
        f"{timer.minutes():.1f} min of wall time; training the 1024-token models took {train_minutes:.0f} min of job time "
        f"(two jobs at a time), and the 16-token models are shared with `experiments/state_tracking.py`. Mean ± std over {len(short) // 2} seeds; loss on 64 (T={short_len}) and "
        f"2 (T={long_len}) held-out sequences; the change is measured over the positions pass k can still change.",
        "",
        f"**S3 at T={short_len}** (width 64, 2 layers), k = 1 … {2 * short_len}:\n",
        table(short, [1, 2, 3, 4, 8, short_len, 2 * short_len]),
        "",
        f"**S3 at T={long_len}** (width 32, 2 layers, {sizes['train.steps']} steps of {sizes['train.batch_size']} "
        "sequences), "
        f"k = 1 … {long_depth}:\n",
        table(long, long_depths),
        "",
        common.figure_line(args, figure, "loss and per-pass change against feedback depth"),
    ]
    common.finish(args, NAME, "\n".join(body))


if __name__ == "__main__":
    main()
