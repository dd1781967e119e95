"""Instruction tuning end to end: a tiny Llama imported from Hugging Face files, chat data rendered by a
template with generation blocks, tuned from the imported weights (init_from) with latent feedback on the
replies; killed after its first checkpoint, the run resumes to the uninterrupted run's losses and state."""

import os
import signal
import subprocess

import pytest
from conftest import ROOT, assert_same_state, cpu_env, losses, run_command, start_command, wait_for

N = 8  # checkpoint interval; the runs go to 2N
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
               "--config.data.seq_len=64", f"--config.train.steps={2 * N}", "--config.train.batch_size=8",
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
    assert max(losses(workdir)) < 2 * N, "the run finished before it could be killed"
    resumed = run_command(command, cpu_env())
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resuming from checkpoint {workdir}/checkpoints/{N} (step {N})" in resumed.stdout
    expected, got = losses(uninterrupted), losses(workdir)
    assert [got[s] for s in range(N + 1, 2 * N + 1)] == [expected[s] for s in range(N + 1, 2 * N + 1)]
    assert_same_state(f"{uninterrupted}/checkpoints/{2 * N}", f"{workdir}/checkpoints/{2 * N}")
