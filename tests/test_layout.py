"""The package's layout is its architecture, and the docs describe it (issue #10).

- no import circle between fbt_jax modules (module-level and function-level imports alike);
- no import runs up a floor: every module stands on one of FLOORS, and imports only from its own
  floor or those below it (reading a model does not depend on the training package; issue #45);
- no module longer than MAX_LINES: a module is small enough to read in one sitting;
- docs/architecture.md's module table names every module, and only modules that exist, and its
  floors table is FLOORS;
- docs/config.md documents every config field with its default, and no field that does not exist.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess

import pytest

from fbt_jax.config import default_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "fbt_jax")
MAX_LINES = 350


def package_modules() -> dict[str, str]:
    """Dotted module name → file path, for every module of fbt_jax."""
    modules = {}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                modules[dotted.removesuffix(".__init__")] = path
    return modules


def imported_modules(path: str, known: set[str]) -> set[str]:
    """The fbt_jax modules a file imports anywhere in it (except under `if TYPE_CHECKING:`)."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    type_checking = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from fbt_jax import paths` imports the module fbt_jax.paths; `from fbt_jax.x import y` imports fbt_jax.x.
            found |= {f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in known}
            found.add(node.module)
    return {name for name in found if name in known}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (as a path that returns to its start), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    known = set(modules)
    # A package's __init__ is not an edge: every module here imports submodules by full name.
    return {name: imported_modules(path, known) - {"fbt_jax"} - {name} for name, path in modules.items()}


# The house, ground floor first: a module imports only from its own floor and those below. A module
# is placed by the longest prefix that names it (`fbt_jax.data` places every data module).
FLOORS = (
    (  # foundations: errors, files and the run directory, hardware, the schedule, run-time services
        "fbt_jax.errors",
        "fbt_jax.permissions",
        "fbt_jax.progress",
        "fbt_jax.paths",
        "fbt_jax.workdir",
        "fbt_jax.hardware",
        "fbt_jax.targets",
        "fbt_jax.distributed",
        "fbt_jax.schedule",
        "fbt_jax.metrics",
        "fbt_jax.losses",
        "fbt_jax.contraction",
        "fbt_jax.run_services",
        "fbt_jax.train.program_facts",
    ),
    ("fbt_jax.attention",),  # the attention kernels behind one interface
    (  # the model and its math: layers, the K-pass objective, decoding, sharding, checkpoints, new phases
        "fbt_jax.layers",
        "fbt_jax.model",
        "fbt_jax.feedback",
        "fbt_jax.probes",
        "fbt_jax.decode",
        "fbt_jax.sharding",
        "fbt_jax.flops",
        "fbt_jax.checkpoint",
        "fbt_jax.init_from",
    ),
    ("fbt_jax.data",),  # files → documents → tokens → records → batches
    ("fbt_jax.config", "fbt_jax.trained"),  # a run's config and a trained run read back
    ("fbt_jax.interop",),  # Hugging Face checkpoints in and out
    ("fbt_jax.evals", "fbt_jax.evaluate", "fbt_jax.decode_cli", "fbt_jax.serve"),  # evaluation, decoding, serving
    ("fbt_jax.validation", "fbt_jax.train"),  # checking a run's config, then training it
    ("fbt_jax.sweep", "fbt_jax.selftrain"),  # sweeps of runs, rounds of self-training
)


def floor_of(module: str, floors=FLOORS) -> int | None:
    """The floor a module stands on (its longest matching prefix), None if no floor names it."""
    matches = [
        (len(prefix), number)
        for number, prefixes in enumerate(floors)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1] if matches else None


def arrows_up(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """Every import in `graph` from a module to one on a higher floor, as "a (floor i) → b (floor j)"."""
    return sorted(
        f"{source} (floor {floor_of(source, floors)}) → {target} (floor {floor_of(target, floors)})"
        for source, targets in graph.items()
        for target in targets
        if floor_of(target, floors) > floor_of(source, floors)
    )


def test_every_module_stands_on_a_floor():
    unplaced = sorted(name for name in import_graph() if name != "fbt_jax" and floor_of(name) is None)
    assert not unplaced, f"modules on no floor of tests/test_layout.py's FLOORS: {unplaced}; place each on one"


def test_no_import_runs_up_a_floor():
    graph = {name: targets for name, targets in import_graph().items() if name != "fbt_jax"}
    up = arrows_up(graph)
    assert not up, "imports that run up a floor (move what they use down, or the module up): " + "; ".join(up)


def test_architecture_doc_shows_the_floors():
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        rows = [line for line in f if re.match(r"\| \d+ \| `", line)]
    documented = [
        {"fbt_jax." + name.rstrip("/").replace("/", ".") for name in re.findall(r"`([^`]+)`", row.split("|")[2])}
        for row in rows
    ]
    assert documented == [set(floor) for floor in FLOORS], "docs/architecture.md's floors table is not FLOORS"


def test_floor_checker_finds_what_it_should():
    floors = (("pkg.base",), ("pkg.model", "pkg.data.plan"), ("pkg.data", "pkg.train"))
    assert floor_of("pkg.data.plan", floors) == 1 and floor_of("pkg.data.loader", floors) == 2
    assert floor_of("pkg.database", floors) is None
    assert arrows_up({"pkg.model": {"pkg.base"}, "pkg.train": {"pkg.model", "pkg.data"}}, floors) == []
    assert arrows_up({"pkg.base": {"pkg.train.services"}, "pkg.data.plan": {"pkg.data.loader"}}, floors) == [
        "pkg.base (floor 0) → pkg.train.services (floor 2)",
        "pkg.data.plan (floor 1) → pkg.data.loader (floor 2)",
    ]


def test_no_import_circle():
    assert find_cycle(import_graph()) is None, " → ".join(find_cycle(import_graph()))


def test_cycle_finder_finds_what_it_should():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_dry_run_does_not_import_the_loop():
    graph = import_graph()

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for target in graph[todo.pop()] - seen:
                seen.add(target)
                todo.append(target)
        return seen

    assert {"fbt_jax.train.loop", "fbt_jax.train.hooks", "fbt_jax.train.trainer"}.isdisjoint(
        reachable("fbt_jax.train.dry_run")
    )


@pytest.mark.parametrize("name", sorted(package_modules()))
def test_module_is_small_enough_to_read_in_one_sitting(name):
    with open(package_modules()[name], encoding="utf-8") as f:
        lines = len(f.readlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (> {MAX_LINES}): split it by concern"


def module_table() -> set[str]:
    """Files named in the first column of docs/architecture.md's module table (a second name in a
    cell is in the first one's directory; a directory row names its files in the second column)."""
    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("| module | what it holds |") :].split("\n\n")[0]
    named = set()
    for row in table.splitlines()[2:]:
        first, second = row.split("|")[1:3]
        names = re.findall(r"`([^`]+)`", first)
        base = os.path.dirname(names[0]) if not names[0].endswith("/") else names[0].rstrip("/")
        if names[0].endswith("/"):
            names = [n for n in re.findall(r"`([^`]+\.py)`", second)]
        named |= {n if "/" in n else f"{base}/{n}" for n in names}
    return named


def test_module_table_names_every_module_and_nothing_else():
    modules = {
        os.path.relpath(path, ROOT)
        for path in package_modules().values()
        if os.path.basename(path) not in ("__init__.py", "__main__.py")
    }
    named = module_table()
    assert not modules - named, f"modules missing from docs/architecture.md's module table: {sorted(modules - named)}"
    assert not named - modules, (
        f"docs/architecture.md's module table names files that do not exist: {sorted(named - modules)}"
    )


def config_fields(config, prefix: str = "") -> dict[str, object]:
    out = {}
    for key, value in config.items():
        if hasattr(value, "items"):
            out |= config_fields(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def documented_fields() -> dict[str, str]:
    """Field → the default docs/config.md gives for it (as written, without backticks)."""
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        rows = [line for line in f if re.match(r"\| `[a-z_.0-9]+`", line)]
    out = {}
    for row in rows:
        first, second = row.split(" | ")[:2]
        fields = re.findall(r"`([^`]+)`", first)
        defaults = re.findall(r"`([^`]*)`", second.split(" (")[0])
        for i, field in enumerate(fields):
            out[field] = defaults[i] if len(defaults) == len(fields) else defaults[0]
    return out


def shown_as(value: object) -> set[str]:
    """How docs/config.md may write a default."""
    if isinstance(value, str):
        return {value, f'"{value}"'} if value else {'""'}
    return {str(value)}


def test_config_docs_document_every_field_and_no_stale_one():
    fields, documented = config_fields(default_config()), documented_fields()
    assert not set(fields) - set(documented), f"undocumented config fields: {sorted(set(fields) - set(documented))}"
    assert not set(documented) - set(fields), (
        f"docs/config.md names fields that do not exist: {sorted(set(documented) - set(fields))}"
    )


def test_config_docs_give_each_fields_default():
    fields, documented = config_fields(default_config()), documented_fields()
    wrong = []
    for field, text in documented.items():
        value = fields[field]
        if "data." in text:  # a default linked to another field (passes.fuse_from_max)
            continue
        if isinstance(value, float) and not isinstance(value, bool):
            matches = float(text) == value
        else:
            matches = text in shown_as(value)
        if not matches:
            wrong.append(f"{field}: docs say {text!r}, default_config() has {value!r}")
    assert not wrong, "; ".join(wrong)


def test_docs_name_only_test_files_that_exist():
    named = set()
    docs = [os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")]
    for doc in ["README.md", *docs]:
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            named |= {(doc, path) for path in re.findall(r"tests/test_\w+\.py", f.read())}
    missing = sorted(f"{doc}: {path}" for doc, path in named if not os.path.exists(os.path.join(ROOT, path)))
    assert not missing, f"docs name test files that do not exist: {missing}"


# The files the project keeps at its root; anything else there (a shell fragment's stray output, a
# scratch file) is an accident that a commit would carry to every clone (issue #58).
ROOT_FILES = {".gitignore", "DEVELOPING.md", "README.md", "pyproject.toml"}


def root_files_a_commit_would_carry() -> set[str]:
    """The plain files at the repository root that git tracks or would add (not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode("utf-8", "surrogateescape")
    return {path for path in listed.split("\0") if path and "/" not in path}


def test_the_root_holds_only_the_projects_own_files():
    stray = sorted(root_files_a_commit_would_carry() - ROOT_FILES)
    assert not stray, (
        f"files at the repository root that are not the project's: {stray}; remove them (or name a new one in ROOT_FILES)"
    )
