"""What the experiment scripts share: running a sweep, loading its models, mean ± std over seeds,
and writing each experiment's block of docs/results.md.

Every experiment is one script, `python experiments/<name>.py [--smoke] [--write-docs PATH]`.
It trains what it needs with `fbt-sweep` (so a rerun skips what is finished and resumes what was
interrupted), evaluates the trained checkpoints with `fbt_jax.evaluate`, and rewrites the block
between `<!-- begin: experiments/<name>.py -->` and `<!-- end: experiments/<name>.py -->`.
`--smoke` runs the same code at a few steps into a temporary directory (the tests run it), its
jobs sharing one compilation cache, and no sweep job that only a few steps' sampling makes.
The state-tracking sweep (`runs/experiments/state_tracking`) is shared: the depth-stability and
probe experiments evaluate its models rather than train their own.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
# The commands the experiments run (fbt-sweep, fbt-prepare, ...) are this interpreter's, also when
# it is started as .venv/bin/python without activating its environment.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

import docs_block  # noqa: E402  (benchmarks/docs_block.py: the marker-delimited blocks)
import scales  # noqa: E402

from fbt_jax.sweep.report import gather  # noqa: E402
from fbt_jax.sweep.state import SweepDirectory  # noqa: E402

# --- which code a result comes from (issue #47) --------------------------------------------------
# A result is tied to the code that trained and evaluated its models: the last commit that changed
# CODE_PATHS. Commits that touch only docs, tests, benchmarks or these scripts keep that version, so
# a figure stays reproducible at the current commit until the library itself changes.
CODE_PATHS = ("fbt_jax", "configs", "pyproject.toml")
STAMP = "code.json"  # in a sweep directory: the code versions that trained there, in order
UNKNOWN = "unknown"  # trained before stamps were kept, or outside a git checkout


def code_version() -> str:
    """'<commit>@jax<version>': the short commit of the last change to CODE_PATHS, with '+edits'
    where the work tree has changed them since (a result from uncommitted code is tied to no commit;
    UNKNOWN outside git), and the jax that computes with it, which pyproject.toml leaves open: two
    jax releases round the same program otherwise (docs/platform-notes.md)."""

    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", REPO, *argv], check=True, capture_output=True, text=True).stdout.strip()

    try:
        last = git("log", "-1", "--format=%H", "--", *CODE_PATHS)[:7]
        edited = git("status", "--porcelain", "--", *CODE_PATHS)  # new files too
    except (OSError, subprocess.CalledProcessError):
        return UNKNOWN
    return (last or UNKNOWN) + ("+edits" if edited else "") + f"@jax{importlib.metadata.version('jax')}"


def trained_at(directory: str) -> list[str]:
    """The code versions that trained in the sweep `directory` ([] where none was stamped)."""
    path = os.path.join(directory, STAMP)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return json.load(f)["trained_at"]


def stamp_training(directory: str, version: str, begun: bool | None = None) -> None:
    """Add `version` to the code versions that trained in `directory`; where training had `begun`
    there before stamps were kept (default: a sweep.json is there), UNKNOWN first (its finished jobs
    were trained by code no one recorded)."""
    versions = trained_at(directory)
    begun = os.path.exists(os.path.join(directory, "sweep.json")) if begun is None else begun
    if not versions and begun:
        versions = [UNKNOWN]
    if version not in versions:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, STAMP), "w", encoding="utf-8") as f:
            json.dump({"trained_at": versions + [version]}, f)


def rows_code(rows: Sequence[dict[str, Any]]) -> str:
    """The code a rung of `rows` comes from: the one version that trained all its runs when it is
    also the version evaluating them now, else what differs ('trained at a, b; evaluated at c')."""
    trained = sorted({v for row in rows for v in (row.get("trained_at") or [UNKNOWN])})
    now = code_version()
    return now if trained == [now] else f"trained at {', '.join(trained)}; evaluated at {now}"


def arguments(doc: str, name: str, extra: Sequence[tuple[str, dict]] = ()) -> argparse.Namespace:
    """--smoke, --write-docs PATH and --dir (where the sweeps go); a --write-docs file without
    this experiment's markers fails here, before anything is trained."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    for flag, options in extra:
        parser.add_argument(flag, **options)
    parser.add_argument("--smoke", action="store_true", help="a few steps into a temporary directory (tests)")
    parser.add_argument(
        "--write-docs", metavar="PATH", help="rewrite this experiment's block in the Markdown file PATH"
    )
    parser.add_argument(
        "--dir",
        default="",
        help="this experiment's directory (default: runs/experiments/<name>); "
        "sweeps shared with other experiments go beside it",
    )
    args = parser.parse_args()
    if args.write_docs:  # its block and the summary's (experiments/summary.py): both are rewritten
        docs_block.check_block(args.write_docs, name, folder="experiments", variant=scales.variant(args))
        docs_block.check_block(args.write_docs, "summary", folder="experiments")
    if not args.dir:
        scale = scales.of(args).name
        default = os.path.join("runs", "experiments" if scale == "cpu" else f"experiments-{scale}")
        root = tempfile.mkdtemp(prefix="fbt-experiments-") if args.smoke else default
        args.dir = os.path.join(root, name)
    # Experiments share sweeps (the state-tracking models) through this parent directory.
    args.sweeps_dir = os.path.dirname(os.path.abspath(args.dir))
    if args.smoke:
        share_compilation_cache(os.path.join(args.sweeps_dir, "compilation_cache"))
    return args


def share_compilation_cache(directory: str) -> None:
    """One persistent compilation cache for this process and every job it starts (a smoke run's
    jobs compile the same few programs, and a job's start-up and compiles are most of its time):
    $JAX_COMPILATION_CACHE_DIR, unless it is set already. The programs and their results are the
    same; only where they are compiled from changes."""
    from fbt_jax.run_services import use_compilation_cache

    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", directory)
    use_compilation_cache(os.environ["JAX_COMPILATION_CACHE_DIR"], "JAX_COMPILATION_CACHE_DIR")


def run_sweep(
    spec: str, directory: str, overrides: Sequence[str] = (), parallel: int = 2, min_shared_steps: int | None = None
) -> list[dict[str, Any]]:
    """Train (or finish) the sweep of `spec` in `directory`; one record per run, as `fbt-sweep
    report` gathers them (labels, final eval metrics, curve), plus the run's `workdir` and `config`.
    `min_shared_steps`: fbt-sweep's shortest trunk worth a job (None: its default)."""
    if not sweep_complete(directory):  # this invocation trains (some of) it: its code is stamped
        stamp_training(directory, code_version())
    command = ["fbt-sweep", "run", spec, f"--dir={directory}", f"--parallel={parallel}"]
    command += [f"--override={o}" for o in overrides]
    command += [] if min_shared_steps is None else [f"--min-shared-steps={min_shared_steps}"]
    print("$ " + " ".join(command), flush=True)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    sweep_dir = SweepDirectory(directory, os.path.basename(directory.rstrip("/")))
    sweep, jobs = sweep_dir.load()
    by_name, configs = {job.name: job for job in jobs}, {run.name: run.config for run in sweep.runs}
    rows = gather(sweep_dir, sweep, jobs)
    if len(rows) != len(sweep.runs):
        raise RuntimeError(f"{len(sweep.runs) - len(rows)} runs of {directory} did not finish; see `fbt-sweep status`")
    versions = trained_at(directory)
    for row in rows:
        row["workdir"], row["config"] = by_name[row["run"]].workdir, configs[row["run"]]
        row["trained_at"] = versions
    return rows


def load_spec(path: str) -> dict[str, Any]:
    """A sweep spec's dict, with its `base` made absolute (so that a changed copy can live anywhere)."""
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("sweep_spec", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    sweep = module.get_sweep()
    sweep["base"] = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), sweep["base"]))
    return sweep


SMOKE_OVERRIDES = {
    "train.steps": 24,
    "optimizer.warmup_steps": 4,
    "checkpoint.every_steps": 12,
    "eval.every_steps": 12,
    "eval.num_batches": 1,
    "eval.contraction_every_steps": 0,
}


# A smoke sweep's shortest trunk worth a job, as a fraction (1 / this) of its steps. In a few steps
# the feedback mixtures can draw the same passes to the end (K=3 is drawn 12% of the time), where
# fbt-sweep would give their shared tail a job of its own and each run a job that only evaluates:
# start-ups and compiles a full run, whose mixtures part within a few steps, never has.
SMOKE_MIN_SHARED = 2


def smoke_spec(path: str, sweeps_dir: str, schedules: Sequence[str], **overrides: Any) -> str:
    """A smoke copy of the spec at `path`: 24 steps, one seed, its first run only, the given
    schedules, and `overrides` (dotted names with '__' for '.'). Written to
    `<sweeps_dir>/smoke-specs/`, so that experiments sharing a sweep share its smoke copy too."""
    sweep = load_spec(path)
    sweep["overrides"] |= SMOKE_OVERRIDES | {k.replace("__", "."): v for k, v in overrides.items()}
    if "runs" in sweep:
        sweep["runs"] = sweep["runs"][:1]
    sweep["grid"]["passes.schedule"] = {k: sweep["grid"]["passes.schedule"][k] for k in schedules}
    sweep["seeds"] = [0]
    directory = os.path.join(sweeps_dir, "smoke-specs")
    os.makedirs(directory, exist_ok=True)
    out = os.path.join(directory, os.path.basename(path))
    with open(out, "w", encoding="utf-8") as f:
        f.write(f"def get_sweep():\n    return {sweep!r}\n")
    return out


def sweep_minutes(directory: str) -> float:
    """Minutes of job time the sweep in `directory` took: every job's wall time, all attempts,
    summed (with `--parallel=2` the wall clock was about half of it)."""
    sweep_dir = SweepDirectory(directory, os.path.basename(directory.rstrip("/")))
    _, jobs = sweep_dir.load()
    return sum(sweep_dir.job_seconds(job.name) or 0.0 for job in jobs) / 60


LADDER = (1.0, 2.5, 5.0)  # the state-tracking budget ladder: multiples of its spec's steps
SMOKE_LADDER = (1.0,)  # a smoke run checks the scripts, one rung (a ladder's rule and carried rungs: tests)


def state_tracking_runs(args: argparse.Namespace, factor: float | None = None) -> list[dict[str, Any]]:
    """The state-tracking sweep's runs (`configs/sweeps/state_tracking.py`), trained now if they
    are not yet; the smoke copy keeps the three schedules the experiments read (k1, k12, paper).
    `factor` scales its budget (steps, and the eval and checkpoint intervals with them) for a rung
    of the budget ladder, trained in its own directory beside the first. Without one, the highest
    rung whose sweep is complete on disk (the models the state-tracking verdict stands on), else ×1.
    The experiment's scale (`scales.py`) sizes the model, batch and jobs at once."""
    spec = os.path.join(REPO, "configs", "sweeps", "state_tracking.py")
    if args.smoke:
        spec = smoke_spec(spec, args.sweeps_dir, ("k1", "k12", "paper"))
    if factor is None:
        ladder = SMOKE_LADDER if args.smoke else LADDER
        factor = next((f for f in reversed(ladder) if sweep_complete(state_tracking_dir(args, f))), 1.0)
    scale = scales.of(args)
    overrides = scale.sweep_overrides() + ladder_overrides(spec, factor)
    directory = state_tracking_dir(args, factor)
    if args.smoke:  # the K=1 trunk (the first 75%) as in the full run; see SMOKE_MIN_SHARED
        steps = round(SMOKE_OVERRIDES["train.steps"] * factor)
        return run_sweep(spec, directory, overrides, scale.parallel, min_shared_steps=steps // SMOKE_MIN_SHARED)
    return run_sweep(spec, directory, overrides, scale.parallel)


def state_tracking_ladder(args: argparse.Namespace) -> list[list[dict[str, Any]]]:
    """The state-tracking runs of every ladder rung complete on disk, lowest budget first (×1
    trained now where none is): the models the probe and depth claims are judged on, rung by rung."""
    ladder = SMOKE_LADDER if args.smoke else LADDER
    done = [f for f in ladder if sweep_complete(state_tracking_dir(args, f))]
    return [state_tracking_runs(args, f) for f in done or [1.0]]


def sweep_complete(directory: str) -> bool:
    """Whether `directory` holds a sweep every run of which has finished."""
    if not os.path.exists(os.path.join(directory, "sweep.json")):
        return False
    sweep_dir = SweepDirectory(directory, os.path.basename(directory.rstrip("/")))
    sweep, jobs = sweep_dir.load()
    return len(gather(sweep_dir, sweep, jobs)) == len(sweep.runs)


def state_tracking_dir(args: argparse.Namespace, factor: float = 1.0) -> str:
    suffix = "" if factor == 1.0 else f"-x{factor:g}"
    return os.path.join(args.sweeps_dir, f"state_tracking{suffix}")


def ladder_overrides(spec: str, factor: float) -> list[str]:
    """fbt-sweep overrides that scale the spec's steps and its eval and checkpoint intervals."""
    if factor == 1.0:
        return []
    sizes = load_spec(spec)["overrides"]
    return [
        f"{key}={round(sizes[key] * factor)}" for key in ("train.steps", "eval.every_steps", "checkpoint.every_steps")
    ]


EARLIER = " (earlier invocation)"  # marks a ladder row carried from the block an earlier invocation wrote


def earlier_rungs(
    args: argparse.Namespace, name: str, width: int, rung_steps: set[int], measured: set[int]
) -> list[dict[str, Any]]:
    """The rungs of a budget ladder (`rung_steps`) that an earlier invocation of experiment `name`
    measured and wrote into the --write-docs block, and this one did not, as that block has them:
    per rung, its rows of the ladder table (those of `width` cells whose first cell is its steps,
    marked EARLIER), its "budget check:" paragraphs (those naming "<steps> steps") each with the
    "verdict (" paragraph right after it, and the whole block (for figures the experiment parses
    itself). A rung's runs need not survive on disk: a machine whose disk is wiped between sessions
    climbs the ladder one rung per session. A smoke run carries nothing."""
    if args.smoke or not args.write_docs or not os.path.exists(args.write_docs):
        return []
    begin, end = docs_block.markers(name, "experiments", scales.variant(args))
    text = open(args.write_docs, encoding="utf-8").read()
    if begin not in text or end not in text:
        return []
    block = text.split(begin, 1)[1].split(end, 1)[0]
    paragraphs = [p.strip() for p in block.split("\n\n")]
    rungs: dict[int, dict[str, Any]] = {}
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        found = re.match(r"(\d+)", cells[0]) if line.startswith("| ") and len(cells) == width else None
        steps = int(found.group(1)) if found else None
        if steps is None or steps not in rung_steps or steps in measured:
            continue
        rung = rungs.setdefault(steps, dict(steps=steps, rows=[], paragraphs=[], block=block))
        rung["rows"].append([f"{steps}{EARLIER}", *cells[1:]])
    for steps, rung in rungs.items():
        for i, paragraph in enumerate(paragraphs):
            if paragraph.startswith("budget check:") and re.search(rf"(?<![\d,]){steps} steps", paragraph):
                rung["paragraphs"].append(paragraph)
                if i + 1 < len(paragraphs) and paragraphs[i + 1].startswith("verdict ("):
                    rung["paragraphs"].append(paragraphs[i + 1])
    return sorted(rungs.values(), key=lambda r: r["steps"])


def carried_note(earlier: Sequence[dict[str, Any]], unjudged: Sequence[int] = ()) -> str:
    """The sentence a block adds when it shows rungs carried by `earlier_rungs` ('' when none); the
    rungs (steps) in `unjudged` kept no per-seed values of the effect, so the verdict rule cannot
    count them: said, with how to measure them again."""
    if not earlier:
        return ""
    note = (
        f" The ladder's rows marked{EARLIER} were measured by an earlier invocation (its runs are not on this disk) "
        "and are carried over from the block it wrote."
    )
    if unjudged:
        note += (
            f" That invocation kept no per-seed values of the effect at {', '.join(map(str, unjudged))} steps, so the "
            "verdict rule judges the ladder without them; `--ladder` with their multiples of N measures them again."
        )
    return note


def stdlib_inputs(listing: str, files: str = "*.py") -> str:
    """An fbt-* `--input` for this interpreter's standard-library sources (`files`: comma-separated
    globs below its directory, `**` recursive): `@listing`, a file naming each match that is
    non-empty UTF-8 text. The others (a package's bare `__init__.py`, the test suite's Latin-1
    modules) are left out: fbt-prepare and fbt-train-tokenizer refuse them."""
    root = os.path.dirname(os.__file__)
    paths = {p for f in files.split(",") for p in glob.glob(os.path.join(root, f), recursive=True)}
    os.makedirs(os.path.dirname(os.path.abspath(listing)), exist_ok=True)
    with open(listing, "w", encoding="utf-8") as f:
        f.writelines(f"{p}\n" for p in sorted(paths) if _is_utf8_text(p))
    return f"@{os.path.abspath(listing)}"


def _is_utf8_text(path: str) -> bool:
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return len(data) > 0


def prepare_stdlib(output: str, seq_len: int, files: str = "*.py", tokenizer: str = "") -> str:
    """This interpreter's standard-library sources (`files`, as `stdlib_inputs` takes them) as
    records of `seq_len` tokens in `output` (bytes, or `tokenizer`'s ids), 10% of the files held
    out; prepared once (fbt-prepare refuses to overwrite, and a rerun of an experiment must not redo
    it). No download."""
    if not os.path.exists(os.path.join(output, "meta.json")):
        inputs = stdlib_inputs(f"{output.rstrip(os.sep)}.inputs.txt", files)
        command = ["fbt-prepare", f"--input={inputs}", f"--output={output}", f"--seq-len={seq_len}"]
        command += [f"--tokenizer={tokenizer}"] if tokenizer else []
        subprocess.run(command + ["--validation-fraction=0.1"], check=True, stdout=subprocess.DEVNULL)
    return output


def mean_std(values: Sequence[float], digits: int = 3) -> str:
    """'0.423 ± 0.012' (sample std over seeds; '0.423' alone for one value)."""
    values = np.asarray(values, float)
    if len(values) < 2:
        return f"{values.mean():.{digits}f}"
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1):.{digits}f}"


def by_label(rows: Sequence[dict[str, Any]], label: str) -> dict[str, list[dict[str, Any]]]:
    """Rows grouped by one label (e.g. 'schedule'), in first-seen order; the seeds are the members."""
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        out.setdefault(row[f"label.{label}"], []).append(row)
    return out


def machine() -> str:
    """The CPU, or the accelerator where JAX has one (where the evaluations ran, and the jobs)."""
    import jax

    cpu = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    devices = jax.devices()
    return cpu if devices[0].platform == "cpu" else f"{len(devices)} × {devices[0].device_kind} with an {cpu}"


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def minutes(self) -> float:
        return (time.perf_counter() - self.start) / 60


def finish(args: argparse.Namespace, name: str, body: str) -> None:
    """Print the block (after its first line, a note on a smoke run) and write it into --write-docs."""
    if args.smoke:
        first, _, rest = body.partition("\n")
        body = f"{first}\n\nSmoke run (a few steps): these figures only show that the experiment runs.\n{rest}"
    print(body)
    if args.write_docs:
        docs_block.write_block(args.write_docs, name, body, folder="experiments", variant=scales.variant(args))


def figure_line(args: argparse.Namespace, path: str, caption: str) -> str:
    """The block's line for a plot: a Markdown image relative to the --write-docs file, else its path."""
    if not args.write_docs:
        return f"Plot: {path}"
    return f"![{caption}]({os.path.relpath(path, os.path.dirname(os.path.abspath(args.write_docs)))})"


def pyplot() -> Any:
    """matplotlib's pyplot, drawing to files (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def plot_path(args: argparse.Namespace, name: str) -> str:
    """Where a plot goes: docs/results/<name>.png beside --write-docs, else the sweep directory."""
    directory = (
        os.path.join(os.path.dirname(os.path.abspath(args.write_docs)), "results") if args.write_docs else args.dir
    )
    os.makedirs(directory, exist_ok=True)
    scale = scales.of(args).name  # a scaled run's plot beside the default one, not over it
    return os.path.join(directory, f"{name}.png" if scale == "cpu" else f"{name}-{scale}.png")
