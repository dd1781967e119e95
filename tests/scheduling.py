"""How the suite is shared between pytest-xdist's workers (one per core), so that both stay busy
to the end: `--dist loadgroup --no-loadscope-reorder` (pyproject.toml) with a group per test file
(a file's module fixtures, e.g. the trained runs its tests share, are made once, as with
`--dist loadfile`), except where a file lets its tests go to any worker, and the groups sent out
longest first (the longest-processing-time rule: a long group started last would leave the other
core idle while it runs).

- A file whose tests share no module fixture sets `XDIST_SPLIT = True`: each test is its own group.
- A test may name its own group (`@pytest.mark.xdist_group("name")`): tests of one name run in
  one worker, in file order (test_docs.py's chains of commands that build on each other).
- SECONDS holds what each long group took on 2 cores (measured with `--durations=0`; a rough
  figure is enough: it only orders the groups). Groups it does not name come after, in file order.
"""

from __future__ import annotations

import pytest

# Groups that take long, with their seconds on 2 cores: the longest start first.
SECONDS: dict[str, float] = {}


def group_of(item: pytest.Item) -> str:
    """The xdist group of a test: its own mark, else its test's id in a split file, else its file."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    file = item.nodeid.split("::")[0].removeprefix("tests/")
    if getattr(item.module, "XDIST_SPLIT", False):
        return f"{file}::{item.name}"
    return file


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks into the test ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first_seen: dict[str, int] = {}
    for item in items:
        group = group_of(item)
        first_seen.setdefault(group, len(first_seen))
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
        item.stash[GROUP] = group
    # A stable sort: a group's tests keep their order; the long groups come first, longest first.
    items.sort(key=lambda item: (-SECONDS.get(item.stash[GROUP], 0.0), first_seen[item.stash[GROUP]]))


GROUP = pytest.StashKey[str]()
