"""Instruction tuning end to end: a tiny Llama imported from Hugging Face files, chat data rendered by a
ChatML-style template with generation blocks whose turn markers the tokenizer lacks (refused in one line,
then added by fbt-train-tokenizer --from, the model's vocabulary grown by init_from), tuned from the
imported weights with latent feedback on the replies; killed after its first checkpoint, the run resumes
to the uninterrupted run's losses and state."""

import os
import signal
import subprocess

import pytest
from conftest import ROOT, assert_same_state, cpu_env, losses, run_command, start_command, wait_for

N = 8  # checkpoint interval
STEPS = 10 * N  # steps are fast: the run must still be going when the (asynchronous) save of step N commits
# The ChatML template shipped for tuning (generation blocks around each reply and its <|im_end|>).
TEMPLATE_FILE = os.path.join(ROOT, "configs", "chat_templates", "chatml.jinja")
TEMPLATE = open(TEMPLATE_FILE, encoding="utf-8").read()
MARKERS = "<|im_start|>,<|im_end|>"


@pytest.fixture(scope="module")
def tuning(tmp_path_factory):
    """The import, the prepared chat data, and the tuning command (its workdir appended by each test)."""
    tmp = tmp_path_factory.mktemp("tuning")
    env = cpu_env()
    imported = str(tmp / "llama")
    run_command(["fbt-import", os.path.join(ROOT, "tests/interop/reference/llama"), imported], env, check=True)
    template = TEMPLATE_FILE
    data = str(tmp / "chat-data")
    prepare = ["fbt-prepare", f"--input={ROOT}/tests/chat/sample.jsonl", f"--output={data}", "--seq-len=64",
               "--format=chat", "--validation-fraction=0"]  # fmt: skip
    refused = run_command([*prepare, f"--tokenizer={imported}/tokenizer", f"--chat-template={template}"], env)
    assert refused.returncode != 0 and not os.path.exists(data)
    assert (
        f"the chat template writes {', '.join(sorted(MARKERS.split(',')))}, which the tokenizer has no token"
        in (refused.stderr.strip().splitlines()[-1])
    )
    tokenizer = str(tmp / "chat-tokenizer")
    added = run_command(["fbt-train-tokenizer", f"--from={imported}/tokenizer", f"--add-special-tokens={MARKERS}",
                         f"--chat-template={template}", f"--output={tokenizer}"], env, check=True)  # fmt: skip
    assert "added <|im_start|>, <|im_end|>" in added.stdout and "--config.model.vocab_size=130" in added.stdout
    run_command([*prepare, f"--tokenizer={tokenizer}"], env, check=True)  # the template is the tokenizer's now
    command = ["fbt-train", f"--config=configs/upcycle.py:{imported}", f"--config.data.path={data}",
               f"--config.data.tokenizer={tokenizer}", "--config.data.seq_len=64", "--config.model.vocab_size=130", f"--config.train.steps={STEPS}", "--config.train.batch_size=8",
               "--config.train.log_every=1", "--config.optimizer.warmup_steps=4", f"--config.checkpoint.every_steps={N}",
               "--config.eval.num_batches=0", "--config.eval.contraction_passes=0"]  # fmt: skip
    uninterrupted = str(tmp / "uninterrupted")
    out = run_command([*command, f"--config.workdir={uninterrupted}"], env, check=True)
    assert "initialised parameters from" in out.stdout + out.stderr
    assert "init_from: 2 new token rows, each the mean of the 128 saved ones" in out.stdout + out.stderr
    return command, uninterrupted


@pytest.mark.slow
def test_a_killed_tuning_run_resumes_bitwise(tmp_path, tuning):
    command, uninterrupted = tuning
    workdir = str(tmp_path / "killed")
    command = [*command, f"--config.workdir={workdir}"]
    proc = start_command(command, cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: os.path.exists(os.path.join(workdir, "checkpoints", str(N), "commit_success.txt")))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert max(losses(workdir)) < STEPS, "the run finished before it could be killed"
    resumed = run_command(command, cpu_env())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    start = int(resumed.stdout.split(f"resuming from checkpoint {workdir}/checkpoints/")[1].split()[0])
    expected, got = losses(uninterrupted), losses(workdir)
    assert N <= start < STEPS and [got[s] for s in range(start + 1, STEPS + 1)] == [
        expected[s] for s in range(start + 1, STEPS + 1)
    ]
    assert_same_state(f"{uninterrupted}/checkpoints/{STEPS}", f"{workdir}/checkpoints/{STEPS}")


@pytest.mark.slow
def test_the_harness_reads_a_tuned_run_through_the_template_it_was_tuned_with(tuning):
    """lm-evaluation-harness's apply_chat_template on the fbt backend (model_args chat=True): the render of
    the template the run's data was prepared with (--chat-template), its ids as training read them, and
    generations that stop at the template's end-of-turn and leave it out of the text."""
    import types

    from fbt_jax.data.chat import ChatTemplate
    from fbt_jax.errors import ConfigError
    from fbt_jax.evals.harness import FBTLM

    _, run = tuning
    lm = FBTLM(checkpoint=run, mode="soft", chat="True", progress=False)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    template = ChatTemplate(TEMPLATE, lm.tokenizer)
    text = lm.apply_chat_template(messages)
    assert text == template.render(messages, add_generation_prompt=True)[0] and lm.chat_template(True) == TEMPLATE
    assert lm.tok_encode(text) == template.encode(messages)
    request = types.SimpleNamespace(args=(text, {"until": [], "max_gen_toks": 8}), task_name="t", doc_id=0, idx=0)
    (out,) = lm.generate_until([request])
    assert "<|end_of_text|>" not in out and "<|im_end|>" not in out
    assert lm.stop_ids == (lm.tokenizer.eos_id, *lm.tokenizer.encode_plain("<|im_end|>"))
    with pytest.raises(ConfigError, match="only with model_args chat=True"):
        FBTLM(checkpoint=run, mode="soft", progress=False).apply_chat_template(messages)
