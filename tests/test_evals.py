"""Generative evaluation: scoring against references, task files, the scoring path with sandboxed
programs, generations against the model's own forward passes, and fbt-eval --tasks end to end
(8 devices = 1 device, killed and resumed = uninterrupted, bad input as one line)."""

import itertools
import json
import os
import signal

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ROOT, cpu_env, last_line, run_command, start_command, wait_for

from fbt_jax.errors import ConfigError
from fbt_jax.evals import runner
from fbt_jax.evals.scoring import bootstrap, extract, pass_at_k, same_answer, wilson
from fbt_jax.evals.spec import load_spec, read_problems

EXAMPLES = os.path.join(ROOT, "tests", "evals")


def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_include_a_correct_one():
    for n in range(1, 7):
        for c in range(n + 1):
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))  # samples 0..c-1 are the correct ones
                assert pass_at_k(n, c, k) == pytest.approx(np.mean([min(s) < c for s in subsets]))
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_intervals_are_wilsons_and_a_seeded_bootstrap():
    assert wilson(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)  # the textbook 8/10 interval
    assert wilson(0, 20)[0] == 0.0 and 0.15 < wilson(0, 20)[1] < 0.17
    values = np.random.default_rng(0).random(200)
    low, high = bootstrap(values, seed=3)
    assert low < values.mean() < high and (low, high) == bootstrap(values, seed=3)
    assert high - low == pytest.approx(2 * 1.96 * values.std() / np.sqrt(200), rel=0.15)


def test_intervals_contain_their_point_and_are_exact_at_none_and_all(tmp_path):
    """Issue #35, 1: wilson(0, 3)'s lower bound was 5.6e-17 and wilson(10, 10)'s upper bound
    0.9999999999999999, so the plot's error bars were negative and fbt-eval crashed."""
    for n in range(1, 1001):
        assert wilson(0, n)[0] == 0.0 and wilson(n, n)[1] == 1.0, n
        for c in {0, 1, n // 3, n // 2, n - 1, n}:
            low, high = wilson(c, n)
            assert 0.0 <= low <= c / n <= high <= 1.0, (c, n)
    for values in (np.full(7, 1 / 3), np.zeros(5), np.ones(9)):  # equal values: resample means an ulp off
        low, high = bootstrap(values)
        assert low <= values.mean() <= high
    from fbt_jax.evals.report import plot
    from fbt_jax.evals.scoring import summarize

    ends = {"standard": {"a": [False], "b": [False], "c": [False]}, "soft": {"a": [True], "b": [True], "c": [True]}}
    rows = {mode: summarize(correct, [4, 5, 6], (1,)) for mode, correct in ends.items()}
    plot({"tasks": {"exact": rows}}, (1,), str(tmp_path / "scores.png"))  # raised ValueError: negative yerr
    assert (tmp_path / "scores.png").stat().st_size > 0


def test_answers_are_extracted_by_each_rule_and_compared():
    assert extract("12 apples, then 1,234.5 and finally 7.", {"kind": "last_number"}) == "7"
    assert extract("so x = \\boxed{\\frac{1}{2}} or \\boxed{3}", {"kind": "last_boxed"}) == "3"
    assert extract("\\boxed{\\frac{1}{2}} done", {"kind": "last_boxed"}) == "\\frac{1}{2}"
    assert extract("The answer is (B).", {"kind": "regex", "pattern": r"\(([A-D])\)"}) == "B"
    assert extract("work #### 42 ", {"kind": "after_marker", "marker": "####"}) == "42"
    assert extract("no marker", {"kind": "after_marker", "marker": "####"}) is None
    assert same_answer("1,250", "1250", "numeric") and same_answer("12.50", "12.5", "numeric")
    assert not same_answer("12.6", "12.5", "numeric") and not same_answer(None, "1", "exact")
    assert same_answer(" $x + 1$ ", "x  + 1", "exact") and not same_answer("x+1", "x + 1", "exact")


def test_unicode_minus_signs_and_sign_dashes_read_as_a_minus():
    last = {"kind": "last_number"}
    for minus in ("\u2212", "\ufe63", "\uff0d", "\u2012", "\u2013", "\u2014", "\u2010", "\u2011"):
        assert extract(f"The answer is {minus}3.", last) == "-3", repr(minus)
        assert same_answer(f"{minus}3", "-3", "numeric") and not same_answer(f"{minus}3", "3", "numeric")
    assert extract("x = 10\u22123", last) == "-3"  # a minus is a minus, as "10-3" reads in ASCII
    assert extract("pages 3\u20135", last) == "5" and extract("rest\u20147", last) == "7"  # ranges, words
    assert extract("about \u2212.5 left", last) == "-.5" and same_answer("\u22120.5", "-.5", "numeric")


def test_shipped_specs_render_gsm8k_and_mbpp_style_files():
    gsm8k = load_spec("gsm8k")
    problems = read_problems(gsm8k, os.path.join(EXAMPLES, "gsm8k_style.jsonl"))
    assert [p.answer for p in problems] == ["7", "60", "70", "12.5", "3"]
    assert problems[0].prompt.startswith("Question: Ana has 3 boxes")  # the few-shot examples come first
    assert problems[0].prompt.endswith(
        "Question: Tom has 4 apples and buys 3 more. How many apples does he have?\nAnswer:"
    )
    mbpp = load_spec("mbpp")
    problems = read_problems(mbpp, os.path.join(EXAMPLES, "mbpp_style.jsonl"), limit=2)
    assert [p.id for p in problems] == ["1", "2"] and "assert add(1, 2) == 3\n" in problems[0].prompt
    assert problems[0].program == "\0\n\nassert add(1, 2) == 3\nassert add(-1, 1) == 0\n"
    humaneval = load_spec("humaneval")
    assert "check({entry_point})" in humaneval.program_template and load_spec("math").extract["kind"] == "last_boxed"


@pytest.mark.parametrize(
    "lines, spec_change, message",
    [
        (["not json"], {}, "line 1 is not JSON"),
        (['{"question": "q"}'], {}, "has no 'answer' field"),
        (['{"question": "q", "answer": "no marker"}'], {}, "does not match the spec's reference rule"),
        (
            ['{"question": "q", "answer": "#### 1", "id": 1}', '{"question": "r", "answer": "#### 2", "id": 1}'],
            {},
            "id '1' is used twice",
        ),  # fmt: skip
        ([], {}, "holds no problems"),
        (
            ['{"question": "q", "answer": "#### 1"}'],
            {"extract": {"kind": "regex", "pattern": "(unclosed"}},
            "does not compile",
        ),  # fmt: skip
        (['{"question": "q", "answer": "#### 1"}'], {"extraction": {}}, "unknown keys ['extraction']"),
        (['{"question": "q", "answer": "#### 1"}'], {"prompt_template": "{missing}"}, "names 'missing'"),
    ],
)
def test_bad_task_files_and_specs_are_one_line_errors(tmp_path, lines, spec_change, message):
    spec_path = tmp_path / "spec.json"
    spec = json.load(open(os.path.join(ROOT, "fbt_jax", "evals", "specs", "gsm8k.json")))
    spec_path.write_text(json.dumps({**spec, **spec_change}))
    problems = tmp_path / "problems.jsonl"
    problems.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")) as err:
        read_problems(load_spec(str(spec_path)), str(problems))
    assert "\n" not in str(err.value)


def test_the_scoring_path_runs_programs_that_pass_crash_and_time_out_and_extracts_answers():
    from fbt_jax.evals.sandbox import Limits

    mbpp = load_spec("mbpp")
    problem = read_problems(mbpp, os.path.join(EXAMPLES, "mbpp_style.jsonl"), limit=1)[0]
    texts = [
        "def add(a, b):\n    return a + b\n",
        "def add(a, b):\n    raise RuntimeError('crash')\n",
        "def add(a, b):\n    while True:\n        pass\n",
        "def add(a, b):\n    return a - b\n",
        "import os\nos._exit(0)\n",  # leaves before the tests run: not a pass
    ]
    task = runner.Task("mbpp", mbpp, [problem])
    verdicts = runner.score(task, [problem] * len(texts), texts, Limits(timeout_s=2.0, cpu_s=2))
    assert [v["verdict"] for v in verdicts] == ["passed", "failed", "timeout", "failed", "failed"]
    assert "RuntimeError" in verdicts[1]["detail"] and [v["correct"] for v in verdicts] == [1, 0, 0, 0, 0]
    gsm8k = load_spec("gsm8k")
    problems = read_problems(gsm8k, os.path.join(EXAMPLES, "gsm8k_style.jsonl"))[:2]
    verdicts = runner.score(runner.Task("gsm8k", gsm8k, problems), problems, [" 4 + 3 = 7.", " 12 * 5 = 61"], None)
    assert [(v["answer"], v["correct"]) for v in verdicts] == [("7", True), ("61", False)]


@pytest.mark.slow
def test_builtin_answers_are_the_one_pass_forward_in_standard_and_the_recurrence_in_soft(trained_run):
    from fbt_jax.data.tasks import prompt_length
    from fbt_jax.evals.builtin import builtin_problems
    from fbt_jax.evals.generation import Generator, Request
    from fbt_jax.feedback import kpass_forward, sequential_feedback
    from fbt_jax.trained import load_model_at

    model, config, _ = load_model_at(trained_run, log=lambda *_: None)
    problems = builtin_problems("word_problem", config, 24)
    tokens = jnp.asarray([p.prompt_ids + p.forced for p in problems])
    B, T = tokens.shape
    references = {
        "standard": kpass_forward(model, tokens, jnp.ones(B, jnp.int32), 1)[0],
        "soft": sequential_feedback(model, tokens, jnp.full((B,), prompt_length(T), jnp.int32)),
    }
    generator = Generator(model)
    for mode, h_BTD in references.items():
        logits = np.asarray(model.logits(h_BTD[:, -1:])[:, 0])
        answers = generator.generate([Request(p.prompt_ids, 0, p.forced) for p in problems], mode, 1)
        top2 = np.sort(logits, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-4  # rows whose argmax float noise cannot flip
        assert clear.mean() > 0.8
        assert np.array_equal(np.array(answers)[clear, 0], logits.argmax(-1)[clear]), mode


def _eval(workdir, output, *extra, devices=1, start=False):
    argv = ["fbt-eval", f"--checkpoint={workdir}", f"--output={output}", "--tasks=word_problem", *extra]
    if start:
        return start_command(argv, cpu_env(devices))
    return run_command(argv, cpu_env(devices))


SAMPLED = ["--num-problems=48", "--samples=2", "--pass-at=1,2", "--temperature=1.0", "--seed=7", "--batch-size=16"]


def _generations(output):
    lines = [json.loads(line) for line in open(os.path.join(output, "generations.jsonl"))]
    return sorted(lines, key=lambda r: (r["task"], r["id"], r["mode"], r["sample"]))


def _scores(output):
    scores = json.load(open(os.path.join(output, "scores.json")))
    for per_mode in scores["tasks"].values():
        for row in per_mode.values():
            row.pop("tokens_per_s")  # wall time: the only figure a rerun may change
    return scores


@pytest.mark.slow
def test_fbt_eval_tasks_on_8_devices_killed_and_resumed_writes_the_one_device_generations(tmp_path, trained_run):
    reference = str(tmp_path / "one_device")
    result = _eval(trained_run, reference, *SAMPLED)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| word_problem | soft | 48 |" in result.stdout and "soft-standard" in result.stdout
    output = str(tmp_path / "eight_devices")
    proc = _eval(trained_run, output, *SAMPLED, devices=8, start=True)
    path = os.path.join(output, "generations.jsonl")
    wait_for(lambda: os.path.exists(path) and os.path.getsize(path) > 0 or proc.poll() is not None, timeout=120)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with open(path, "a") as f:
        f.write('{"task": "word_problem", "id": "valid')  # a write the kill cut short
    written = len(open(path).read().splitlines()) - 1
    result = _eval(trained_run, output, *SAMPLED, devices=8)
    assert result.returncode == 0, result.stderr[-2000:]
    assert written == 0 or f"{written} of 288 generations already written" in result.stderr
    assert _generations(output) == _generations(reference) and len(_generations(output)) == 288
    assert _scores(output) == _scores(reference)
    scores = json.load(open(os.path.join(reference, "scores.json")))
    soft = scores["tasks"]["word_problem"]["soft"]
    assert 0 <= soft["pass@1"] <= soft["pass@2"] <= 1 and soft["median_tokens"] == 1.0
    with open(os.path.join(reference, "scores.png"), "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # Another evaluation in the same directory is refused, before any decoding.
    result = _eval(trained_run, output, *SAMPLED[:-2], "--seed=8")
    assert result.returncode == 2 and "holds another evaluation (it differs in seed)" in last_line(result.stderr)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tasks=word_problem", "--samples=2", "--pass-at=5", "--temperature=1"], "pass@5 needs at least 5 samples"),
        (["--tasks=word_problem", "--modes=soft,hard"], "--modes='soft,hard'"),
        (["--tasks=word_problem", "--samples=3"], "with greedy decoding repeats one generation"),
        (["--tasks=word_problem", "--max-depth=3"], "--max-depth belong(s) to the depth evaluation"),
        (["--tasks=modular_sum"], "needs a checkpoint trained on it; this run trained on word_problem"),
        (["--tasks=gsm8k@tests/evals/gsm8k_style.jsonl"], "is text, and this run trained on the built-in task"),
        (["--tasks=nonexistent.json"], "is neither a built-in task, a shipped spec"),
    ],
)
def test_fbt_eval_refuses_bad_generative_requests_in_one_line(tmp_path, trained_run, flags, message, capsys):
    from fbt_jax.evals.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([f"--checkpoint={trained_run}", f"--output={tmp_path / 'out'}", *flags])
    assert exit_info.value.code == 2
    assert message in last_line(capsys.readouterr().err)
    assert not os.path.exists(tmp_path / "out" / "generations.jsonl")


def test_a_run_without_feedback_passes_cannot_decode_soft_or_fused():
    from fbt_jax.config import default_config

    config = default_config()
    config.passes.schedule = "0:1"
    with pytest.raises(ConfigError, match="never trained a feedback pass"):
        runner.check_modes(config, 100, ("standard", "soft"))
    runner.check_modes(config, 100, ("standard",))
    config.passes.schedule = "0:1;0.5:2"
    config.train.steps = 100
    runner.check_modes(config, 100, ("soft",))  # K=2 from step 50
    with pytest.raises(ConfigError):
        runner.check_modes(config, 40, ("fused",))  # a checkpoint before the first feedback step
