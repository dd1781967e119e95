"""lm-evaluation-harness in every decoding mode (`evals/harness.py`, `fbt-eval --harness`, the
training hook), on the tiny local tasks under tests/harness: the harness's own API runs them in
the three modes and reports what the backend's numbers give when computed by hand (accuracy from
the continuations' log-probabilities, perplexity from per-token plain forwards over the harness's
windows, generations from `decode.generate`); fbt-eval killed and resumed writes the numbers of
the in-process run; the training hook logged the same figures for its last step; bad input is one
line before any decoding."""

import json
import math
import os
import re
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
    HARNESS_STEPS,
    HARNESS_TASKS,
    ROOT,
    cpu_env,
    last_line,
    optimised_programs,
    read_jsonl,
    run_command,
    start_command,
    wait_for,
)

from fbt_jax import decode
from fbt_jax.errors import ConfigError
from fbt_jax.feedback import kpass_forward

TASKS = ["tiny_mc", "tiny_ppl", "tiny_gen"]


def documents(task: str) -> list[dict]:
    with open(os.path.join(HARNESS_TASKS, f"{task}.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module", autouse=True)
def compiled_as_the_commands_are():
    """This file compares in-process figures with fbt-eval's and the training hook's (word perplexity
    to 1e-4, which programs compiled with most optimisation off miss by 7e-4): its programs compile
    as theirs do."""
    with optimised_programs():
        yield


@pytest.fixture(scope="module")
def evaluated(text_run):
    """{mode: (the harness's results, a backend on the run in that mode)}, through the harness's API
    (soft by name, `model="fbt"`; the others given the backend), from the repository root (the
    tasks' relative data files)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import fbt_jax.evals.harness as harness  # registers "fbt"

    here = os.getcwd()
    os.chdir(ROOT)
    try:
        manager = TaskManager(include_path=HARNESS_TASKS, include_defaults=False)
        by_name = lm_eval.simple_evaluate(model="fbt", model_args=f"checkpoint={text_run},mode=soft", tasks=TASKS,
                                          task_manager=manager, bootstrap_iters=0)  # fmt: skip
        loaded, out = harness.Loaded.read(text_run), {}  # the other modes share one read of the checkpoint
        for mode in decode.MODES:
            lm = harness.FBTLM(mode=mode, loaded=loaded, progress=False)
            results = by_name if mode == "soft" else lm_eval.simple_evaluate(
                model=lm, tasks=TASKS, task_manager=manager, bootstrap_iters=0)  # fmt: skip
            out[mode] = (results, lm)
    finally:
        os.chdir(here)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("mode", decode.MODES)
def test_multiple_choice_accuracy_is_the_one_computed_from_the_backends_loglikelihoods(evaluated, mode):
    from fbt_jax.evals.harness import scored_pairs

    results, lm = evaluated[mode]
    correct, normalised = [], []
    for doc in documents("tiny_mc"):
        totals = np.array([s.total for s in scored_pairs(lm, [(doc["question"], c) for c in doc["choices"]])])
        correct.append(np.argmax(totals) == doc["label"])
        normalised.append(np.argmax(totals / [len(c) for c in doc["choices"]]) == doc["label"])
    row = results["results"]["tiny_mc"]
    assert row["acc,none"] == pytest.approx(np.mean(correct)) and row["acc_norm,none"] == pytest.approx(
        np.mean(normalised)
    )


@pytest.mark.slow
def test_perplexity_is_the_plain_forwards_over_the_harness_windows_in_standard_mode(evaluated):
    results, lm = evaluated["standard"]
    model, length = lm.loaded.model, lm.max_length
    total, words = 0.0, 0
    for doc in documents("tiny_ppl"):
        tokens = lm.encode(doc["text"])
        for start in range(0, len(tokens), length):  # each token predicted once, after all the context that fits
            end = min(start + length, len(tokens))
            inputs = ([lm.prefix_token_id] + tokens)[max(0, end - length) : end]
            (h,) = kpass_forward(model, jnp.array([inputs]), jnp.ones((1,), jnp.int32), 1)
            logp = jax.nn.log_softmax(model.logits(h)[0].astype(jnp.float32))
            targets = tokens[max(0, end - length) : end]
            scored = np.asarray(logp[np.arange(len(targets)), np.array(targets)])
            total += float(scored[len(targets) - (end - start) :].sum())
        words += len(re.split(r"\s+", doc["text"]))
    assert results["results"]["tiny_ppl"]["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", decode.MODES)
def test_generations_are_decode_generate_cut_at_the_stop_strings(evaluated, mode):
    results, lm = evaluated[mode]
    want = []
    for doc in documents("tiny_gen"):
        prompt = lm.encode(doc["prompt"])
        ids, count = decode.generate(lm.loaded.model, jnp.array([prompt]), jnp.array([len(prompt)]), 8, mode,
                                     stop_tokens=(lm.tokenizer.eos_id,))  # fmt: skip
        text = lm.tokenizer.decode(np.asarray(ids[0, : int(count[0])]))
        want.append(min((text.split(s)[0] for s in ("\n", ".")), key=len))
    said = results["results"]["tiny_gen"]["exact_match,none"]
    assert said == pytest.approx(np.mean([w == d["answer"] for w, d in zip(want, documents("tiny_gen"))]))
    generated = [lm.generate_until([_request(d["prompt"])], disable_tqdm=True)[0] for d in documents("tiny_gen")]
    assert generated == want


def _request(prompt: str):
    from lm_eval.api.instance import Instance

    settings = {"until": ["\n", "."], "max_gen_toks": 8, "do_sample": False}
    return Instance("generate_until", {}, (prompt, settings), 0, ("tiny_gen", 0, 1))


@pytest.mark.slow
def test_context_and_continuation_are_split_as_the_harness_expects_and_long_contexts_cut_once(evaluated):
    lm = evaluated["soft"][1]
    assert lm.pair("alpha beta ", "gamma") == (lm.encode("alpha beta"), lm.encode(" gamma"))
    assert lm.pair("", "gamma") == ([lm.prefix_token_id], lm.encode("gamma"))
    said = []
    lm.log, lm.warned = said.append, set()
    long = list(range(3 * lm.max_length))
    assert lm.fit(long, [5, 6]) == (long[-(lm.max_length - 1) :], [5, 6])
    lm.fit(long, [5])
    assert len(said) == 1 and "cut from the left" in said[0]
    with pytest.raises(ConfigError, match="does not fit the model's context"):
        lm.fit([1], list(range(lm.max_length + 1)))


@pytest.mark.slow
def test_requests_a_mode_cannot_serve_are_refused_in_one_line(evaluated):
    lm = evaluated["fused"][1]
    with pytest.raises(ConfigError, match="leaves no room for a prompt"):
        lm.generation_settings({"until": ["\n"], "max_gen_toks": lm.max_length})
    with pytest.raises(ConfigError, match="only with model_args chat=True"):
        lm.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ConfigError, match="empty continuation"):
        lm.fit([1, 2], [])


@pytest.mark.slow
def test_a_subword_tokenizer_splits_context_and_continuation_on_the_whole_texts_ids(evaluated, bpe_tokenizer_json):
    from fbt_jax.data.tokenizers import load_tokenizer

    lm = evaluated["standard"][1]
    lm.tokenizer = load_tokenizer(bpe_tokenizer_json)
    try:
        context, continuation = "def add(a, b):\n    return", " a + b"
        head, tail = lm.pair(context, continuation)
        assert head == lm.encode(context) and head + tail == lm.encode(context + continuation)
        assert lm.tokenizer.decode(head + tail) == context + continuation
    finally:
        lm.tokenizer = lm.loaded.tokenizer


@pytest.mark.slow
def test_the_training_hook_logged_each_mode_once_the_fusion_trained_and_the_harnesss_final_figures(text_run, evaluated):
    records = {r["step"]: r for r in read_jsonl(text_run, "eval.jsonl")}
    first, last = records[HARNESS_STEPS // 2], records[HARNESS_STEPS]
    assert "harness/tiny_mc/acc/standard" in first and "harness/tiny_mc/acc/soft" not in first  # no K>1 step yet
    for mode in decode.MODES:
        row = evaluated[mode][0]["results"]
        assert last[f"harness/tiny_mc/acc/{mode}"] == pytest.approx(row["tiny_mc"]["acc,none"])
        got = last[f"harness/tiny_ppl/word_perplexity/{mode}"]
        assert got == pytest.approx(row["tiny_ppl"]["word_perplexity,none"], rel=1e-4)


@pytest.mark.slow
def test_fbt_eval_harness_killed_and_resumed_writes_the_in_process_numbers(tmp_path, text_run, evaluated):
    output = tmp_path / "harness"
    argv = ["fbt-eval", f"--checkpoint={text_run}", f"--harness={','.join(TASKS)}",
            f"--harness-include={HARNESS_TASKS}", f"--output={output}"]  # fmt: skip
    process = start_command(argv, cpu_env(1))
    wait_for(lambda: (output / "cache" / "soft_rank0.db").exists() or process.poll() is not None, timeout=300)
    assert process.poll() is None, process.communicate()[1][-2000:]  # killed in soft mode, standard's done
    process.send_signal(signal.SIGKILL)
    process.wait()
    result = run_command(argv, cpu_env(1))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| tiny_mc | soft | acc |" in result.stdout
    table = json.loads((output / "harness.json").read_text())
    for mode in decode.MODES:
        row = evaluated[mode][0]["results"]
        cells = table["tasks"]
        assert cells["tiny_mc"][mode]["acc"] == pytest.approx(row["tiny_mc"]["acc,none"])
        assert cells["tiny_gen"][mode]["exact_match"] == pytest.approx(row["tiny_gen"]["exact_match,none"])
        assert cells["tiny_ppl"][mode]["word_perplexity"] == pytest.approx(row["tiny_ppl"]["word_perplexity,none"],
                                                                           rel=1e-4)  # fmt: skip
    soft = table["paired"]["tiny_mc"]["soft-standard"]["acc"]
    assert soft["difference"] == pytest.approx(cells["tiny_mc"]["soft"]["acc"] - cells["tiny_mc"]["standard"]["acc"])
    assert soft["ci"][0] <= soft["difference"] <= soft["ci"][1] and soft["documents"] == len(documents("tiny_mc"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--harness=nonesuch"], "task 'nonesuch' is not one of the harness's tasks"),
        (["--harness=tiny_mc", "--samples=2"], "--samples do(es) not apply to --harness"),
        (["--harness=tiny_mc", "--modes=standard,sideways"], "--modes='standard,sideways': use some of"),
    ],
)
def test_fbt_eval_harness_refuses_bad_input_in_one_line(tmp_path, text_run, capsys, flags, message):
    argv = [f"--checkpoint={text_run}", f"--harness-include={HARNESS_TASKS}", f"--output={tmp_path}/o"]
    code, stderr = fbt_eval(argv + flags, capsys)
    assert code == 2 and message in last_line(stderr), stderr[-1500:]
    assert len(stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_task_whose_data_is_not_here_is_named_with_the_file_it_wanted(tmp_path, text_run, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative data files are read from the working directory
    argv = [
        f"--checkpoint={text_run}",
        "--harness=tiny_mc",
        f"--harness-include={HARNESS_TASKS}",
        f"--output={tmp_path}/o",
    ]
    code, stderr = fbt_eval(argv, capsys)
    line = last_line(stderr)
    assert code != 0 and "task 'tiny_mc': its data is not on this machine" in line, stderr
    assert "tests/harness/tiny_mc.jsonl" in line and str(tmp_path) in line


@pytest.mark.slow
def test_soft_or_fused_on_a_run_whose_fusion_never_trained_is_refused(evaluated):
    from fbt_jax.evals.harness import FBTLM, Loaded

    loaded = evaluated["standard"][1].loaded
    plain = loaded.config.copy_and_resolve_references()
    plain.passes.schedule = "0:1"
    unfused = Loaded(loaded.model, plain, HARNESS_STEPS, loaded.tokenizer, loaded.generator)
    FBTLM(mode="standard", loaded=unfused)
    for mode in ("soft", "fused"):
        with pytest.raises(ConfigError, match="never trained a feedback pass"):
            FBTLM(mode=mode, loaded=unfused)


@pytest.mark.slow
def test_a_standard_task_runs_on_a_local_copy_of_its_data_as_docs_evaluation_md_says(tmp_path, text_run):
    """docs/evaluation.md's recipe: a YAML that includes the harness's hellaswag.yaml and reads two
    made-up documents in HellaSwag's own fields from a local file (its process_docs still runs)."""
    import lm_eval

    endings = [["adds oil to the pan.", "eats the stove.", "sings to a fish.", "flies away."],
               ["runs down the road.", "bakes the road.", "reads a shoe.", "swims in sand."]]  # fmt: skip
    with open(tmp_path / "validation.jsonl", "w", encoding="utf-8") as f:
        for i, (context, ending) in enumerate([("A man puts a pan on the stove.", endings[0]),
                                               ("A woman ties her shoes.", endings[1])]):  # fmt: skip
            f.write(json.dumps({"ind": i, "activity_label": "Cooking", "ctx_a": context, "ctx_b": "then",
                                "ctx": context, "endings": ending, "source_id": str(i), "split": "val",
                                "split_type": "indomain", "label": "0"}) + "\n")  # fmt: skip
    harness_tasks = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "hellaswag_local.yaml").write_text(
        f"task: hellaswag_local\ninclude: {harness_tasks}/hellaswag/hellaswag.yaml\ndataset_path: json\n"
        f"dataset_name: null\ndataset_kwargs:\n  data_files:\n    validation: {tmp_path}/validation.jsonl\n"
        "training_split: null\n"
    )
    argv = ["fbt-eval", f"--checkpoint={text_run}", "--harness=hellaswag_local", f"--harness-include={tmp_path}/tasks",
            "--modes=standard,soft", f"--output={tmp_path}/out"]  # fmt: skip
    result = run_command(argv, cpu_env(1), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    table = json.loads((tmp_path / "out" / "harness.json").read_text())
    assert table["tasks"]["hellaswag_local"]["soft"]["documents"] == 2


def fbt_eval(argv: list[str], capsys) -> tuple[int, str]:
    """`fbt-eval` in this process: (exit code, stderr)."""
    from fbt_jax.evals.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)
    return stopped.value.code, capsys.readouterr().err


def task_yaml(directory, name: str, base: str, replace: dict[str, str]) -> None:
    """A copy of tests/harness/`base`.yaml as task `name` in `directory`, its data read from here."""
    with open(os.path.join(HARNESS_TASKS, f"{base}.yaml"), encoding="utf-8") as f:
        text = f.read().replace(f"task: {base}", f"task: {name}")
    text = text.replace(f"tests/harness/{base}.jsonl", os.path.join(HARNESS_TASKS, f"{base}.jsonl"))
    for old, new in replace.items():
        text = text.replace(old, new)
    (directory / f"{name}.yaml").write_text(text)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--harness="], "--harness names no task"),  # was: the depth evaluation ran instead
        (["--harness=,"], "--harness names no task"),  # was: a traceback after eval.json was written
        (["--harness=tiny_mc", "--modes=standard,sideways"], "--modes='standard,sideways': use some of"),
        (["--harness=tiny_long_gen"], "task 'tiny_long_gen' generates up to 40 tokens (its max_gen_toks)"),
        (["--harness=tiny_mc", "--limit=-1"], "--num-fewshot and --limit must be >= 0"),
        (["--tasks=nonesuch_task"], "task 'nonesuch_task' is neither a built-in task"),
        (["--tasks=gsm8k@/nonexistent/gsm8k.jsonl"], "/nonexistent/gsm8k.jsonl"),
    ],
)
def test_fbt_eval_refuses_what_it_can_check_before_making_its_output_or_reading_the_checkpoint(
    tmp_path, text_run, capsys, flags, message
):
    task_yaml(tmp_path, "tiny_long_gen", "tiny_gen", {"max_gen_toks: 8": "max_gen_toks: 40"})  # the context is 32
    output = tmp_path / "out"
    code, stderr = fbt_eval([f"--checkpoint={text_run}", f"--harness-include={tmp_path}", f"--output={output}",
                             *flags], capsys)  # fmt: skip
    assert code == 2 and message in stderr and stderr.count("\n") == 1, stderr
    assert not output.exists() and "loaded" not in stderr


@pytest.mark.slow
def test_fbt_eval_harness_without_the_harness_installed_is_one_line(tmp_path, text_run, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError, as where it is absent
    code, stderr = fbt_eval([f"--checkpoint={text_run}", "--harness=tiny_mc", f"--output={tmp_path}/o"], capsys)
    assert code == 2 and stderr.count("\n") == 1, stderr
    assert "fbt-eval --harness needs lm-evaluation-harness, which is not installed here: pip install" in stderr


@pytest.mark.slow
def test_unknown_model_args_are_refused_not_ignored(text_run):
    from fbt_jax.evals.harness import FBTLM

    options = {"batch_size": None, "max_batch_size": None, "device": None}  # what simple_evaluate adds
    with pytest.raises(ConfigError, match="unknown model_args 'mdoe' for the fbt backend"):
        FBTLM.create_from_arg_string(f"checkpoint={text_run},mdoe=soft", {k: v for k, v in options.items() if v})
    with pytest.raises(ConfigError, match="unknown model_args 'mdoe'"):
        import lm_eval

        lm_eval.simple_evaluate(model="fbt", model_args=f"checkpoint={text_run},mdoe=soft", tasks=["tiny_mc"])


@pytest.mark.slow
def test_a_refusal_while_building_requests_leaves_no_evaluation_behind(tmp_path, text_run, capsys, monkeypatch):
    (tmp_path / "tasks").mkdir()
    task_yaml(tmp_path / "tasks", "tiny_long_mc", "tiny_mc", {'doc_to_choice: "{{choices}}"': (
        'doc_to_choice: "{{[choices[0] * 20, choices[1], choices[2]]}}"')})  # fmt: skip
    monkeypatch.setattr("fbt_jax.evals.harness_run.divert_library_noise", lambda path: None)  # this process's logging
    code, stderr = fbt_eval([f"--checkpoint={text_run}", "--harness=tiny_long_mc", f"--harness-include={tmp_path}/tasks",
                             "--modes=standard", f"--output={tmp_path}/out"], capsys)  # fmt: skip
    assert code == 2 and "does not fit the model's context" in last_line(stderr), stderr
    assert not (tmp_path / "out").exists()  # no eval.json or cache/ to refuse the corrected command


@pytest.mark.slow
def test_local_completions_against_fbt_serve_scores_as_the_in_process_backend(evaluated):
    """lm-evaluation-harness's own `local-completions` model (the OpenAI completions API, tokenized by
    the server's /tokenize) against fbt-serve on the run: each multiple-choice loglikelihood and
    greedy flag equals the in-process backend's in standard mode (echo + logprobs score the prompt
    with one plain pass, as that backend does)."""
    import lm_eval
    import lm_eval.models.openai_completions  # noqa: F401  (registers local-completions)
    from conftest import running
    from lm_eval.tasks import TaskManager

    from fbt_jax.serve.api import Served, create_app
    from fbt_jax.serve.pool import Pool
    from fbt_jax.serve.text import Codec

    results, lm = evaluated["standard"]
    loaded = lm.loaded
    pool = Pool(loaded.model, 2, 64, buckets=(64,))
    pool.compile()
    codec = Codec(type("Data", (), {"source": "text", "tokenizer": loaded.tokenizer})())
    served = Served("text", pool, codec, loaded.model.cfg.vocab_size)
    here = os.getcwd()
    os.chdir(ROOT)
    try:
        with running(create_app(served)) as url:
            args = f"base_url={url}/v1/completions,model=text,tokenizer_backend=remote,max_retries=1"
            manager = TaskManager(include_path=HARNESS_TASKS, include_defaults=False)
            served_results = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=["tiny_mc"],
                                                     task_manager=manager, bootstrap_iters=0)  # fmt: skip
    finally:
        os.chdir(here)
    by_doc = lambda r: {(s["doc_id"], i): resp[0] for s in r["samples"]["tiny_mc"] for i, resp in enumerate(s["resps"])}
    want, got = by_doc(results), by_doc(served_results)
    assert want.keys() == got.keys() and len(want) > 8
    for key, (loglikelihood, greedy) in want.items():
        assert got[key][0] == pytest.approx(loglikelihood, abs=1e-4) and got[key][1] == greedy, key
    assert served_results["results"]["tiny_mc"]["acc,none"] == results["results"]["tiny_mc"]["acc,none"]
