"""Every experiment script of docs/results.md runs end to end in its --smoke mode and writes its
block and plot; docs/results.md has each experiment's markers, and names a command that exists."""

import dataclasses
import json
import os
import re
import shutil

import numpy as np
import pytest
from conftest import ROOT, cpu_env, run_command

EXPERIMENTS = {
    # name: a header cell its table must have
    "state_tracking": "| mixture | mean K | K=1 | K=2 | K=3 | standard | soft | fused |",
    "depth_stability": "rate, passes 4–7",
    "layer_probes": "| task | trained | K=1 (no feedback) | K=2 (one feedback pass) | exact recurrence | chance |",
    "text_efficiency": "| variant | schedule | tokens | mean K | loss K=1 | loss K=2 | loss K=3 |",
    "upcycle_split": "| run | loss K=1 | loss K=2 | loss K=3 | accuracy K=1 | accuracy K=2 |",
    "after_tuning": "| arm | stage | standard accuracy | soft accuracy | fused accuracy |",
}
LADDER_TABLES = {"layer_probes": "| steps | 75/22/3 K=1 |", "depth_stability": "| steps | k12 growth |"}
RESULTS = os.path.join(ROOT, "docs", "results.md")
SUMMARY = ("<!-- begin: experiments/summary.py -->", "<!-- end: experiments/summary.py -->")


def without(text: str, blocks: list[tuple[str, str]]) -> str:
    """`text` with the inside of each (begin, end) block cut out."""
    for begin, end in blocks:
        text = text.split(begin)[0] + begin + end + text.split(end)[1]
    return text


def test_results_md_has_every_experiments_block_and_nothing_else():
    text = open(RESULTS, encoding="utf-8").read()
    named = set(re.findall(r"<!-- begin: experiments/(\w+)\.py -->", text))
    assert named == {*EXPERIMENTS, "summary"}  # summary.py: the table its rows make
    helpers = ("common.py", "budget.py", "summary.py", "tokens_to_match.py", "scales.py")
    scripts = {f[:-3] for f in os.listdir(os.path.join(ROOT, "experiments")) if f.endswith(".py") and f not in helpers}
    assert scripts == set(EXPERIMENTS)
    for name in EXPERIMENTS:
        assert f"python experiments/{name}.py --write-docs docs/results.md" in text
    # A block of a scaled run (`--scale=gpu`) is its experiment's, and the doc names its command.
    for name, variant in re.findall(r"<!-- begin: experiments/(\w+)\.py (--scale=\w+) -->", text):
        assert name in EXPERIMENTS and f"python experiments/{name}.py {variant} --write-docs docs/results.md" in text


def test_a_scaled_run_sizes_every_job_and_writes_only_its_own_block_and_summary_row(tmp_path, monkeypatch):
    """--scale=gpu: the scale's overrides and job count reach fbt-sweep (with the ladder's), and its
    block, plot and summary row sit beside the default scale's, which stay as they were."""
    import argparse
    import sys

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import common
    import scales
    import summary

    gpu = argparse.Namespace(scale="gpu", smoke=False, sweeps_dir=str(tmp_path), write_docs=str(tmp_path / "r.md"))
    calls = []
    monkeypatch.setattr(common, "run_sweep", lambda spec, directory, overrides, parallel: calls.append(
        (directory, overrides, parallel)) or [])  # fmt: skip
    common.state_tracking_runs(gpu, 2.5)
    ((directory, overrides, parallel),) = calls
    assert parallel == scales.SCALES["gpu"].parallel and directory.endswith("state_tracking-x2.5")
    assert (
        "model.embed_dim=256" in overrides and "train.batch_size=128" in overrides and "train.steps=15000" in overrides
    )
    assert scales.variant(gpu) == "--scale=gpu" and scales.variant(argparse.Namespace()) == ""
    assert common.plot_path(gpu, "demo").endswith(os.path.join("results", "demo-gpu.png"))

    cpu_block, gpu_block = (common.docs_block.markers("demo", "experiments", v) for v in ("", "--scale=gpu"))
    text = "\n".join([*cpu_block, *gpu_block]) + "\n"
    text = common.docs_block.replace_block(text, "demo", "GPU rows", "experiments", "--scale=gpu")
    assert text.split(gpu_block[0])[1].split(gpu_block[1])[0].strip() == "GPU rows"
    assert text.split(cpu_block[0])[1].split(cpu_block[1])[0] == "\n"

    row = summary.Row("figures", "rule", held=False, verdict="undecided")
    rows = {
        "state_tracking": row,
        summary.key("state_tracking", "--scale=gpu"): summary.Row("gpu figures", "r", False, "u"),
    }
    lines = summary.table(rows).splitlines()[2:]
    assert lines[0].startswith(f"| {summary.CLAIMS['state_tracking']} | figures |")
    assert lines[1].startswith("| the same, at `--scale=gpu` | gpu figures |")


def test_the_summary_states_each_claim_in_one_sentence_from_its_recorded_effects():
    import sys

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import summary

    ladder = {"6000": [0.299, 0.304, 0.309], "30000": {"mean": 0.322, "std": 0.046, "seeds": 3}}
    rows = {
        "state_tracking": summary.Row(
            "figures",
            "rule",
            False,
            "reproduced",
            criterion="stable over a ladder",
            effect="soft − standard accuracy (75/22/3)",
            effects=ladder,
        ),  # fmt: skip
        "upcycle_split": summary.Row("split − one run -0.0375 ± 0.0086", "rule", False, "undecided at this budget (x)"),
    }
    first, second = summary.sentences(rows)
    assert first.startswith("- **Reproduced**: latent feedback helps on state tracking")
    assert "soft − standard accuracy (75/22/3) +0.322 ± 0.027 (standard error over 3 seeds) at 30000 steps" in first
    assert first.endswith(
        "decided as stable over a ladder. Carried from other code: 6000, 30000 steps (before commits were recorded)."
    )
    assert (
        second.startswith("- **Open**: (fbt-jax's own)") and "-0.0375 ± 0.0086; undecided at this budget (x)." in second
    )


def test_each_rung_records_the_code_it_came_from_and_the_summary_names_rungs_from_other_code(tmp_path):
    """Issue #47: a sweep directory keeps the code versions that trained in it; a rung is tied to one
    commit only where that commit trained all its runs and evaluates them now; summary.json keeps
    each rung's code (a carried rung keeps the one recorded before), and the summary names every rung
    computed by other code as carried."""
    import argparse
    import sys

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import common
    import summary

    now = common.code_version()
    assert re.fullmatch(r"[0-9a-f]{7}(\+edits)?@jax[0-9.]+", now), now
    fresh, begun = str(tmp_path / "fresh"), str(tmp_path / "begun")
    common.stamp_training(fresh, now)
    common.stamp_training(fresh, now)
    assert common.trained_at(fresh) == [now]
    os.makedirs(begun)
    open(os.path.join(begun, "sweep.json"), "w").close()  # a sweep begun before stamps were kept
    common.stamp_training(begun, now)
    assert common.trained_at(begun) == [common.UNKNOWN, now]
    assert common.rows_code([{"trained_at": [now]}] * 3) == now
    assert (
        common.rows_code([{"trained_at": [now]}, {"trained_at": []}])
        == f"trained at {now}, unknown; evaluated at {now}"
    )

    docs = tmp_path / "results.md"
    docs.write_text("\n".join(common.docs_block.markers("summary", "experiments")) + "\n", encoding="utf-8")
    args = argparse.Namespace(write_docs=str(docs), smoke=False)
    effects = {"6000": [0.1, 0.2, 0.3], "15000": [0.2, 0.3, 0.4]}
    said = dict(criterion="stable over a ladder", effect="e", effects=effects)
    first = summary.Row("f", "r", False, "reproduced", **said, commits={"6000": "1234567"})
    summary.record(args, "state_tracking", first)
    climbed = summary.Row("f", "r", False, "reproduced", **said, commits={"15000": now})
    summary.record(args, "state_tracking", climbed)  # measures 15000 again; 6000 is carried
    kept = summary.load_rows(str(docs))["state_tracking"]
    assert kept.commits == {"6000": "1234567", "15000": now}
    (sentence,) = summary.sentences({"state_tracking": kept})
    assert sentence.endswith("Carried from other code: 6000 steps (1234567).")
    all_now = dataclasses.replace(kept, commits={"6000": now, "15000": now})
    assert "Carried" not in summary.sentences({"state_tracking": all_now})[0]
    unrecorded = dataclasses.replace(kept, commits={})
    said = summary.sentences({"state_tracking": unrecorded})[0]
    assert said.endswith("Carried from other code: 6000, 15000 steps (before commits were recorded).")
    assert f"computed by the code of commit {now}" in docs.read_text(encoding="utf-8")


def test_depth_stability_carries_its_long_part_from_the_block_an_earlier_invocation_wrote(tmp_path):
    """--carry-long keeps the T=1024 check, verdict, table and summary figures as written; without
    such a block it stops with one line naming the flag, before anything is measured."""
    import argparse
    import sys

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import depth_stability

    (tmp_path / "results").mkdir()
    shutil.copy(RESULTS, tmp_path / "results.md")
    shutil.copy(os.path.join(ROOT, "docs", "results", "summary.json"), tmp_path / "results" / "summary.json")
    kept = depth_stability.earlier_long(argparse.Namespace(write_docs=str(tmp_path / "results.md")), 1024)
    text = open(RESULTS, encoding="utf-8").read()
    for paragraph in (kept["check"], *kept["verdicts"], *kept["table"]):
        assert f"\n{paragraph}\n" in text
    assert kept["check"].startswith("budget check: ") and "(T=1024" in kept["check"]
    assert kept["verdicts"][0].startswith("verdict (T=1024:") and kept["verdicts"][1].startswith("verdict rule: ")
    assert kept["table"][0].startswith("**Standard-library bytes at T=1024**") and kept["table"][1].startswith(
        "| mixture"
    )
    recorded = json.loads(open(os.path.join(ROOT, "docs", "results", "summary.json"), encoding="utf-8").read())
    assert kept["effects"] == recorded["depth_stability"]["effects"] and kept["figures"].startswith("T=1024, loss")
    (tmp_path / "empty.md").write_text("nothing here\n", encoding="utf-8")
    with pytest.raises(
        SystemExit, match="has no T=1024 part of the depth_stability block to carry; run without --carry-long"
    ):
        depth_stability.earlier_long(argparse.Namespace(write_docs=str(tmp_path / "empty.md")), 1024)


def test_the_probe_ladder_pairs_each_seed_with_itself():
    """layer_probes' two S3 effects per rung: the paper arm's one pass − none, and its one pass − the
    K=1-only model's one pass, seed by seed (t ≥ 8 of 16)."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import layer_probes
    from ml_collections import ConfigDict

    positions = list(range(16))

    def model(schedule, seed, steps, plain, one_pass):
        probe = {"positions": positions, "K1": [0.0] * 8 + [plain] * 8, "K2": [0.0] * 8 + [one_pass] * 8}
        config = ConfigDict({"train": {"steps": steps}})
        return {"label.schedule": schedule, "label.seed": seed, "config": config, "probe": probe}

    ladder = [
        [model("k1", 1, 6000, 0.2, 0.25), model("paper", 0, 6000, 0.1, 0.5), model("paper", 1, 6000, 0.2, 0.4),
         model("k1", 0, 6000, 0.1, 0.3)],
        [model("paper", 0, 15000, 0.1, 0.6), model("paper", 1, 15000, 0.1, 0.7), model("k1", 0, 15000, 0.2, 0.2),
         model("k1", 1, 15000, 0.1, 0.1)],
    ]  # fmt: skip
    effects, sharper = layer_probes.rungs(ladder, 16)
    assert [r.steps for r in effects] == [6000, 15000]
    np.testing.assert_allclose([r.values for r in effects], [[0.4, 0.2], [0.5, 0.6]])
    np.testing.assert_allclose([r.values for r in sharper], [[0.2, 0.15], [0.4, 0.6]])


@pytest.fixture(scope="module")
def smoke_dir(tmp_path_factory):
    """One directory for every smoke run, so that the state-tracking sweep is trained once."""
    directory = tmp_path_factory.mktemp("experiments")
    docs = directory / "docs"
    docs.mkdir()
    shutil.copy(RESULTS, docs / "results.md")
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_experiment_smoke_run_writes_its_block_and_plot(name, smoke_dir):
    results = smoke_dir / "docs" / "results.md"
    before = results.read_text(encoding="utf-8")
    command = ["python", f"experiments/{name}.py", "--smoke", f"--dir={smoke_dir / 'runs' / name}"]
    # As a user runs it: one CPU device (no XLA_FLAGS).
    result = run_command(command + [f"--write-docs={results}"], cpu_env(None), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    after = results.read_text(encoding="utf-8")
    begin, end = f"<!-- begin: experiments/{name}.py -->", f"<!-- end: experiments/{name}.py -->"
    block = after.split(begin)[1].split(end)[0]
    assert "Smoke run" in block and EXPERIMENTS[name] in block
    # No verdict without the check that the runs had settled.
    assert "\nbudget check: " in block and "\nverdict (" in block
    # ... and the verdict rule's line: which criterion held, or why neither did.
    assert "\nverdict rule: " in block
    assert "nan" not in block.lower()
    # This experiment's row of the summary table, from this run; nothing else changed.
    summary = after.split(SUMMARY[0])[1].split(SUMMARY[1])[0]
    recorded = json.loads((smoke_dir / "docs" / "results" / "summary.json").read_text(encoding="utf-8"))[name]
    assert recorded["smoke"] and f"{recorded['figures']} (smoke run)" in summary
    for part in recorded["verdict"].split("; "):  # per task or length ("T=16: …; T=1024: …"): the block's own
        assert part.split(": ", 1)[-1] in block, (part, block)
    assert without(after, [(begin, end), SUMMARY]) == without(before, [(begin, end), SUMMARY])
    assert (smoke_dir / "docs" / "results" / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every rung it computed is tied to the code that trained and evaluated it (issue #47).
    assert set(recorded["commits"]) == set(recorded["effects"]), recorded
    assert all(re.fullmatch(r"[0-9a-f]{7}(\+edits)?@jax[0-9.]+", code) for code in recorded["commits"].values()), (
        recorded
    )
    if name in LADDER_TABLES:  # the probe and T=16 claims are judged over the state-tracking ladder on disk
        table = block.split(LADDER_TABLES[name])[1].split("\n\n")[0]
        rungs = [line.split(" | ")[0].strip("| ") for line in table.strip().splitlines()[2:]]
        assert rungs and rungs == sorted(rungs, key=int), table
    if name == "depth_stability":  # --carry-long keeps the long part just written, measures T=16 again
        long_part = block[block.index("**Standard-library bytes at T=64**") :].split("\n\n")[:2]
        again = run_command(command + ["--carry-long", f"--write-docs={results}"], cpu_env(None), timeout=900)
        assert again.returncode == 0, again.stderr[-3000:]
        carried = results.read_text(encoding="utf-8").split(begin)[1].split(end)[0]
        assert "is carried from the block an earlier invocation wrote" in carried
        assert "\n\n".join(long_part) in carried and "\nverdict (T=64:" in carried


def test_the_budget_check_holds_on_a_settled_curve_and_extrapolates_a_moving_one():
    import sys

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import budget

    def run(name, tau, steps=2000, every=100, seed=0, noise=lambda s: 0.0):
        # accuracy approaching 0.9 exponentially with time constant tau (steps)
        values = {s: 0.9 * (1 - np.exp(-s / tau)) + noise(s) for s in range(every, steps + 1, every)}
        curve = [(s, {"step": s, "accuracy_K1": v}) for s, v in values.items()]
        return {"run": f"{name}-{seed}", "label.schedule": name, "label.seed": seed, "curve": curve}

    rule = budget.Rule("accuracy_K1", tolerance=0.01)
    settled = budget.check([run("fast", 150), run("faster", 100)], [rule])
    assert settled.held and settled.line.startswith("budget check: held") and settled.suggested_steps == 2000
    moving = budget.check([run("fast", 150), run("slow", 1500)], [rule], "S3")
    assert not moving.held and moving.worst["run"].startswith("schedule=slow") and "failed (S3)" in moving.line
    # An arm is judged by its seeds' mean: eval noise that no seed shares is not a trend. Each seed's
    # last eval is off by 0.02 (failing the rule alone), in opposite directions; their mean is settled.
    wobble = [lambda s, sign=sign: sign * 0.02 * (s == 2000) for sign in (1, -1)]
    seeds = [run("noisy", 100, seed=i, noise=wobble[i]) for i in (0, 1)]
    assert not budget.check(seeds[:1], [rule]).held
    assert budget.check(seeds, [rule]).held
    # At the budget the trend names, the slow run's last window changes by less than the tolerance
    # (the exponential's windows shrink by a constant ratio: the geometric extrapolation is exact).
    longer = run("slow", 1500, steps=moving.suggested_steps, every=10)
    assert budget.window_changes(longer, rule)[0] < 0.0105
    assert budget.verdict(moving, "reproduced").startswith("undecided at this budget (the trend points to about")
    assert budget.verdict(settled, "reproduced") == "reproduced"


def test_the_verdict_rule_judges_the_effect_on_synthetic_ladders():
    """Issue #36's rule: a verdict where the compared arms settled, or where the effect is stable
    over a ladder of at least 2.5×, whatever an arm the verdict does not compare still does."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import budget

    def arm(name, tau, seed, steps=6000):
        values = {s: 0.9 * (1 - np.exp(-s / tau)) for s in range(steps // 20, steps + 1, steps // 20)}
        curve = [(s, {"step": s, "accuracy_K1": v}) for s, v in values.items()]
        return {"run": f"{name}-{seed}", "label.schedule": name, "label.seed": seed, "curve": curve}

    rule = budget.Rule("accuracy_K1", tolerance=0.01)
    compared = [arm(name, 300, seed) for name in ("standard", "soft") for seed in range(3)]
    drifting = [arm("k1", 20000, seed) for seed in range(3)]  # the arm the verdict does not compare
    settled, moving = budget.check(compared, [rule]), budget.check(compared + drifting, [rule])
    assert settled.held and not moving.held  # the old rule asked every arm to be flat: never decided

    def rung(steps, mean, noise=0.005):  # three seeds, sample std `noise`
        return budget.Rung(steps, (mean - noise, mean, mean + noise))

    # Settled at one budget: the top rung decides, by sign and two standard errors.
    judged = budget.judge("soft − standard", [rung(6000, 0.3)], settled)
    assert (judged.verdict, judged.criterion) == ("reproduced", "settled") and judged.line.startswith("verdict rule")
    assert budget.judge("gain", [rung(6000, -0.3)], settled).verdict == "the opposite of the paper"
    # A drifting baseline, a stable effect over 6000 → 15000 → 30000 (5×): decided by the ladder.
    ladder = [rung(6000, 0.304), rung(15000, 0.345, noise=0.008), rung(30000, 0.322, noise=0.046)]  # docs/results
    judged = budget.judge("soft − standard", ladder, moving)
    assert (judged.verdict, judged.criterion) == ("reproduced", "stable over a ladder"), judged.line
    assert "6000→30000 steps (5×)" in judged.line
    # The same figures as a block's mean ± std remember them judge alike.
    summaries = [budget.Rung(r.steps, summary=(r.mean, float(np.std(r.values, ddof=1)), 3)) for r in ladder]
    assert budget.judge("soft − standard", summaries, moving) == judged
    # An effect that shrinks rung after rung, or changes sign, or spans less than 2.5×: undecided.
    for rungs, why in [
        ([rung(6000, 0.3), rung(15000, 0.2), rung(30000, 0.1)], "still moves between the top two rungs"),
        ([rung(6000, 0.1), rung(15000, -0.1), rung(30000, 0.1)], "changes sign"),
        ([budget.Rung(n, (0.0, 0.0, 0.0)) for n in (1024, 1536, 2560)], "is zero at a rung"),  # no saving at all
        ([rung(6000, 0.3), rung(12000, 0.3)], "no ladder spanning 2.5× (2×)"),
    ]:
        judged = budget.judge("gain", rungs, moving)
        assert judged.verdict.startswith("undecided at this budget") and judged.criterion == "", judged.line
        assert why in judged.line and "neither criterion held" in judged.line
    # Within the noise of zero at the top: not reproduced where settled, else undecided.
    noise = [rung(6000, 0.01, noise=0.05), rung(15000, 0.005, noise=0.05), rung(30000, 0.008, noise=0.05)]
    assert budget.judge("gain", noise, settled).verdict == "not reproduced"
    judged = budget.judge("gain", noise, moving)
    assert judged.verdict.startswith("undecided") and "within 2 standard errors of zero at the top two" in judged.line
    # A real effect smaller than what the claim needs does not reproduce it.
    assert budget.judge("gain", [rung(6000, 0.01, noise=0.001)], settled, minimum=0.02).verdict == "not reproduced"


def test_a_later_invocation_keeps_the_ladder_rungs_an_earlier_one_wrote(tmp_path):
    """A machine that keeps no runs between sessions climbs a budget ladder one rung per session:
    the rows, checks and verdicts of rungs measured before are carried from the block, exactly."""
    import argparse
    import sys

    sys.path.insert(0, os.path.join(ROOT, "experiments"))
    import common

    block = "\n\n".join(
        [
            "Written by a script: 6000 steps: 49 min of job time.",
            "budget check: failed (6000 steps) - moved 4.78% over the last 20% of 6000 steps.",
            "verdict (the claim): undecided at this budget (the trend points to about 12000 steps)",
            "budget check: failed (16000 steps) - a rung this invocation measures again.",
            "verdict (the claim): not carried",
            "| steps | budget check | verdict |\n|---|---|---|\n| 6000 | failed | undecided |\n"
            "| 16000 | failed | measured again |\n| 160 | failed | not a rung |",
            "| mixture | K=1 | K=2 | K=3 |\n|---|---|---|---|\n| 6000 | 0.5 | 0.6 | 0.7 |",  # a table of another width
        ]
    )
    path = tmp_path / "results.md"
    path.write_text(f"# Results\n\n<!-- begin: experiments/demo.py -->\n{block}\n<!-- end: experiments/demo.py -->\n")
    args = argparse.Namespace(smoke=False, write_docs=str(path))
    (rung,) = common.earlier_rungs(args, "demo", 3, {6000, 16000, 160000}, measured={16000})
    assert rung["steps"] == 6000 and rung["rows"] == [[f"6000{common.EARLIER}", "failed", "undecided"]]
    assert rung["paragraphs"] == block.split("\n\n")[1:3]  # "16000 steps" does not name the 6000-step rung
    assert common.earlier_rungs(argparse.Namespace(smoke=True, write_docs=str(path)), "demo", 3, {6000}, set()) == []
    assert common.earlier_rungs(args, "other", 3, {6000}, set()) == []  # no block of its own: nothing to carry
