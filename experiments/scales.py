"""The sizes an experiment runs at: `--scale=cpu` (the default) or `--scale=gpu`.

`cpu` is the sweep spec as written: the tiny model, two jobs at a time, what a 2-core machine
without an accelerator trains in the docs' stated times. `gpu` is the same experiment, the same
task, mixtures, seeds, evaluation and budget check, on a model four times as wide and twice as
deep, with four times the batch, nine jobs sharing one accelerator: for a machine with a GPU.
Its figures go to a block of their own (`<!-- begin: experiments/<name>.py --scale=gpu -->`) and a
summary row of their own, beside the CPU ones, which stay; its runs go to
`runs/experiments-gpu/`, so that neither scale ever resumes the other's checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Scale:
    name: str
    overrides: dict[str, Any]  # fbt-sweep overrides for every run of the experiment's sweeps
    parallel: int  # jobs at once (fbt-sweep --parallel)
    about: str  # the runs' size in a few words, for the block

    def sweep_overrides(self) -> list[str]:
        return [f"{key}={value}" for key, value in self.overrides.items()]


SCALES = {
    "cpu": Scale("cpu", {}, parallel=2, about="two jobs at a time"),
    "gpu": Scale(
        "gpu",
        {
            "model.embed_dim": 256,
            "model.mlp_dim": 1024,
            "model.num_layers": 4,
            "model.num_heads": 8,
            "model.num_kv_heads": 4,
            "train.batch_size": 128,
        },
        parallel=9,  # tiny steps leave a GPU mostly idle: the widest level of the trunk tree at once
        about="nine jobs at a time sharing one accelerator",
    ),
}

OPTION = (
    "--scale",
    dict(default="cpu", choices=sorted(SCALES), help="cpu: the spec as written (the default); gpu: wider, deeper, "
         "larger batches for one accelerator, written to a block of its own"),
)  # fmt: skip


def of(args: argparse.Namespace) -> Scale:
    """The scale an experiment was asked for (`cpu` for experiments without the option)."""
    return SCALES[getattr(args, "scale", "cpu")]


def variant(args: argparse.Namespace) -> str:
    """What a scaled run adds to its block's markers and its summary key ('' at the default)."""
    scale = of(args)
    return "" if scale.name == "cpu" else f"--scale={scale.name}"
