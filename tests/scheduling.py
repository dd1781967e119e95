"""How the suite is shared between pytest-xdist's workers (one per core), so that both stay busy
to the end: groups of tests, each run by one worker in file order (a file's module fixtures, e.g.
the trained runs its tests share, are made once), a group per test file except where a file lets
its tests go to any worker, and the groups sent out longest first (the longest-processing-time
rule: a long group started last would leave the other core idle while it runs).

The groups reach xdist through our own scheduler (`GroupScheduling`, made by conftest's
`pytest_xdist_make_scheduler`), not through xdist's `xdist_group` mark: xdist passes a mark's
group by appending it to the test's id, which pytest 9.2 no longer lets it do, and `--dist
loadgroup` then silently sends every test anywhere (pytest-xdist#1386; measured: a file's module
fixtures made once per worker). Each worker writes the groups it collected to the session's shared
directory; the scheduler, in the controller, reads them once both workers have collected.

- A file whose tests share no module fixture sets `XDIST_SPLIT = True`: each test is its own group.
- A long file whose module fixtures are cheap next to its tests sets `XDIST_PARTS = n`: its tests,
  in file order, make n groups (each worker that takes one makes the fixtures once for it).
- A test may name its own group (`@pytest.mark.xdist_group("name")`): tests of one name run in
  one worker, in file order.
- SECONDS holds what each long group took on 2 cores (measured with `--durations=0`; a rough
  figure is enough: it only orders the groups). Groups it does not name come after, in file order.
"""

from __future__ import annotations

import collections
import json
import os

import pytest
from xdist.scheduler import LoadScopeScheduling

GROUPS_FILE = "xdist-groups.json"  # in $FBT_TEST_SHARED_DIR (tests/conftest.py): test id → group

# Groups that take long, with their seconds on 2 cores (both busy; a fresh clone's .ci/run at
# b30324e, the first run whose groups reached xdist; a file in parts counted per part): the
# longest start first.
SECONDS: dict[str, float] = {
    "test_experiments.py": 355,  # one smoke rung each since 2026-12-07, and after_tuning's smoke (~45 s) added
    "test_bucket.py": 189,
    "test_resume.py::test_elastic_resume_across_process_counts_and_mesh_shapes": 182,  # with test_checkpoint's two-process resume
    "test_harness.py": 160,
    "test_checkpoint.py#1": 139,
    "test_sweep.py": 133,
    "test_docs.py::test_documented_commands_work_as_written[sweeps]": 126,
    "test_docs.py::test_documented_commands_work_as_written[text]": 119,
    "test_attention.py": 117,
    "test_checkpoint.py#2": 94,
    "test_docs.py::test_documented_commands_work_as_written[interop]": 89,
    "test_docs.py::test_documented_commands_work_as_written[tiny]": 87,
    "test_multiprocess.py": 87,
    "test_dry_run.py": 83,
    "test_benchmarks.py::test_benchmark_smoke_run_prints_figures_and_writes_docs[gpu_check]": 74,
    "test_docs.py::test_documented_commands_work_as_written[launchers]": 70,
    "test_train_hooks.py": 66,
    "test_likelihood.py": 61,
    "test_interop.py": 59,
    "test_sharding.py": 57,
    "test_bad_inputs.py#1": 56,
    "test_train_step.py": 56,
    "test_self_train.py::test_a_self_training_run_killed_mid_sampling_and_mid_tuning_resumes_to_the_same_kept_sets_and_weights": 65,  # alone, 2026-12-07
    "test_docs.py::test_documented_commands_work_as_written[self-train]": 40,  # alone, 2026-12-07
    "test_tuning.py": 45,  # measured alone, 2026-12-07 (post-training): placed early, not left for the end
    "test_docs.py::test_documented_commands_work_as_written[chat]": 40,
    "test_docs.py::test_documented_commands_work_as_written[phases]": 39,  # measured alone, 2026-12-07
    "test_benchmarks.py::test_benchmark_smoke_run_prints_figures_and_writes_docs[tuning_cost]": 25,
    "test_docs.py::test_documented_commands_work_as_written[dry-run-tpu]": 55,
    "test_feedback.py": 53,
    "test_launchers.py": 52,
    "test_targets.py": 51,
    "test_bad_inputs.py#2": 48,
    "test_benchmarks.py::test_benchmark_smoke_run_prints_figures_and_writes_docs[sharding_overhead]": 45,
    "test_resume.py::test_sigkill_at_random_moments_resumes_bitwise": 43,
    "test_benchmarks.py::test_benchmark_smoke_run_prints_figures_and_writes_docs[restart_cost]": 43,
    "test_evals.py": 42,
    "test_benchmarks.py::test_benchmark_smoke_run_prints_figures_and_writes_docs[sweep_cost]": 42,
    "test_model.py": 38,
}


def group_of(item: pytest.Item, index: int, count: int) -> str:
    """The xdist group of a test (the `index`-th of its file's `count`): its own mark, else its id
    in a split file, else its part of a file in parts, else its file."""
    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    file = item.nodeid.split("::")[0].removeprefix("tests/")
    if getattr(item.module, "XDIST_SPLIT", False):
        return f"{file}::{item.name}"
    parts = int(getattr(item.module, "XDIST_PARTS", 1))
    return f"{file}#{index * parts // count + 1}" if parts > 1 else file


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    per_file = collections.Counter(item.nodeid.split("::")[0] for item in items)
    index_in_file: collections.Counter = collections.Counter()
    first_seen: dict[str, int] = {}
    for item in items:
        file = item.nodeid.split("::")[0]
        group = group_of(item, index_in_file[file], per_file[file])
        index_in_file[file] += 1
        first_seen.setdefault(group, len(first_seen))
        item.stash[GROUP] = group
    # A stable sort: a group's tests keep their order; the long groups come first, longest first.
    items.sort(key=lambda item: (-SECONDS.get(item.stash[GROUP], 0.0), first_seen[item.stash[GROUP]]))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # for GroupScheduling, in the controller
        path = os.path.join(os.environ["FBT_TEST_SHARED_DIR"], GROUPS_FILE)
        temporary = f"{path}.{os.environ['PYTEST_XDIST_WORKER']}"
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump({item.nodeid: item.stash[GROUP] for item in items}, f)
        os.replace(temporary, path)  # both workers write the same map; a reader sees one whole


GROUP = pytest.StashKey[str]()


class GroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduling (a scope goes to one worker whole, scopes in collection order, which
    is longest group first) with our groups as the scopes."""

    groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self.groups is None:  # both workers have collected (and written) by the first call
            path = os.path.join(os.environ["FBT_TEST_SHARED_DIR"], GROUPS_FILE)
            with open(path, encoding="utf-8") as f:
                self.groups = json.load(f)
        # An id may carry xdist's own "@group" suffix (pytest before 9.2, a test with its own mark).
        group = self.groups.get(nodeid) or self.groups.get(nodeid.rpartition("@")[0])
        if group is None:
            raise RuntimeError(f"tests/scheduling.py: no group for {nodeid!r} in {GROUPS_FILE}")
        return group


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> LoadScopeScheduling | None:
    """Our groups for `--dist loadgroup` (pyproject.toml's); any other --dist is xdist's own."""
    if config.getvalue("dist") != "loadgroup":
        return None
    config.option.loadscopereorder = False  # keep the collection's order: longest group first
    return GroupScheduling(config, log)
