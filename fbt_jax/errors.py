"""The commands' one CLI layer: the errors a command reports as one line (no traceback), their
exit codes, and the one function that maps one to the other.

Every `fbt-*` command parses its arguments and runs its work inside `reported(prog)` (argument
errors too, through `ArgumentParser`), so the same kind of failure gives the same exit code and
the same shape of message everywhere (table in docs/checkpointing.md).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator


class ConfigError(ValueError):
    """A config value, flag or input is invalid. The message names it and how to fix it."""


class CheckpointError(RuntimeError):
    """Checkpoints cannot be saved or restored for a reason that is not damage to them (a full
    disk, a permission, a bug): the run stops and every checkpoint is left as it is."""


class UsageError(ConfigError):
    """A command line that does not parse (unknown flag, missing argument, a value of the wrong type)."""


class WorkdirBusy(ConfigError):
    """Another live run holds the workdir."""


class ProcessMismatchError(RuntimeError):
    """Processes of one run disagree on something they must share (e.g. the pass count K)."""


class EvaluationFailed(RuntimeError):
    """An evaluation after training steps failed; the step it evaluated is checkpointed, and the same
    command run again evaluates that checkpoint (then trains on)."""


class Preempted(RuntimeError):
    """The run stopped early on SIGTERM / SIGINT / a preemption notice, after saving a checkpoint."""


def describe(err: BaseException, limit: int = 240) -> str:
    """An exception as one line for a message: its type and its text, whitespace collapsed."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}" if text else type(err).__name__


# (exception type, exit code, message prefix); the first matching row wins.
EXIT_CODES: tuple[tuple[type[BaseException], int, str], ...] = (
    (WorkdirBusy, 6, ""),
    (UsageError, 2, ""),
    (ConfigError, 2, "config error: "),
    (FloatingPointError, 3, "training diverged: "),
    (ProcessMismatchError, 4, "processes disagree: "),
    (CheckpointError, 5, "checkpoint error: "),
    (EvaluationFailed, 7, "evaluation failed: "),
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


class ArgumentParser(argparse.ArgumentParser):
    """argparse with its usage errors raised as `UsageError`, so that `reported` prints them as
    one line (argparse's own prints the usage block first) with the same exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"error: {message} (see {self.prog} --help)")


def divert_library_noise(log_path: str) -> None:
    """Send the storage libraries' own error reports to `log_path` instead of the terminal.

    When a checkpoint write fails (disk full, permissions), orbax logs the failure with a
    traceback from each of its writer threads, and tensorstore callbacks that fire after orbax
    closed its event loop print "Event loop is closed" tracebacks. The run reports the failure
    itself, as one line naming the cause; the libraries' details are kept in the log file.
    """
    import logging
    import os

    class BestEffortFile(logging.FileHandler):
        def handleError(self, record: logging.LogRecord) -> None:
            pass  # the log cannot be written (the disk that failed the save is full): the run's one line stands

    handler = BestEffortFile(log_path, delay=True, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(pathname)s:%(lineno)d %(message)s"))

    class Divert(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            from_storage = f"{os.sep}orbax{os.sep}" in record.pathname or record.name == "asyncio"
            if record.levelno >= logging.ERROR and from_storage:
                os.makedirs(os.path.dirname(log_path), exist_ok=True)
                handler.handle(record)
                return False
            return True

    root = logging.getLogger()
    if not root.handlers:
        # Without a handler of its own (argparse commands), logging would print through its
        # unfiltered `lastResort`, e.g. asyncio's "Task exception was never retrieved" for an
        # orbax read that failed, at interpreter exit: give it a filtered stderr handler instead.
        stderr = logging.StreamHandler(sys.stderr)
        stderr.setLevel(logging.WARNING)
        root.addHandler(stderr)
    for root_handler in [*root.handlers, logging.lastResort]:
        if root_handler is not None:
            root_handler.addFilter(Divert())
    previous = sys.unraisablehook

    def from_storage(tb) -> bool:
        while tb is not None:
            if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
                return True
            tb = tb.tb_next
        return False

    def hook(unraisable) -> None:  # tensorstore's callbacks report through sys.unraisablehook
        value = unraisable.exc_value
        closed_loop = isinstance(value, RuntimeError) and str(value) == "Event loop is closed"
        if closed_loop or from_storage(unraisable.exc_traceback):
            import traceback

            try:
                os.makedirs(os.path.dirname(log_path), exist_ok=True)
                with open(log_path, "a", encoding="utf-8") as f:
                    f.write("".join(traceback.format_exception(unraisable.exc_type, value, unraisable.exc_traceback)))
            except OSError:
                pass  # as above: best effort, the failure itself was reported
            return
        previous(unraisable)

    sys.unraisablehook = hook

    # A read aborted by a damaged checkpoint can leave a storage coroutine unawaited, which Python
    # reports as a RuntimeWarning when it is collected (at exit, after the one-line error).
    import warnings

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if issubclass(category, RuntimeWarning) and "was never awaited" in str(message):
            try:
                os.makedirs(os.path.dirname(log_path), exist_ok=True)
                with open(log_path, "a", encoding="utf-8") as f:
                    f.write(warnings.formatwarning(message, category, filename, lineno, line))
            except OSError:
                pass  # best effort, as above
            return
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show
