"""Metric sinks: `<workdir>/metrics.jsonl` (one JSON object per line) and TensorBoard events.

Only process 0 writes; other processes get a writer that does nothing, so callers need no checks.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax


class MetricsWriter:
    def __init__(self, workdir: str, filename: str = "metrics.jsonl", tensorboard_dir: str = "tensorboard"):
        self.enabled = jax.process_index() == 0
        self.path = os.path.join(workdir, filename)
        self.tensorboard_dir = os.path.join(workdir, tensorboard_dir)
        self._file = None
        self._tb = None
        if self.enabled:
            # Imported here: tensorboardX pulls in protobuf, which non-writing processes skip.
            from tensorboardX import SummaryWriter

            os.makedirs(workdir, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
            self._tb = SummaryWriter(self.tensorboard_dir, flush_secs=10)

    def write(self, step: int, scalars: dict[str, Any], prefix: str = "") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in scalars.items()}}
        if not prefix:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self._tb.add_scalar(f"{prefix}{key}", value, int(step))

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            self._tb.close()


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    return value
