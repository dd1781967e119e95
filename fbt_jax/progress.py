"""Progress bars that leave an error on a line of its own.

A bar is drawn on a terminal only (tqdm's `disable=None`): a log file or a pipe gets the commands'
summary lines, not carriage-return frames that would sit before an error message. On a terminal, a
bar closed because an error is on its way out is cleared rather than left on screen, so the
one-line error (`errors.reported`) is the last thing the user sees, alone.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


def bar(total: int, enabled: bool = True, **options: Any) -> Any:
    """A tqdm bar on stderr, drawn only when `enabled` and stderr is a terminal."""
    from tqdm import tqdm

    options = {"dynamic_ncols": True, "file": sys.stderr, **options}
    return tqdm(total=total, disable=None if enabled else True, **options)


def close(progress: Any, failed: bool) -> None:
    """Close `progress`: kept on screen after success, cleared when an error follows."""
    if failed:
        progress.leave = False
    progress.close()


@contextlib.contextmanager
def shown(total: int, enabled: bool = True, **options: Any) -> Iterator[Any]:
    """`bar(...)` for the duration of a block, closed by `close` (cleared if the block raises)."""
    progress = bar(total, enabled, **options)
    failed = True
    try:
        yield progress
        failed = False
    finally:
        close(progress, failed)


@contextlib.contextmanager
def library_bars_on_terminal_only() -> Iterator[None]:
    """The harness's own progress bars (building requests, reading its cache, its bootstrap) drawn
    on a terminal only, as ours are (`progress.py`): in a pipe or a log they are carriage-return
    frames around the lines that matter. Its bootstrap's "bootstrapping for stddev" line is a plain
    print and still shows (bootstrap_iters=0 skips it where no interval is needed)."""
    import lm_eval.api.model as harness_model
    import lm_eval.api.task as harness_task
    import tqdm as tqdm_package

    original = tqdm_package.tqdm

    class TerminalOnly(original):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, disable: bool | None = False, **kwargs: Any):
            super().__init__(*args, disable=None if disable is False else disable, **kwargs)

    # The bootstrap imports tqdm inside its function, so the package's own name is swapped too.
    holders = [m for m in (tqdm_package, harness_task, harness_model) if getattr(m, "tqdm", None) is original]
    for holder in holders:
        holder.tqdm = TerminalOnly
    try:
        yield
    finally:
        for holder in holders:
            holder.tqdm = original
