"""Metric sinks: JSON lines per stream (`metrics.jsonl` for training, `eval.jsonl` for held-out
evaluation), one TensorBoard event directory (eval scalars under `eval/`; finite values only, a
diverged step's NaN/Inf is in the JSON lines) and, with `metrics.wandb=True`, a Weights & Biases
run (`pip install 'fbt-jax[wandb]'`; wandb is imported only then).

Only process 0 writes; other processes get a writer that does nothing, so callers need no checks.

Weights & Biases: the run logs the keys TensorBoard gets (train keys plain, eval keys under
`eval/`) with the training step as the key `train_step`, every key's x-axis (`define_metric`),
the whole run config as wandb's config, and `write_summary`'s figures as its summary. Its files go
to `<workdir>/wandb`. The wandb run id is kept in `<workdir>/wandb_run_id`: a resumed training run
continues the same wandb run (`resume="allow"`), a run that starts at step 0 starts a new one.
Offline (`WANDB_MODE=offline`), each life of the run writes its own `offline-run-*-<id>`
directory; `wandb sync <workdir>/wandb/offline-run-*` uploads them to the one run, in the order
they started (wandb >= 0.30).

Steps logged twice: a killed run logged steps after the checkpoint it resumes from, and the resumed
run logs them again. wandb refuses a `step=` below its last one (it would drop the resumed run's
rows until it passes the killed run's last step), so rows go without `step=`: wandb's `_step` only
counts rows, and its history keeps both rows of such a step. Charts over `train_step` draw the
resumed run's points over the killed run's (the same numbers where the resume is bitwise identical,
as on CPU); metrics.jsonl and TensorBoard keep only the resumed run's.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable
from typing import Any

import jax

from fbt_jax.errors import ConfigError, describe

STREAM_FILES = {"train": "metrics.jsonl", "eval": "eval.jsonl"}
TENSORBOARD_DIR = "tensorboard"
WANDB_RUN_ID_FILE = "wandb_run_id"  # the wandb run a resumed training run continues
WANDB_STEP_KEY = "train_step"  # the training step in wandb's history, every key's x-axis
WANDB_INSTALL = "pip install 'fbt-jax[wandb]'"


def check_metrics_config(config: Any) -> None:
    """ConfigError (one line) for a metric sink the config asks for but that cannot start:
    `metrics.wandb=True` without wandb importable. Imports wandb only when it is asked for."""
    if not config.metrics.wandb:
        return
    try:
        import wandb  # noqa: F401
    except ImportError as err:
        raise ConfigError(
            f"metrics.wandb=True needs the wandb package, which cannot be imported ({describe(err)}); "
            f"install it with {WANDB_INSTALL}, or set --config.metrics.wandb=False"
        ) from None


class MetricsWriter:
    def __init__(self, workdir: str, resume_step: int = 0, log: Callable[[str], None] = print):
        self.enabled = jax.process_index() == 0
        self.paths = {stream: os.path.join(workdir, name) for stream, name in STREAM_FILES.items()}
        self.tensorboard_dir = os.path.join(workdir, TENSORBOARD_DIR)
        self._files: dict[str, Any] = {}
        self._tb = None
        self._wandb: Any = None  # the wandb run, when that sink is on
        self._last_step = resume_step  # the step write_summary's figures go to
        if self.enabled:
            # Imported here: tensorboardX pulls in protobuf, which non-writing processes skip.
            from tensorboardX import SummaryWriter

            os.makedirs(workdir, exist_ok=True)
            for path in self.paths.values():
                _truncate_after(path, resume_step, log)
            self._files = {stream: open(path, "a", encoding="utf-8") for stream, path in self.paths.items()}
            # purge_step drops TensorBoard events a killed run logged after the checkpoint it resumes.
            self._tb = SummaryWriter(
                self.tensorboard_dir, flush_secs=10, purge_step=resume_step + 1 if resume_step else None
            )

    @classmethod
    def for_run(
        cls, config: Any, workdir: str, resume_step: int = 0, log: Callable[[str], None] = print
    ) -> MetricsWriter:
        """The writer of a training run, with the sinks its config asks for (`metrics.*`):
        `workdir` is the run's local directory, `resume_step` the step it resumes from (0: a new
        run, also for wandb); `log` hears of a torn line dropped from a log (`read_log`)."""
        writer = cls(workdir, resume_step=resume_step, log=log)
        if writer.enabled and config.metrics.wandb:
            try:
                writer._wandb = start_wandb_run(config, workdir, resume_step)
            except BaseException:
                writer.close()
                raise
        return writer

    def write(self, step: int, scalars: dict[str, Any], stream: str = "train") -> None:
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in scalars.items()}}
        self._last_step = max(self._last_step, int(step))
        self._files[stream].write(json.dumps(record) + "\n")
        self._files[stream].flush()
        prefix = "" if stream == "train" else f"{stream}/"
        numbers = {f"{prefix}{k}": v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        for key, value in numbers.items():
            # A diverged step's NaN/Inf stays in the JSON lines; tensorboardX would warn on stderr for
            # each one, ahead of the run's one-line error (and across its progress bar).
            if math.isfinite(value):
                self._tb.add_scalar(key, value, int(step))
        if self._wandb is not None:
            self._wandb.log({WANDB_STEP_KEY: int(step), **numbers})

    def write_summary(self, summary: dict[str, float]) -> None:
        """The final figures of a run (e.g. its goodput and the seconds per category): TensorBoard
        gets them as `summary/<key>` at the last step written, the wandb run as its run summary.
        The JSON-lines logs get nothing here, as the trainer writes these figures to summary.json
        (and goodput.jsonl) itself. Call it before `close`."""
        if not self.enabled:
            return
        values = {key: _plain(value) for key, value in summary.items()}
        for key, value in values.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._tb.add_scalar(f"summary/{key}", value, self._last_step)
        if self._wandb is not None:
            self._wandb.summary.update(values)

    def close(self, failed: bool = False) -> None:
        """Close every sink; the wandb run finishes with exit code 1 when `failed`."""
        if not self.enabled:
            return
        for f in self._files.values():
            f.close()
        self._files = {}
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            run, self._wandb = self._wandb, None
            run.finish(exit_code=1 if failed else 0)


def start_wandb_run(config: Any, workdir: str, resume_step: int = 0) -> Any:
    """A wandb run for the training run in `workdir` (its files under `<workdir>/wandb`): the run
    recorded in `<workdir>/wandb_run_id` when the training run resumes (`resume_step` > 0), else
    a new one, whose id is recorded there. ConfigError (one line) if wandb cannot start."""
    import wandb

    m = config.metrics
    id_path = os.path.join(workdir, WANDB_RUN_ID_FILE)
    run_id = _read_run_id(id_path) if resume_step > 0 else None
    if run_id is None:
        run_id = secrets.token_hex(6)  # wandb's id alphabet is [a-z0-9]
        with open(id_path, "w", encoding="utf-8") as f:
            f.write(run_id + "\n")
    try:
        run = wandb.init(
            project=m.wandb_project or None,
            entity=m.wandb_entity or None,
            name=m.wandb_name or os.path.basename(str(config.workdir).rstrip("/")) or None,
            id=run_id,
            resume="allow",
            dir=workdir,
            config=json.loads(config.to_json_best_effort()),
            allow_val_change=True,  # a resumed run may change neutral fields (train.steps, ...)
            reinit="create_new",  # independent of any wandb run the calling program has open
        )
    except Exception as err:
        raise ConfigError(
            f"metrics.wandb=True but wandb could not start ({describe(err)}); run `wandb login` or set "
            "WANDB_API_KEY, log offline with WANDB_MODE=offline, or set --config.metrics.wandb=False"
        ) from None
    run.define_metric(WANDB_STEP_KEY)
    run.define_metric("*", step_metric=WANDB_STEP_KEY)
    return run


def _read_run_id(path: str) -> str | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip() or None


def read_log(path: str, log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """The records of a JSON-lines log that a run appends to (metrics.jsonl, eval.jsonl); none when
    it does not exist.

    A write cut short (a kill, a full disk) leaves a torn line: a prefix of a record, which is never
    JSON. It is dropped rather than stopping every later resume until a user edits the file, and
    `log` (when given) is told in one line; the records around it are kept.
    """
    if not os.path.exists(path):
        return []
    records, torn = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if isinstance(record, dict) and isinstance(record.get("step"), int):
                records.append(record)
            else:
                torn.append(number)
    if torn and log:
        where = f"line {torn[0]}" if len(torn) == 1 else f"lines {', '.join(map(str, torn))}"
        log(f"{path}: dropped {where}, not a whole record (a write cut short by a kill or a full disk)")
    return records


def _truncate_after(path: str, step: int, log: Callable[[str], None]) -> None:
    """Keep the records of steps <= `step`: a resumed run rewrites what came after its checkpoint
    (and drops a torn line, which would otherwise have a new record appended to it)."""
    if not os.path.exists(path):
        return
    kept = [record for record in read_log(path, log) if record["step"] <= step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(record) + "\n" for record in kept)


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    return value
