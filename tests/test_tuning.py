"""Instruction tuning end to end: a tiny Llama imported from Hugging Face files, chat data rendered by a
template with generation blocks, tuned from the imported weights (init_from) with latent feedback on the
replies; killed after its first checkpoint, the run resumes to the uninterrupted run's losses and state."""

import os
import signal
import subprocess

import pytest
from conftest import ROOT, assert_same_state, cpu_env, losses, run_command, start_command, wait_for

N = 8  # checkpoint interval
STEPS = 10 * N  # steps are fast: the run must still be going when the (asynchronous) save of step N commits
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}Assistant:"
    "{% generation %} {{ m['content'] }}{{ eos_token }}{% endgeneration %}\n"
    "{% else %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tuning(tmp_path_factory):
    """The import, the prepared chat data, and the tuning command (its workdir appended by each test)."""
    tmp = tmp_path_factory.mktemp("tuning")
    env = cpu_env()
    imported = str(tmp / "llama")
    run_command(["fbt-import", os.path.join(ROOT, "tests/interop/reference/llama"), imported], env, check=True)
    template = tmp / "chat.jinja"
    template.write_text(TEMPLATE)
    data = str(tmp / "chat-data")
    run_command(["fbt-prepare", f"--input={ROOT}/tests/chat/sample.jsonl", f"--output={data}", "--seq-len=64",
                 f"--tokenizer={imported}/tokenizer", "--format=chat", f"--chat-template={template}",
                 "--validation-fraction=0"], env, check=True)  # fmt: skip
    command = ["fbt-train", f"--config=configs/upcycle.py:{imported}", f"--config.data.path={data}",
               "--config.data.seq_len=64", f"--config.train.steps={STEPS}", "--config.train.batch_size=8",
               "--config.train.log_every=1", "--config.optimizer.warmup_steps=4", f"--config.checkpoint.every_steps={N}",
               "--config.eval.num_batches=0", "--config.eval.contraction_passes=0"]  # fmt: skip
    uninterrupted = str(tmp / "uninterrupted")
    out = run_command([*command, f"--config.workdir={uninterrupted}"], env, check=True)
    assert "initialised parameters from" in out.stdout + out.stderr
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
    assert lm.tok_encode(text) == template.encode(messages) and lm.stop_ids[-1] == lm.tokenizer.eos_id
    request = types.SimpleNamespace(args=(text, {"until": [], "max_gen_toks": 8}), task_name="t", doc_id=0, idx=0)
    (out,) = lm.generate_until([request])
    assert "<|end_of_text|>" not in out
    with pytest.raises(ConfigError, match="only with model_args chat=True"):
        FBTLM(checkpoint=run, mode="soft", progress=False).apply_chat_template(messages)
