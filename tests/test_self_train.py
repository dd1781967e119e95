"""fbt-self-train (issue #61): rounds of sampling a tuned run's answers, keeping per problem its shortest
correct one and tuning on them. The keep rule and the round figures on hand-made samples; the config's
one-line errors; and the loop end to end on a tiny word-level chat model, killed mid-sampling and
mid-tuning, resumed to the uninterrupted run's samples, kept sets, weights and figures."""

import json
import os
import signal
import subprocess

import pytest
from conftest import ROOT, assert_same_state, cpu_env, run_command, start_command, wait_for

from fbt_jax.errors import ConfigError
from fbt_jax.selftrain import loop, rounds

XDIST_SPLIT = True  # the unit tests share nothing with the end-to-end one


def sample(problem, number, tokens, correct, task="t"):
    return {"task": task, "id": problem, "mode": "soft", "sample": number, "text": f"{problem}/{number}",
            "tokens": tokens, "answer": "", "verdict": "", "correct": correct}  # fmt: skip


def test_the_keep_rule_takes_each_problems_shortest_correct_sample_or_every_correct_one():
    samples = [sample("a", 0, 9, True), sample("a", 1, 5, False), sample("a", 2, 7, True), sample("a", 3, 7, True),
               sample("b", 0, 3, False), sample("c", 1, 4, True), sample("c", 0, 4, True)]  # fmt: skip
    shortest = rounds.keep(samples, "shortest")
    assert [(s["id"], s["sample"]) for s in shortest] == [("a", 2), ("c", 0)]  # ties: the lowest sample number
    every = rounds.keep(samples, "correct")
    assert [(s["id"], s["sample"]) for s in every] == [("a", 0), ("a", 2), ("a", 3), ("c", 0), ("c", 1)]
    record = rounds.tuning_record(shortest[0], "add 1 2", chat=True)
    assert record["messages"] == [{"role": "user", "content": "add 1 2"}, {"role": "assistant", "content": "a/2"}]
    assert (record["id"], record["sample"], record["tokens"]) == ("a", 2, 7)
    assert rounds.tuning_record(shortest[0], "add 1 2", chat=False)["completion"] == "a/2"
    figures = rounds.summarize(1, [sample("a", 0, 4, True), sample("b", 0, 6, False)], samples, shortest)
    assert figures["held_out"]["soft"] == {"accuracy": 0.5, "mean_tokens": 5.0, "median_tokens": 5.0, "problems": 2}
    training = figures["training"]
    assert training["kept_fraction"] == 2 / 3 and training["kept_mean_tokens"] == 5.5
    assert training["tokens_sampled"] == 39 and training["correct_fraction"] == 5 / 7


def test_bad_settings_are_one_line_before_anything_loads(tmp_path):
    from conftest import load_config

    config = load_config("tiny")
    config.unlock()
    import ml_collections

    config.init_from = str(tmp_path)
    config.self_train = ml_collections.ConfigDict(dict(
        rounds=1, tasks="word_problem", held_out="x.json", mode="soft", samples=4, temperature=1.0, top_p=1.0,
        top_k=0, keep="shortest", chat=True, eval_modes="standard", num_problems=0, held_out_problems=0,
        batch_size=8, max_new_tokens=0, prefill_passes=2))  # fmt: skip
    with pytest.raises(ConfigError, match="word_problem is a built-in task, answered with one label token"):
        loop.check(config)
    config.self_train.tasks = "gsm8k@nowhere.jsonl"
    config.self_train.keep = "longest"
    with pytest.raises(ConfigError, match="self_train.keep='longest' is not one of shortest, correct"):
        loop.check(config)
    config.self_train.keep = "shortest"
    config.self_train.temperature = 0.0
    with pytest.raises(ConfigError, match="self_train.samples=4 at temperature 0 draws one answer 4 times"):
        loop.check(config)
    config.self_train.temperature = 1.0
    config.self_train.mode = "latent"
    with pytest.raises(ConfigError, match="self_train.mode='latent': use one of standard, soft, fused"):
        loop.check(config)
    config.self_train.mode = "soft"
    with pytest.raises(ConfigError, match="nowhere.jsonl"):
        loop.check(config)
    config.workdir = "gs://bucket/self"
    with pytest.raises(ConfigError, match="needs a local"):
        loop.check(config)
    # A workdir holds one loop: it continues with more rounds, and refuses another config in one line.
    config.workdir = str(tmp_path / "loop")
    os.makedirs(config.workdir)
    loop.claim_workdir(config)
    config.self_train.rounds = 3
    loop.claim_workdir(config)
    config.self_train.keep = "correct"
    with pytest.raises(
        ConfigError, match=r"holds a self-training run of another config \(self_train.keep: 'shortest' -> 'correct'\)"
    ):
        loop.claim_workdir(config)


# --- end to end -------------------------------------------------------------------------------------------


FIXTURES = os.path.join(ROOT, "tests", "self_train")  # written by its make_fixtures.py


@pytest.fixture(scope="module")
def start(tmp_path_factory):
    """A tiny chat run (three K=2 steps on tests/self_train/'s conversations, which add three digits mod
    10): its answers are right by chance about one time in ten, and end at any length up to the
    limit. Returns the fbt-self-train command on it (16 training problems, 4 held-out ones)."""
    run = str(tmp_path_factory.mktemp("self-train") / "adds")
    run_command(["fbt-train", "--config=configs/tiny.py", f"--config.workdir={run}", "--config.data.source=text",
                 f"--config.data.path={FIXTURES}/chat.jsonl", "--config.data.format=chat",
                 f"--config.data.tokenizer={FIXTURES}/tokenizer", "--config.data.seq_len=24",
                 "--config.model.vocab_size=24", "--config.train.steps=3", "--config.passes.schedule=0:2",
                 "--config.optimizer.warmup_steps=1", "--config.eval.num_batches=0", "--config.eval.contraction_passes=0",
                 "--config.data.validation_fraction=0"], cpu_env(), check=True)  # fmt: skip
    task = f"{FIXTURES}/adds.json@{FIXTURES}"
    return ["fbt-self-train", f"--config=configs/self_train.py:{run}", f"--config.self_train.tasks={task}/train.jsonl",
            f"--config.self_train.held_out={task}/held.jsonl", "--config.self_train.num_problems=16",
            "--config.self_train.held_out_problems=4", "--config.self_train.rounds=2", "--config.self_train.samples=8",
            "--config.self_train.batch_size=2", "--config.self_train.eval_modes=standard,soft",
            "--config.passes.schedule=0:2", "--config.train.steps=64", "--config.train.batch_size=8",
            "--config.checkpoint.every_steps=8", "--config.optimizer.warmup_steps=2"]  # fmt: skip


def read(workdir, r, name):
    with open(os.path.join(workdir, f"round-{r}", name), encoding="utf-8") as f:
        return f.read()


@pytest.mark.slow
def test_a_self_training_run_killed_mid_sampling_and_mid_tuning_resumes_to_the_same_kept_sets_and_weights(
    tmp_path, start
):
    whole = str(tmp_path / "whole")
    done = run_command([*start, f"--config.workdir={whole}"], cpu_env())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| round | standard accuracy | soft accuracy |" in done.stdout
    figures = json.loads(open(os.path.join(whole, "rounds.json"), encoding="utf-8").read())
    assert [f["round"] for f in figures] == [0, 1, 2] and all(0 < f["training"]["kept"] for f in figures[1:])
    for r in (1, 2):  # the kept set is each training problem's shortest correct sample
        samples = [json.loads(line) for line in read(whole, r, "samples/shard-0-of-1/generations.jsonl").splitlines()]
        assert len(samples) == 16 * 8 and {s["mode"] for s in samples} == {"soft"}
        kept = [json.loads(line) for line in read(whole, r, "kept.jsonl").splitlines()]
        for record in kept:
            mine = [s for s in samples if s["id"] == record["id"] and s["correct"]]
            assert record["tokens"] == min(s["tokens"] for s in mine)
            assert record["messages"][1]["content"] == next(s["text"] for s in mine if s["sample"] == record["sample"])

    killed = str(tmp_path / "killed")
    command = [*start, f"--config.workdir={killed}"]

    def kill_when(condition):
        proc = start_command(command, cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: condition() or proc.poll() is not None)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    samples_1 = os.path.join(killed, "round-1", "samples", "shard-0-of-1", "generations.jsonl")
    kill_when(lambda: os.path.exists(samples_1) and open(samples_1).read().count("\n") >= 2)
    assert not os.path.exists(os.path.join(killed, "round-1", "kept.jsonl")), "sampling ended before the kill"
    first_save = os.path.join(killed, "round-2", "run", "checkpoints", "8", "commit_success.txt")
    kill_when(lambda: os.path.exists(first_save))
    assert not os.path.exists(os.path.join(killed, "round-2", "tuned.json")), "tuning ended before the kill"
    resumed = run_command(command, cpu_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for r in (1, 2):
        for name in ("samples/shard-0-of-1/generations.jsonl", "kept.jsonl", "held-out/shard-0-of-1/generations.jsonl"):
            assert read(killed, r, name) == read(whole, r, name), (r, name)
    assert_same_state(f"{whole}/round-2/run/checkpoints/64", f"{killed}/round-2/run/checkpoints/64")
    again = json.loads(open(os.path.join(killed, "rounds.json"), encoding="utf-8").read())
    assert [{k: v for k, v in f.items() if k != "seconds"} for f in again] == [
        {k: v for k, v in f.items() if k != "seconds"} for f in figures
    ]
