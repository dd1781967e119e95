"""Metric sinks: JSON lines per stream (`metrics.jsonl` for training, `eval.jsonl` for held-out
evaluation) and one TensorBoard event directory (eval scalars under `eval/`).

Only process 0 writes; other processes get a writer that does nothing, so callers need no checks.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax

STREAM_FILES = {"train": "metrics.jsonl", "eval": "eval.jsonl"}
TENSORBOARD_DIR = "tensorboard"


class MetricsWriter:
    def __init__(self, workdir: str, resume_step: int = 0):
        self.enabled = jax.process_index() == 0
        self.paths = {stream: os.path.join(workdir, name) for stream, name in STREAM_FILES.items()}
        self.tensorboard_dir = os.path.join(workdir, TENSORBOARD_DIR)
        self._files: dict[str, Any] = {}
        self._tb = None
        if self.enabled:
            # Imported here: tensorboardX pulls in protobuf, which non-writing processes skip.
            from tensorboardX import SummaryWriter

            os.makedirs(workdir, exist_ok=True)
            for path in self.paths.values():
                _truncate_after(path, resume_step)
            self._files = {stream: open(path, "a", encoding="utf-8") for stream, path in self.paths.items()}
            # purge_step drops TensorBoard events a killed run logged after the checkpoint it resumes.
            self._tb = SummaryWriter(
                self.tensorboard_dir, flush_secs=10, purge_step=resume_step + 1 if resume_step else None
            )

    @classmethod
    def for_run(cls, config: Any, workdir: str, resume_step: int = 0) -> MetricsWriter:
        """The writer of a training run, with the sinks its config asks for (`metrics.*`)."""
        return cls(workdir, resume_step=resume_step)

    def write(self, step: int, scalars: dict[str, Any], stream: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in scalars.items()}}
        self._files[stream].write(json.dumps(record) + "\n")
        self._files[stream].flush()
        prefix = "" if stream == "train" else f"{stream}/"
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(f"{prefix}{key}", value, int(step))

    def close(self) -> None:
        if self.enabled:
            for f in self._files.values():
                f.close()
            self._tb.close()


def _truncate_after(path: str, step: int) -> None:
    """Keep the lines of steps <= `step`: a resumed run rewrites what came after its checkpoint."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    return value
