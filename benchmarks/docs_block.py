"""Writes a benchmark's figures into the Markdown file that documents them.

A benchmark run with `--write-docs PATH` replaces, in PATH, everything between the lines

    <!-- begin: benchmarks/<name>.py -->
    <!-- end: benchmarks/<name>.py -->

with a table of the figures it just measured (the marker lines and the rest of the file stay as
they are). Missing markers stop the run with one line naming the file and the marker.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from collections.abc import Callable, Sequence


class DocsBlockError(ValueError):
    """The Markdown file lacks the benchmark's markers (or has them more than once, or reversed)."""


def markers(name: str, folder: str = "benchmarks", variant: str = "") -> tuple[str, str]:
    """The begin and end marker lines of script `name` (e.g. "step_cost") in `folder`; a `variant`
    (e.g. "--scale=gpu") is a block of its own for the same script run with those arguments."""
    script = f"{folder}/{name}.py" + (f" {variant}" if variant else "")
    return f"<!-- begin: {script} -->", f"<!-- end: {script} -->"


def replace_block(text: str, name: str, body: str, folder: str = "benchmarks", variant: str = "") -> str:
    """`text` with the lines between the markers of `name` (and `variant`) replaced by `body`."""
    begin, end = markers(name, folder, variant)
    lines = text.splitlines(keepends=True)
    stripped = [line.strip() for line in lines]
    for marker in (begin, end):
        count = stripped.count(marker)
        if count == 0:
            raise DocsBlockError(f"no marker line {marker} (add the pair {begin} / {end} where the figures go)")
        if count > 1:
            raise DocsBlockError(f"marker line {marker} appears {count} times, not once")
    first, last = stripped.index(begin), stripped.index(end)
    if last < first:
        raise DocsBlockError(f"marker line {end} comes before {begin}")
    if not lines[first].endswith("\n"):
        lines[first] += "\n"
    return "".join(lines[: first + 1]) + body.rstrip("\n") + "\n" + "".join(lines[last:])


def arguments(
    doc: str,
    name: str,
    smoke_help: str,
    extra: Sequence[tuple[str, dict]] = (),
    variant: Callable[[argparse.Namespace], str] | None = None,
) -> argparse.Namespace:
    """The command line every benchmark shares (its own options in `extra`, then --smoke and
    --write-docs); a --write-docs file without this benchmark's markers (those of the `variant`
    its arguments select, if any) fails here, before measuring."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    for flag, options in extra:
        parser.add_argument(flag, **options)
    parser.add_argument("--smoke", action="store_true", help=smoke_help)
    parser.add_argument("--write-docs", metavar="PATH", help="rewrite this benchmark's block in the Markdown file PATH")
    args = parser.parse_args()
    if args.write_docs:
        check_block(args.write_docs, name, variant=variant(args) if variant else "")
    return args


def timing_arguments(
    doc: str, name: str, rounds: int, steps_per_round: int, smoke_steps_per_round: int = 1
) -> argparse.Namespace:
    """`arguments` for a benchmark timed in interleaved rounds of steps: --rounds and
    --steps-per-round, which --smoke sets to one round of `smoke_steps_per_round` steps."""
    args = arguments(
        doc,
        name,
        "tiny sizes and one round: checks that it runs",
        extra=[
            ("--rounds", dict(type=int, default=rounds)),
            ("--steps-per-round", dict(type=int, default=steps_per_round)),
        ],
    )
    if args.smoke:
        args.rounds, args.steps_per_round = 1, smoke_steps_per_round
    return args


def check_block(path: str, name: str, folder: str = "benchmarks", variant: str = "") -> None:
    """Exit with one line unless `path` can be read and holds the markers of `name` (called before
    measuring, so that a wrong path fails in a second rather than after the whole run)."""
    _rewrite(path, name, None, folder, variant)


def write_block(path: str, name: str, body: str, folder: str = "benchmarks", variant: str = "") -> None:
    """Replace the block of benchmark `name` in the Markdown file `path`; on any problem, exit
    with one line (`<name>.py: --write-docs <path>: <what is wrong>`)."""
    _rewrite(path, name, body, folder, variant)
    print(f"wrote the figures of {folder}/{name}.py {variant}".rstrip() + f" into {path}", file=sys.stderr)


def _rewrite(path: str, name: str, body: str | None, folder: str = "benchmarks", variant: str = "") -> None:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new_text = replace_block(text, name, body or "", folder, variant)
        if body is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(new_text)
    except (OSError, UnicodeDecodeError, DocsBlockError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        sys.exit(f"{name}.py: --write-docs {path}: {reason}")


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (cells are written with str())."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line(devices: Sequence[object], extra: str = "", smoke: bool = False) -> str:
    """One line naming the machine: the devices (counted per kind), the CPU cores, and `extra`
    (e.g. the peak FLOP/s measured in the same run)."""
    kinds = collections.Counter(
        d.platform if d.device_kind.lower() == d.platform.lower() else f"{d.platform} ({d.device_kind})"
        for d in devices
    )
    described = ", ".join(f"{n} × {kind}" for kind, n in kinds.items())
    line = f"Machine: {described}; {os.cpu_count()} CPU cores"
    if extra:
        line += f"; {extra}"
    line += "."
    if smoke:
        line += " Smoke run (tiny sizes, 1–2 rounds): these figures only show that the benchmark runs."
    return line


def run_arguments(argv: Sequence[str]) -> str:
    """The command-line arguments of a run, less `--write-docs PATH` (for the block's first line)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--write-docs":
            skip = True
        elif not arg.startswith("--write-docs="):
            out.append(arg)
    return " ".join(out)


def block(script: str, args_line: str, machine: str, tables: Sequence[str], notes: Sequence[str] = ()) -> str:
    """The whole block: what was run, the machine, the tables and any notes, blank-line separated."""
    parts = [f"Written by `python benchmarks/{script}.py{' ' + args_line if args_line else ''}`. {machine}"]
    parts += list(tables) + list(notes)
    return "\n\n".join(parts)


def ms(seconds: float) -> str:
    """A time in milliseconds with about three significant digits."""
    value = seconds * 1e3
    return f"{value:.3g} ms" if value < 100 else f"{value:.0f} ms"


def rate(per_second: float) -> str:
    """A rate (tokens/s) with about three significant digits."""
    return f"{per_second:.3g}" if per_second < 1000 else f"{per_second:.0f}"
