"""Every benchmark runs: in smoke mode it prints finite, positive figures as its last (JSON) line and
rewrites its block of a Markdown file; and no benchmark reaches for a private fbt_jax name."""

import ast
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
from conftest import ROOT, cpu_env, run_command

BENCHMARK_DIR = os.path.join(ROOT, "benchmarks")
XDIST_SPLIT = True  # the smoke runs share nothing: either worker takes each (tests/scheduling.py)
# benchmark → a top-level key its JSON line must have
BENCHMARKS = {
    "step_cost": "configs",
    "checkpoint_cost": "save_restore",
    "data_throughput": "pipeline",
    "prepare_throughput": "tokens_per_second",
    "decode_cost": "results",
    "sharding_overhead": "compile_seconds",
    "first_run": "wall_seconds",
    "dry_run_memory": "device_mib_K3",
    "compile_memory": "gib_per_device",
    "sweep_cost": "ratio",
    "gpu_check": "checks",
    "interop_memory": "export",
    "restart_cost": "start_up",
    "harness_cost": "results",
    "serve_throughput": "results",
    "tuning_cost": "ratio",
}
# These quote what a command printed (a fenced text block) rather than a table.
QUOTES_OUTPUT = {"first_run", "dry_run_memory"}
HELPERS = {"docs_block", "bench_configs", "gpu_speed"}  # modules the benchmarks share (gpu_speed: gpu_check's)

BEFORE = "# Notes\n\nText before the figures.\n\n"
AFTER = "\nText after the figures, with a table of its own:\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"


def markdown(name: str) -> str:
    return f"{BEFORE}<!-- begin: benchmarks/{name}.py -->\nold figures\n<!-- end: benchmarks/{name}.py -->\n{AFTER}"


def run_benchmark(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python benchmarks/<name>.py ARGS` from the repository root, on the CPU: one device, except
    for sharding_overhead, which runs on 8 simulated ones (it also sets that flag itself)."""
    # conftest's 8 simulated devices are for this process, not the benchmarks
    env = cpu_env(8 if name == "sharding_overhead" else None)
    return run_command([sys.executable, os.path.join("benchmarks", f"{name}.py"), *args], env, timeout=timeout)


def line_kinds(quoted: str) -> list[str]:
    """The first word of each line a command printed, up to its list of outputs: what a run of any
    length prints alike (warnings aside, which depend on what the run trained)."""
    lines = quoted.split("outputs in")[0].splitlines()
    return [line.split()[0] for line in lines if line.strip() and not line.startswith("warning:")]


def numbers(tree, path: str = ""):
    """(path, value) of every number in a JSON tree."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from numbers(value, f"{path}.{key}")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from numbers(value, f"{path}[{i}]")
    elif isinstance(tree, int | float) and not isinstance(tree, bool):
        yield path, tree


def test_every_script_in_benchmarks_is_covered():
    scripts = {f.removesuffix(".py") for f in os.listdir(BENCHMARK_DIR) if f.endswith(".py")}
    assert scripts == set(BENCHMARKS) | HELPERS


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmark_smoke_run_prints_figures_and_writes_docs(name, tmp_path):
    doc = tmp_path / "figures.md"
    doc.write_text(markdown(name))
    result = run_benchmark(name, "--smoke", "--write-docs", str(doc))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert BENCHMARKS[name] in figures
    found = list(numbers(figures))
    assert found, "the JSON line holds no figures"
    for path, value in found:  # times, sizes, rates and ratios: all must be measured, finite and > 0
        assert math.isfinite(value) and value > 0, f"{name}: {path} = {value}"

    text = doc.read_text()
    begin, end = f"<!-- begin: benchmarks/{name}.py -->\n", f"<!-- end: benchmarks/{name}.py -->\n"
    assert text.startswith(BEFORE + begin) and text.endswith(end + AFTER), text
    block = text[len(BEFORE + begin) : -len(end + AFTER)]
    assert "old figures" not in block
    assert f"python benchmarks/{name}.py --smoke" in block and "Machine:" in block
    if name in QUOTES_OUTPUT:
        assert "```text\n" in block and block.rstrip().endswith("```"), block
        if name == "first_run":  # README's block shows every kind of line the command prints (issue #58)
            with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
                readme = f.read().split("<!-- begin: benchmarks/first_run.py -->")[1]
            assert line_kinds(readme.split("```text\n")[1]) == line_kinds(block.split("```text\n")[1]), (
                "README.md's first-run block is not what the command prints: "
                "python benchmarks/first_run.py --write-docs README.md"
            )
        return
    lines = block.splitlines()
    separators = [i for i, line in enumerate(lines) if re.fullmatch(r"\|(---\|)+", line)]
    assert separators, block
    for i in separators:  # a header above, at least one row below, as many cells as the separator
        cells = lines[i].count("|")
        assert lines[i - 1].startswith("| ") and lines[i - 1].count("|") == cells
        assert lines[i + 1].startswith("| ") and lines[i + 1].count("|") == cells


def test_gpu_check_script_refuses_in_one_line_where_jax_sees_no_gpu():
    """benchmarks/gpu_check.sh on this CPU-only machine: one line naming the fix, before any work
    (its checks themselves run in the smoke test above, CPU against CPU)."""
    result = run_command(["bash", os.path.join("benchmarks", "gpu_check.sh")], cpu_env(None), timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().startswith("gpu_check.sh: jax sees no GPU ("), result.stderr
    assert "pip install 'jax[cuda13]'" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_write_docs_without_markers_fails_in_one_line_before_measuring(tmp_path):
    doc = tmp_path / "figures.md"
    doc.write_text(markdown("step_cost"))  # another benchmark's markers
    result = run_benchmark("decode_cost", "--smoke", "--write-docs", str(doc), timeout=120)
    assert result.returncode != 0
    assert result.stderr.strip() == (
        f"decode_cost.py: --write-docs {doc}: no marker line <!-- begin: benchmarks/decode_cost.py --> "
        "(add the pair <!-- begin: benchmarks/decode_cost.py --> / <!-- end: benchmarks/decode_cost.py --> "
        "where the figures go)"
    )
    assert result.stdout == "" and doc.read_text() == markdown("step_cost")


def load_docs_block():
    spec = importlib.util.spec_from_file_location("docs_block", os.path.join(BENCHMARK_DIR, "docs_block.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_replace_block_keeps_everything_outside_the_markers():
    docs_block = load_docs_block()
    text = "a\n<!-- begin: benchmarks/x.py -->\nold\nlines\n<!-- end: benchmarks/x.py -->\nb"
    new = docs_block.replace_block(text, "x", "| t |\n|---|\n| 1 |\n")
    assert new == "a\n<!-- begin: benchmarks/x.py -->\n| t |\n|---|\n| 1 |\n<!-- end: benchmarks/x.py -->\nb"
    assert docs_block.replace_block(new, "x", "old\nlines") == text
    for bad in (
        "a\n",
        "<!-- end: benchmarks/x.py -->\n<!-- begin: benchmarks/x.py -->\n",
        text + "\n" + text,
    ):
        with pytest.raises(docs_block.DocsBlockError):
            docs_block.replace_block(bad, "x", "")


def private_names(source: str) -> list[str]:
    """Private (single leading underscore) names a script uses: imported from fbt_jax, or read as
    an attribute (of anything: the objects benchmarks touch are fbt_jax's, and the rule is simplest
    whole), or fetched with getattr/hasattr by a literal name."""

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fbt_jax":
            found += [f"{node.module}" for part in node.module.split(".") if private(part)]
            found += [f"{node.module}.{alias.name}" for alias in node.names if private(alias.name)]
        elif isinstance(node, ast.Import):
            found += [
                alias.name
                for alias in node.names
                if alias.name.split(".")[0] == "fbt_jax" and any(private(p) for p in alias.name.split("."))
            ]
        elif isinstance(node, ast.Attribute) and private(node.attr):
            found.append(f".{node.attr} (line {node.lineno})")
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and private(node.args[1].value)
        ):
            found.append(f"{node.func.id}(…, {node.args[1].value!r}) (line {node.lineno})")
    return found


def test_private_name_check_catches_what_it_should():
    source = (
        "import fbt_jax._internal\n"
        "from fbt_jax.train.programs import _compile\n"
        "from fbt_jax._x import y\n"
        "batch = trainer._local_batch('train', 0, 8)\n"
        "getattr(trainer, '_abstract')\n"
        "ok = trainer.batch('train', 0, 8), __doc__, x.__class__\n"
    )
    assert len(private_names(source)) == 5, private_names(source)


@pytest.mark.parametrize("name", sorted(set(BENCHMARKS) | HELPERS))
def test_benchmarks_use_only_public_fbt_jax_names(name):
    with open(os.path.join(BENCHMARK_DIR, f"{name}.py"), encoding="utf-8") as f:
        assert private_names(f.read()) == [], f"benchmarks/{name}.py uses private names"
