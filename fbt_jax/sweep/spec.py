"""A sweep spec, and the runs it expands to.

A spec is a Python file with `get_sweep()` returning a dict (config fields are dotted names):

    base       the run config file every run starts from (relative to the spec file)
    overrides  {field: value} applied to every run
    grid       {field: [values]} or {field: {label: value}}: every combination is a run
    runs       optional [{field: value, "name": label}]: crossed with the grid
    seeds      optional [seeds]: shorthand for a `seed` axis of the grid

A run's name is made of its labels in spec order ("schedule=k12,seed=1"), so names are stable
across reruns and readable in tables; it names the run's directory and files, so a label holds
no path separator. `Run.config` is the full, validated run config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import json
import os
import re
from typing import Any

import ml_collections

from fbt_jax.errors import ConfigError
from fbt_jax.validation import validate_config

SPEC_FIELDS = ("name", "base", "overrides", "grid", "runs", "seeds")
# What a spec may give where a list belongs. Not a string (taken character by character), nor a
# set (its order, and so the runs' order and the sweep's digest, may change between processes).
SEQUENCES = (list, tuple, range)
# A run's name is one file name (runs/<name>/, jobs/<name>.json, logs/<name>.attempts): 255 bytes
# on every common file system, less the longest suffix the sweep adds to it.
MAX_RUN_NAME_BYTES = 255 - len(".attempts")


@dataclasses.dataclass(frozen=True)
class Run:
    name: str
    overrides: dict[str, Any]  # the fields this run sets beyond the base and the common overrides
    labels: dict[str, str]  # axis → label, for names and tables
    config: ml_collections.ConfigDict


@dataclasses.dataclass(frozen=True)
class Sweep:
    name: str
    spec_path: str
    runs: list[Run]
    digest: str  # of every run's full config: a sweep directory belongs to one spec


def load_python(path: str, function: str, what: str) -> Any:
    """`function()` of the Python file at `path`; ConfigError naming `what` if it cannot be loaded."""
    if not os.path.isfile(path):
        raise ConfigError(
            f"{what} {path} does not exist; give the path of a Python file, e.g. configs/sweeps/tiny_mixtures.py"
        )
    spec = importlib.util.spec_from_file_location(f"fbt_{what.replace(' ', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise ConfigError(f"{what} {path} does not load ({type(err).__name__}: {err})") from None
    if not hasattr(module, function):
        raise ConfigError(f"{what} {path} defines no {function}(); add one that returns the {what}")
    try:
        return getattr(module, function)()
    except Exception as err:
        raise ConfigError(f"{what} {path}: {function}() failed ({type(err).__name__}: {err})") from None


def load_sweep(path: str, extra_overrides: dict[str, Any] | None = None) -> Sweep:
    """Expand and validate the sweep spec at `path` (every run's config is validated);
    `extra_overrides` apply to every run after the spec's own (fbt-sweep --override)."""
    path = os.path.abspath(path)
    spec = load_python(path, "get_sweep", "sweep spec")
    if not isinstance(spec, dict):
        raise ConfigError(f"sweep spec {path}: get_sweep() must return a dict, not {type(spec).__name__}")
    unknown = set(spec.keys()) - set(SPEC_FIELDS)
    if unknown:
        raise ConfigError(f"sweep spec {path}: unknown field(s) {sorted(unknown)}; a spec has {', '.join(SPEC_FIELDS)}")
    check_shapes(spec, path)  # before any field is iterated
    name = spec.get("name") or os.path.splitext(os.path.basename(path))[0]
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ConfigError(f"sweep name {name!r} may hold only letters, digits, '_', '.' and '-'")
    if name.startswith("."):  # "." and ".." would put the sweep in runs/sweeps/ or runs/ itself
        raise ConfigError(f"sweep name {name!r} may not start with '.'; give the spec a name such as \"my_sweep\"")
    base_path = os.path.normpath(os.path.join(os.path.dirname(path), spec["base"]))
    axes = _axes(spec, path)
    listed = []
    for i, entry in enumerate(spec.get("runs", None) or [{}]):
        fields = dict(entry)
        run_label = fields.pop("name", f"run{i}")
        check_label(run_label, f"runs[{i}]: run name", path)
        listed.append((run_label, fields))
    runs: list[Run] = []
    for (run_label, fields), combination in itertools.product(listed, itertools.product(*[v for _, v in axes])):
        labels = {"run": run_label} if spec.get("runs") else {}
        overrides = dict(fields)
        clash = sorted(set(fields) & {field for field, _ in axes})
        if clash:
            raise ConfigError(
                f"sweep spec {path}: run {run_label!r} sets {clash}, which the grid sweeps; set it in one place"
            )
        for (field, _), (label, value) in zip(axes, combination):
            labels[field.split(".")[-1]] = label
            overrides[field] = value
        run_name = ",".join(f"{axis}={label}" for axis, label in labels.items())
        if len(run_name.encode()) > MAX_RUN_NAME_BYTES:
            raise ConfigError(
                f"sweep spec {path}: run {run_name[:40] + '...'!r} has a name of {len(run_name.encode())} bytes, "
                f"and a file name holds at most {MAX_RUN_NAME_BYTES} here; give its values shorter labels "
                "(a grid field as {label: value}, a listed run a shorter name)"
            )
        config = load_python(base_path, "get_config", "run config")
        for field, value in {**dict(spec.get("overrides", {}) or {}), **overrides, **(extra_overrides or {})}.items():
            _set(config, field, value, path)
        try:
            validate_config(config)
        except ConfigError as err:
            raise ConfigError(f"sweep run {run_name}: {err}") from None
        runs.append(Run(run_name, overrides, labels, config))
    names = [r.name for r in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(
            f"sweep spec {path}: run names {duplicates} occur twice; give each listed run or value its own label"
        )
    return Sweep(name, path, runs, digest([(r.name, json.loads(r.config.to_json_best_effort())) for r in runs]))


def digest(configs: list[tuple[str, dict[str, Any]]]) -> str:
    """The digest of a sweep: every run's name and full config (as JSON)."""
    text = json.dumps([[name, config] for name, config in configs], sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def parse_override(text: str) -> tuple[str, Any]:
    """`FIELD=VALUE` from the command line; VALUE is read as JSON when it parses (numbers, true,
    lists), else taken as a string."""
    field, sep, value = text.partition("=")
    if not sep or not field:
        raise ConfigError(f"--override={text!r} is not FIELD=VALUE; e.g. --override=train.steps=100")
    try:
        return field, json.loads(value)
    except ValueError:
        return field, value


def _axes(spec: dict[str, Any], path: str) -> list[tuple[str, list[tuple[str, Any]]]]:
    """The grid as [(field, [(label, value), ...]), ...], seeds last."""
    grid = dict(spec.get("grid", {}) or {})
    if spec.get("seeds"):
        grid["seed"] = list(spec["seeds"])
    if not grid and not spec.get("runs"):
        raise ConfigError(f"sweep spec {path} has an empty grid and no runs; give grid values or a list of runs")
    axes = []
    for field, values in grid.items():
        items = list(values.items()) if isinstance(values, dict) else [(_label(v), v) for v in values]
        for label, _ in items if isinstance(values, dict) else ():
            check_label(label, f"grid field {field!r}: label", path)
        if not items:
            raise ConfigError(f"sweep spec {path}: grid field {field!r} has no values; give at least one")
        axes.append((field, items))
    return axes


def check_shapes(spec: dict[str, Any], path: str) -> None:
    """ConfigError naming the first spec field whose shape is not the one the spec takes (module
    docstring, docs/sweeps.md), with what it must be and an example."""
    where = f"sweep spec {path}"
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise ConfigError(f'{where}: "name" must be a string, not {_shown(spec["name"])}; e.g. "name": "my_sweep"')
    if "base" not in spec:
        raise ConfigError(
            f'{where} has no "base"; give the run config every run starts from, e.g. "base": "../tiny.py"'
        )
    if not isinstance(spec["base"], str) or not spec["base"]:
        raise ConfigError(
            f'{where}: "base" must be the path of the run config file, relative to the spec, '
            f'not {_shown(spec["base"])}; e.g. "base": "../tiny.py"'
        )
    for field, shape, example in (
        ("overrides", "a dict {field: value}", '"overrides": {"train.steps": 2000}'),
        ("grid", "a dict {field: [values]} or {field: {label: value}}", '"grid": {"optimizer.learning_rate": [0.001]}'),
    ):
        given = spec.get(field)
        if given is not None and not isinstance(given, dict):
            raise ConfigError(f'{where}: "{field}" must be {shape}, not {_shown(given)}; e.g. {example}')
        _check_field_names(given or {}, field, where)
    grid = spec.get("grid")
    for field, values in (grid or {}).items():
        if not isinstance(values, (*SEQUENCES, dict)):
            raise ConfigError(
                f"{where}: grid field {field!r} must be a list of values or a dict {{label: value}}, "
                f"not {_shown(values)}; e.g. {json.dumps(field)}: [{_shown(values, 40, typed=False)}]"
            )
    seeds = spec.get("seeds")
    wrong_seed = _first_wrong(seeds, lambda seed: isinstance(seed, int) and not isinstance(seed, bool), "seeds")
    if wrong_seed:
        raise ConfigError(f'{where}: "seeds" must be a list of integers, {wrong_seed}; e.g. "seeds": [0, 1, 2]')
    runs = spec.get("runs")
    wrong_run = _first_wrong(runs, lambda run: isinstance(run, dict), "runs")
    if wrong_run:
        raise ConfigError(
            f'{where}: "runs" must be a list of dicts {{"name": label, field: value, ...}}, {wrong_run}; '
            'e.g. "runs": [{"name": "wide", "model.embed_dim": 128}, {"name": "base"}]'
        )
    for i, run in enumerate(runs or ()):
        if "name" in run and not isinstance(run["name"], str):
            raise ConfigError(
                f"{where}: runs[{i}]: its name must be a string, not {_shown(run['name'])}; "
                f'e.g. "name": {json.dumps(str(run["name"]))}'
            )
        _check_field_names(run, f"runs[{i}]", where)


def check_label(label: Any, what: str, path: str) -> None:
    """ConfigError unless `label` can be part of a run's name, which is one directory name."""
    if not isinstance(label, str):
        raise ConfigError(f"sweep spec {path}: {what} {label!r} must be a string, e.g. {str(label)!r}")
    if not label:
        raise ConfigError(f"sweep spec {path}: {what} '' is empty; give it a name")
    for char in label:
        if char in "/\\":  # a path separator (on POSIX, or on Windows for a copied sweep)
            raise ConfigError(
                f"sweep spec {path}: {what} {label!r} holds {char!r}, and a run's name is one directory "
                f"name; use letters, digits and '_.+-', e.g. {_label(label)!r}"
            )
        if ord(char) < 0x20 or char == "\x7f":  # NUL cannot be in a file name; the others break logs and tables
            raise ConfigError(f"sweep spec {path}: {what} {label!r} holds a control character ({char!r}); remove it")


def _check_field_names(fields: dict[Any, Any], what: str, where: str) -> None:
    for field in fields:
        if not isinstance(field, str):
            raise ConfigError(
                f"{where}: {what} field {field!r} must be a config field's dotted name (a string), "
                'e.g. "optimizer.learning_rate"'
            )


def _first_wrong(values: Any, right: Any, what: str) -> str:
    """How `values` (None: not given) is not a list of items for which `right` holds; "" if it is."""
    if values is None:
        return ""
    if not isinstance(values, SEQUENCES):
        return f"not {_shown(values)}"
    for i, item in enumerate(values):
        if not right(item):
            return f"and {what}[{i}] is {_shown(item)}"
    return ""


def _shown(value: Any, limit: int = 60, typed: bool = True) -> str:
    """`value` for a message: its repr, cut at `limit` characters, with its type."""
    text = repr(value) if len(repr(value)) <= limit else repr(value)[: limit - 3] + "..."
    return f"{text} ({type(value).__name__})" if typed else text


def _label(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", text).strip("_")[:40] or "empty"


def _set(config: ml_collections.ConfigDict, field: str, value: Any, path: str) -> None:
    *sections, key = field.split(".")
    node = config
    for section in sections:
        if section not in node or not isinstance(node[section], ml_collections.ConfigDict):
            raise ConfigError(f"sweep spec {path}: unknown config field {field!r}")
        node = node[section]
    if key not in node or isinstance(node[key], ml_collections.ConfigDict):
        raise ConfigError(f"sweep spec {path}: unknown config field {field!r}")
    current = node[key]
    if isinstance(current, tuple) and isinstance(value, list):
        value = tuple(value)
    try:
        node[key] = value
    except TypeError as err:
        raise ConfigError(f"sweep spec {path}: {field}={value!r} has the wrong type ({err})") from None
