"""The errors a command reports as one line (no traceback), and their exit codes.

Every `fbt-*` command runs its work inside `reported(prog)`, so the same kind of failure gives the
same exit code and the same shape of message everywhere (table in docs/checkpointing.md).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


class ConfigError(ValueError):
    """A config value, flag or input is invalid. The message names it and how to fix it."""


class CheckpointError(RuntimeError):
    """Checkpoints cannot be saved or restored for a reason that is not damage to them (a full
    disk, a permission, a bug): the run stops and every checkpoint is left as it is."""


class WorkdirBusy(ConfigError):
    """Another live run holds the workdir."""


class ProcessMismatchError(RuntimeError):
    """Processes of one run disagree on something they must share (e.g. the pass count K)."""


class Preempted(RuntimeError):
    """The run stopped early on SIGTERM / SIGINT / a preemption notice, after saving a checkpoint."""


# (exception type, exit code, message prefix); the first matching row wins.
EXIT_CODES: tuple[tuple[type[BaseException], int, str], ...] = (
    (WorkdirBusy, 6, ""),
    (ConfigError, 2, "config error: "),
    (FloatingPointError, 3, "training diverged: "),
    (ProcessMismatchError, 4, "processes disagree: "),
    (CheckpointError, 5, "checkpoint error: "),
    (Preempted, 75, "preempted: "),  # EX_TEMPFAIL, "try again": the same command resumes
    (KeyboardInterrupt, 130, "interrupted"),
)
PREEMPTED_EXIT_CODE = 75


@contextlib.contextmanager
def reported(prog: str) -> Iterator[None]:
    """Turn the errors above into `prog: <one line>` on stderr and their exit code."""
    try:
        yield
    except tuple(t for t, _, _ in EXIT_CODES) as err:
        for kind, code, prefix in EXIT_CODES:
            if isinstance(err, kind):
                text = " ".join(str(err).split())
                print(f"{prog}: {prefix}{text}", file=sys.stderr)
                sys.exit(code)
        raise
