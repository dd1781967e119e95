"""`fbt-train`: train (or, with --config.dry_run=True, size up) the run a config file describes.

fbt-train --config=configs/tiny.py --config.workdir=runs/tiny
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax

from fbt_jax import contraction, distributed, paths, workdir
from fbt_jax.config import resolve_config_paths
from fbt_jax.errors import EXIT_CODES, PREEMPTED_EXIT_CODE, Preempted, UsageError, divert_library_noise, reported
from fbt_jax.train import goodput
from fbt_jax.validation import validate_config

PROG = "fbt-train"


def flagged_config() -> Any:
    """The --config of an absl command (fbt-train, fbt-self-train), absl's logging quieted."""
    from absl import flags, logging

    if not flags.FLAGS["verbosity"].present:
        # absl logs at INFO by default, which prints backend probing noise ("Unable to initialize
        # backend 'tpu'") on machines without one; --verbosity=0 brings it back.
        logging.set_verbosity(logging.WARNING)
    return flags.FLAGS.config


def main(argv: list[str]) -> None:
    del argv
    config = flagged_config()
    with reported(PROG):
        resolve_config_paths(config)  # relative paths mean: from where the command was started
        validate_config(config)  # everything that does not depend on the devices, before any set-up
        if config.dry_run:
            from fbt_jax.train.dry_run import dry_run  # imported late: it sets up simulated devices

            print(dry_run(config)[0])
            return
        # From here a SIGTERM (a scheduler's stop, a preemption) ends the run with exit 75, also
        # before the training loop takes it over: the supervisor runs the same command again.
        with sigterm_is_a_preemption() as after_distributed:
            paths.check_config_urls(config)
            divert_library_noise(os.path.join(workdir.local_dir(config.workdir), "fbt-train.log"))
            after_distributed(distributed.initialize(config.distributed))
            from fbt_jax.train.trainer import Trainer

            summary = Trainer(config).train()
    if jax.process_index() == 0:
        print(format_summary(summary))


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"trained {summary['steps']} steps in {summary['train_seconds']:.1f}s"]
    if "goodput" in summary:
        lines.append(goodput.describe(summary["goodput"]))
    if summary["eval"]:
        ks = sorted(int(key.split("K")[1]) for key in summary["eval"] if key.startswith("loss_"))
        lines.append("held-out eval (fully fused from position 1):")
        lines += [
            f"  K={k}: loss {summary['eval'][f'loss_K{k}']:.4f}  accuracy {summary['eval'][f'accuracy_K{k}']:.3f}"
            for k in ks
        ]
        if "contraction_rate" in summary["eval"]:
            lines.append(f"  contraction monitor, {contraction.describe(summary['eval'])}")
    out = summary["outputs"]
    lines.append(f"outputs in {out['workdir']}:")
    lines += [f"  {name:<12}{out[name]}" for name in ("metrics", "eval", "tensorboard", "config")]
    lines.append(f"  view with: tensorboard --logdir {out['tensorboard']}")
    return "\n".join(lines)


def parse_flags(argv: list[str], prog: str = PROG) -> list[str]:
    """absl's flag parsing, with its errors (a misspelt field, a missing config file, a value of
    the wrong type: assorted exceptions with multi-line messages) reported as one line by `prog`."""
    from absl import flags

    with reported(prog):
        try:
            rest = flags.FLAGS(argv)
            flags.FLAGS.config.keys()  # the config file loads lazily: surface its errors here
            return rest
        except (flags.Error, AttributeError, KeyError, OSError, TypeError, ValueError) as err:
            text = str(err).encode().decode("unicode_escape", errors="replace")
            if "Traceback (most recent call last)" in text:  # a config file's own error: its message only
                head, _, trace = text.partition("Traceback (most recent call last)")
                text = f"{head.strip()} {[line for line in trace.splitlines() if line.strip()][-1].strip()}"
            if isinstance(err, (AttributeError, KeyError)):
                raise UsageError(f"unknown config field {' '.join(text.replace(chr(39), '').split())}") from None
            raise UsageError(f"bad flags: {' '.join(text.split())}") from None


def cli() -> None:
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Path to a config file in configs/, e.g. configs/tiny.py.")
    flags.mark_flags_as_required(["config"])
    app.run(main, flags_parser=parse_flags)


class SigtermOutsideTheLoop(BaseException):
    """SIGTERM while no training loop watches for it. A BaseException (like KeyboardInterrupt), so
    that no `except Exception` on its way takes it for a failure of what it interrupted (the
    checkpoint restore would judge the checkpoint it was reading damaged)."""


@contextlib.contextmanager
def sigterm_is_a_preemption() -> Iterator[Callable[[bool], None]]:
    """Within the block, SIGTERM stops fbt-train as a preemption: `Preempted` (exit 75, one line).

    It covers start-up (restoring, compiling) and the clean-up after the loop; the loop's own
    handler (`hooks.PreemptionWatcher`, which saves first) replaces this one while it runs. The
    handler raises, like Ctrl-C; a SIGTERM that arrives inside a compile acts when it returns.
    Call the yielded function with what `distributed.initialize` returned: jax.distributed takes
    SIGTERM for its preemption notifier, which keeps it with several processes (every process
    then stops at the same step, and a SIGTERM while they exit does not kill them) and gives it
    back here with one. A SIGTERM while a do-not-retry error (a config error, a divergence, ...)
    is on its way out leaves that error standing: a launcher stopping the other processes of a
    failed run must not make them look preempted.
    """
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield lambda initialized: None
        return
    jax_owns_sigterm = False

    resending = threading.Event()  # set while the hook below arms the handler again
    reached = threading.Event()  # the stop reached this block's code, or the block ended
    reached_lock = threading.Lock()

    def stop(signum: int, frame: Any) -> None:
        if resending.is_set():
            return  # it would be swallowed again; the next send lands outside the hook
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop: a second SIGTERM must not cut the unwinding
        raise SigtermOutsideTheLoop

    def send_until_it_lands() -> None:
        while not reached.wait(0.02):
            with reached_lock:  # never after the block has put the previous handler back
                if not reached.is_set():
                    os.kill(os.getpid(), signal.SIGTERM)

    def send_again_if_swallowed(unraisable: Any) -> None:
        # The handler runs in whatever Python code is executing, and a `__del__` or a garbage
        # collector callback (jax has one) ignores what it raises: the stop would be lost and the
        # run would train on. Send the signal again, from another thread, until it reaches the
        # code the collection interrupted (or the loop's own handler, once that has taken over).
        if reached.is_set() or not isinstance(unraisable.exc_value, SigtermOutsideTheLoop):
            return previous_unraisablehook(unraisable)
        resending.set()
        try:
            signal.signal(signal.SIGTERM, stop)
            threading.Thread(target=send_until_it_lands, daemon=True).start()
        finally:
            resending.clear()

    def after_distributed(initialized: bool) -> None:
        nonlocal jax_owns_sigterm
        if initialized and jax.process_count() > 1:
            jax_owns_sigterm = True
        elif initialized:
            signal.signal(signal.SIGTERM, stop)

    previous = signal.signal(signal.SIGTERM, stop)
    previous_unraisablehook, sys.unraisablehook = sys.unraisablehook, send_again_if_swallowed
    try:
        yield after_distributed
    except SigtermOutsideTheLoop as err:
        final = tuple(kind for kind, code, _ in EXIT_CODES if code not in (PREEMPTED_EXIT_CODE, 130))
        if isinstance(err.__context__, final):
            raise err.__context__ from None
        raise Preempted(
            "stopped by SIGTERM outside the training loop (while starting up or finishing); every checkpoint "
            "saved so far is intact: run the same command again to resume"
        ) from None
    finally:
        with reached_lock:
            reached.set()
        if sys.unraisablehook is send_again_if_swallowed:
            # A hook installed inside the block (divert_library_noise's) wraps this one and stays:
            # putting the previous one back would undo it, and storage noise at exit would print.
            sys.unraisablehook = previous_unraisablehook
        if not jax_owns_sigterm:
            signal.signal(signal.SIGTERM, previous)
