"""Docs are tests: every shell command in README.md and docs/*.md runs as written.

Commands live in fenced ```sh blocks (other code is ```text or ```python). Each command either
appears in RUNS below, which runs it from the repository root exactly as written (at most a
shortening override appended), or carries a visible `# needs: <what>` marker (a pod, a cluster,
a bucket). A new command that is neither fails `test_every_documented_command_is_run_or_marked`.
"""

import contextlib
import glob
import os
import re
import shutil

import pytest
from conftest import ROOT, cpu_env, run_command, with_warm_commands

DOCS = [
    "README.md",
    "DEVELOPING.md",
    *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))),
]
NEEDS = re.compile(r"#\s*needs:\s*\S")
FENCE = re.compile(r"^```(\S*)\s*$")
CI_COMMAND = 'pip install -e ".[test]" && python -m pytest'  # .ci/run's own command: checked, not rerun
DRY_RUN_K1 = (
    "--config.passes.schedule=0:1 --config.dry_run_chip= --config.eval.num_batches=0 --config.eval.contraction_passes=0"
)

# One round on 8 problems, 8 answers each, 8 tuning steps: docs/post-training.md's self-training, shortened.
SELF_TRAIN_SHORT = (
    "--config.self_train.rounds=1 --config.self_train.num_problems=8 --config.self_train.samples=8 "
    "--config.self_train.held_out_problems=4 --config.self_train.eval_modes=standard,soft --config.train.steps=8 "
    "--config.optimizer.warmup_steps=2"
)

# (chain, doc, command as written, what to append, text the output must contain), in the order a
# reader runs them: later commands of a chain use the runs that earlier ones made (runs/tiny,
# runs/text); chains share nothing, so they run side by side.
RUNS = [
    (
        "tiny",
        "README.md",
        "pip install -e . && fbt-train --config=configs/tiny.py",
        "--config.train.steps=300",
        "trained 300 steps",
    ),
    (
        "tiny",
        "docs/checkpointing.md",
        "fbt-train --config=configs/tiny.py --config.workdir=runs/tiny       # kill it at any moment …",
        "--config.train.steps=345",
        "resuming from checkpoint",
    ),
    (
        "tiny",
        "docs/checkpointing.md",
        "fbt-train --config=configs/tiny.py --config.workdir=runs/tiny       # … and run it again: it resumes",
        "--config.train.steps=360",
        "resuming from checkpoint",
    ),
    (
        "tiny",
        "docs/decoding.md",
        'fbt-decode --checkpoint=runs/tiny --mode=soft --prompt="3 1 4 1 5" --max-new-tokens=8',
        "",
        '"mode": "soft"',
    ),
    # docs/post-training.md: chat data shown, prepared, trained on (one reply per segment, fused from its start).
    (
        "chat",
        "docs/post-training.md",
        "fbt-prepare --input=tests/chat/sample.jsonl --output=runs/chat-data --seq-len=128 --tokenizer=tests/chat/tokenizer --format=chat --show=2",
        "",
        "⟦49 + 97 = 146.<|im_end|>⟧",
    ),
    (
        "chat",
        "docs/post-training.md",
        "fbt-prepare --input=tests/chat/sample.jsonl --output=runs/chat-data --seq-len=128 --tokenizer=tests/chat/tokenizer --format=chat --validation-fraction=0.1",
        "",
        "300 chat records, 400 replies (split)",
    ),
    (
        "chat",
        "docs/post-training.md",
        "fbt-train --config=configs/tiny.py --config.workdir=runs/chat --config.data.source=text --config.data.path=runs/chat-data --config.data.seq_len=128 --config.model.vocab_size=400 --config.optimizer.warmup_steps=4",
        "--config.train.steps=30",
        "trained 30 steps",
    ),
    (
        "chat",
        "docs/post-training.md",
        "fbt-eval --checkpoint=runs/chat --tasks=tests/chat/sums.json --chat --output=runs/chat/eval",
        "--modes=soft --num-problems=4",  # the three modes are served below
        "| sums | soft | 4 |",
    ),
    (
        "chat",
        "docs/post-training.md",
        "fbt-serve --checkpoint=runs/chat --port=8001 > chat-serve.log 2>&1 &   # reads the run and its template, compiles, listens",
        "",
        "",
    ),
    (
        "chat",
        "docs/post-training.md",
        "curl -s --retry 60 --retry-connrefused --retry-delay 1 http://127.0.0.1:8001/v1/models",
        "",
        '"id":"chat:soft"',
    ),
    (
        "chat",
        "docs/post-training.md",
        """curl -s http://127.0.0.1:8001/v1/chat/completions -H "Content-Type: application/json" -d '{"model": "chat:soft", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16, "temperature": 0}'""",
        "",
        '"role":"assistant"',
    ),
    (
        "chat",
        "docs/post-training.md",
        """curl -s http://127.0.0.1:8001/v1/chat/completions -H "Content-Type: application/json" -d '{"model": "chat:fused", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16, "temperature": 0}'""",
        "",
        '"role":"assistant"',
    ),
    (
        "chat",
        "docs/post-training.md",
        """curl -s http://127.0.0.1:8001/v1/chat/completions -H "Content-Type: application/json" -d '{"model": "chat", "messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 16, "temperature": 0}'""",
        "",
        '"role":"assistant"',
    ),
    (
        "chat",
        "docs/post-training.md",
        'pkill -TERM -f "fbt-serve --checkpoint=runs/chat"   # drains, then exits 0',
        "",
        "",
    ),
    # docs/serving.md: the server in the background, queried by curl, drained by SIGTERM.
    (
        "tiny",
        "docs/serving.md",
        "fbt-serve --checkpoint=runs/tiny > serve.log 2>&1 &   # reads the run, compiles, then listens on 127.0.0.1:8000",
        "",
        "",
    ),
    (
        "tiny",
        "docs/serving.md",
        "curl -s --retry 60 --retry-connrefused --retry-delay 1 http://127.0.0.1:8000/v1/models",
        "",
        '"id":"tiny:soft"',
    ),
    (
        "tiny",
        "docs/serving.md",
        """curl -s http://127.0.0.1:8000/v1/completions -H "Content-Type: application/json" -d '{"model": "tiny:soft", "prompt": "3 1 4 1 5", "max_tokens": 8, "temperature": 0}'""",
        "",
        '"finish_reason":"length"',
    ),
    (
        "tiny",
        "docs/serving.md",
        'pkill -TERM -f "fbt-serve --checkpoint=runs/tiny"   # drains: running requests finish, then it exits 0',
        "",
        "",
    ),
    # Passes up to 8 of the default 33 (the trained length + 1), 16 sequences, probes on 128: every
    # part of the report at a fraction of the cost.
    (
        "tiny",
        "docs/decoding.md",
        "fbt-eval --checkpoint=runs/tiny --output=runs/tiny/eval",
        "--max-depth=8 --batch-size=16 --probe-examples=128",
        "wrote ",
    ),
    (
        "tiny",
        "docs/decoding.md",
        "fbt-eval --checkpoint=runs/tiny --tasks=word_problem --output=runs/tiny/generative",
        "",
        "| word_problem | soft | 256 |",
    ),
    (
        "short-runs",
        "docs/operations.md",
        "fbt-train --config=configs/tiny.py --config.workdir=runs/profiled --config.train.steps=100 --config.train.profile_steps=60:62",
        "",
        "profile: trace written to",
    ),
    (
        "short-runs",
        "docs/config.md",
        'fbt-train --config=configs/tiny.py --config.workdir=runs/schedule --config.train.steps=100 --config.passes.schedule="0:1; 0.5:2"',
        "",
        "trained 100 steps",
    ),
    (
        "text",
        "docs/data.md",
        "fbt-train-tokenizer --input=\"$(python -c 'import os; print(os.path.dirname(os.__file__))')/*.py\" "
        "--vocab-size=1024 --output=prepared/stdlib-bpe/tokenizer.json",
        "",
        "1,024 ids",
    ),
    (
        "text",
        "docs/data.md",
        "for i in 0 1; do fbt-prepare --input=\"$(python -c 'import os; print(os.path.dirname(os.__file__))')/*.py\" "
        "--tokenizer=prepared/stdlib-bpe/tokenizer.json --output=prepared/stdlib-128 --seq-len=128 "
        "--validation-fraction=0.1 --workers=2 --num-shards=2 --shard-index=$i; done",
        "",
        "validation records",
    ),
    (
        "text",
        "docs/data.md",
        "fbt-train --config=configs/tiny.py --config.workdir=runs/text --config.data.source=text "
        "--config.data.path=prepared/stdlib-128 --config.data.seq_len=128 --config.model.vocab_size=1024",
        # two train programs (fbt-eval --tasks decodes soft), a quarter of the batch
        "--config.train.steps=60 --config.train.batch_size=8 --config.passes.schedule='0:1;0.9:2'",
        "trained 60 steps",
    ),
    (
        "text",
        "docs/data.md",
        'fbt-decode --checkpoint=runs/text --mode=soft --prompt="import os" --max-new-tokens=24',
        "",
        '"prompt": "import os"',
    ),
    (
        "text",
        "docs/data.md",
        "fbt-eval --checkpoint=runs/text --output=runs/text/eval --max-depth=4 --batch-size=4",
        "",
        "    soft | …",
    ),
    (
        "text",
        "docs/decoding.md",
        "fbt-eval --checkpoint=runs/text --tasks=gsm8k@tests/evals/gsm8k_style.jsonl,mbpp@tests/evals/mbpp_style.jsonl "
        "--max-new-tokens=32 --context-len=512 --output=runs/text/generative",
        "",
        "| mbpp | fused | 4 |",
    ),
    (
        "text",
        "docs/evaluation.md",
        "fbt-eval --checkpoint=runs/text --harness=tiny_mc,tiny_ppl,tiny_gen --harness-include=tests/harness "
        "--output=runs/text/harness",
        "",
        "| tiny_mc | soft | acc |",
    ),
    (
        "launchers",
        "docs/data.md",
        "DRY_RUN=1 SLURM_ARRAY_TASK_ID=0 SLURM_ARRAY_TASK_COUNT=16 bash launch/slurm_prepare.sbatch "
        "--input=corpus/*.jsonl --output=prepared/web --seq-len=2048",
        "",
        "task 0 of 16: fbt-prepare --input=corpus/\\*.jsonl --output=prepared/web --seq-len=2048 --workers=",
    ),
    ("text", "docs/decoding.md", "printf 'import json\\ndef main(\\n' > prompts.txt", "", ""),
    (
        "text",
        "docs/decoding.md",
        "fbt-decode --checkpoint=runs/text --mode=fused --prompts-file=prompts.txt --temperature=0.8 --top-p=0.95 "
        "--output=gen.jsonl",
        "",
        "wrote 2 generations",
    ),
    # The 1B dry runs compile one program instead of six (K=1 only, no memory-fit table) for the 1B
    # model at 2 of its layers: the whole dry run as written is tests/test_dry_run.py's (the two
    # took 70 s + 91 s of this test's 9 min).
    (
        "dry-run-cpu",
        "docs/launch.md",
        "fbt-train --config=configs/fbt_1b.py --config.dry_run=True",
        DRY_RUN_K1 + " --config.model.num_layers=2",
        "dry run complete",
    ),
    # For the slice: the TPU compiler (libtpu, the test extra's), the 1B model at 2 layers and
    # sequences of 256 (one Splash block of 256; 512 compiled in 24.8 s, 256 in 19.4 s), K=1 only, one
    # example per chip: too few to halve, so the memory table needs no second compile (the full dry
    # run is benchmarks/dry_run_memory.py --topology=v5e:8x8's, 13 min).
    (
        "dry-run-tpu",
        "docs/launch.md",
        "fbt-train --config=configs/fbt_1b.py --config.dry_run=True --config.dry_run_topology=v5e:8x8",
        DRY_RUN_K1 + " --config.model.num_layers=2 --config.data.seq_len=256 --config.train.batch_size=64",
        "Mosaic kernel calls",
    ),
    (
        "dry-run-splash",
        "docs/performance.md",
        "fbt-train --config=configs/fbt_1b.py --config.dry_run=True --config.model.attention_impl=splash",
        DRY_RUN_K1 + " --config.model.num_layers=2",
        "attention: splash",
    ),
    (
        "sweeps",
        "docs/sweeps.md",
        "fbt-sweep run configs/sweeps/tiny_mixtures.py",
        "--override=train.steps=60 --override=optimizer.warmup_steps=5 --override=checkpoint.every_steps=20 "
        "--override=eval.every_steps=20 --parallel=2",
        "done; next: fbt-sweep report",
    ),
    ("sweeps", "docs/sweeps.md", "fbt-sweep status", "", "schedule=paper,seed=1"),
    ("sweeps", "docs/sweeps.md", "fbt-sweep report", "", "results.md"),
    (
        "sweeps",
        "docs/sweeps.md",
        'fbt-sweep print configs/sweeps/tiny_mixtures.py --dir=runs/sweeps/tpu --launcher=tpu_pod --launcher-args="my-v5p-128 us-east5-a"',
        "",
        "launch/tpu_pod.sh my-v5p-128 us-east5-a --config=",
    ),
    (
        "launchers",
        "docs/launch.md",
        "launch/local.sh 2 --config=configs/tiny.py --config.workdir=runs/local2",
        "--config.train.steps=60",
        "trained 60 steps",
    ),
    (
        "launchers",
        "docs/launch.md",
        "launch/tpu_pod.sh --dry-run my-v5p-128 us-east5-a --config=configs/fbt_1b.py --config.workdir=gs://bucket/runs/1b",
        "",
        "gcloud compute tpus tpu-vm ssh my-v5p-128",
    ),
    ("launchers", "docs/launch.md", "DRY_RUN=1 bash launch/slurm_gpu.sbatch --config=configs/fbt_1b.py", "", "srun"),
    # docs/post-training.md's self-training: a short chat run, then the loop (one round), run again.
    (
        "self-train",
        "docs/post-training.md",
        "fbt-train --config=configs/tiny.py --config.workdir=runs/adds --config.data.source=text --config.data.path=tests/self_train/chat.jsonl --config.data.format=chat --config.data.tokenizer=tests/self_train/tokenizer --config.data.seq_len=24 --config.model.vocab_size=24 --config.passes.schedule=0:2 --config.train.steps=100 --config.eval.num_batches=0 --config.eval.contraction_passes=0 --config.data.validation_fraction=0",
        "",
        "trained 100 steps",
    ),
    (
        "self-train",
        "docs/post-training.md",
        "fbt-self-train --config=configs/self_train.py:runs/adds --config.self_train.tasks=tests/self_train/adds.json@tests/self_train/train.jsonl --config.self_train.held_out=tests/self_train/adds.json@tests/self_train/held.jsonl   # kill it at any moment …",
        SELF_TRAIN_SHORT,
        "rounds.md and rounds.png",
    ),
    (
        "self-train",
        "docs/post-training.md",
        "fbt-self-train --config=configs/self_train.py:runs/adds --config.self_train.tasks=tests/self_train/adds.json@tests/self_train/train.jsonl --config.self_train.held_out=tests/self_train/adds.json@tests/self_train/held.jsonl   # … and it continues where it stopped",
        SELF_TRAIN_SHORT,
        "| 1 |",
    ),
    # docs/post-training.md: the tiny Llama given ChatML's markers, tuned, then a phase at 4× its context.
    ("phases", "docs/post-training.md", "fbt-import tests/interop/reference/llama runs/llama-base", "", "wrote "),
    (
        "phases",
        "docs/post-training.md",
        "fbt-train-tokenizer --from=runs/llama-base/tokenizer --add-special-tokens='<|im_start|>,<|im_end|>' --chat-template=configs/chat_templates/chatml.jinja --output=runs/llama-chatml",
        "",
        "--config.model.vocab_size=130",
    ),
    (
        "phases",
        "docs/post-training.md",
        "fbt-prepare --input=tests/chat/sample.jsonl --output=runs/llama-chat-data --seq-len=64 --tokenizer=runs/llama-chatml --format=chat",
        "",
        "chat records",
    ),
    (
        "phases",
        "docs/post-training.md",
        "fbt-train --config=configs/upcycle.py:runs/llama-base --config.workdir=runs/llama-chat --config.data.path=runs/llama-chat-data --config.data.tokenizer=runs/llama-chatml --config.data.seq_len=64 --config.model.vocab_size=130",
        "--config.train.steps=4 --config.optimizer.warmup_steps=2 --config.eval.num_batches=1 --config.checkpoint.every_steps=4",
        "init_from: 2 new token rows, each the mean of the 128 saved ones",
    ),
    (
        "phases",
        "docs/post-training.md",
        "fbt-prepare --input=tests/chat/sample.jsonl --output=runs/llama-chat-256 --seq-len=256 --tokenizer=runs/llama-chatml --format=chat",
        "",
        "chat records",
    ),
    (
        "phases",
        "docs/post-training.md",
        "fbt-train --config=configs/upcycle.py:runs/llama-chat --config.workdir=runs/llama-long --config.data.path=runs/llama-chat-256 --config.data.seq_len=256 --config.model.rope_theta=2000000",
        "--config.train.steps=2 --config.optimizer.warmup_steps=1 --config.eval.num_batches=1 --config.checkpoint.every_steps=2",
        "init_from: changed model.rope_theta: 500000.0 → 2000000.0",
    ),
    ("phases", "docs/post-training.md", "fbt-export runs/llama-long runs/llama-long-hf", "", "LlamaForCausalLM"),
    ("interop", "docs/interop.md", "fbt-import tests/interop/reference/llama runs/llama-tiny", "", "wrote "),
    (
        "interop",
        "docs/interop.md",
        "fbt-prepare --input=\"$(python -c 'import os; print(os.path.dirname(os.__file__))')/*.py\" "
        "--tokenizer=runs/llama-tiny/tokenizer --output=prepared/llama-tiny-64 --seq-len=64 --validation-fraction=0.1",
        "",
        "vocab 128",
    ),
    (
        "interop",
        "docs/interop.md",
        "fbt-eval --checkpoint=runs/llama-tiny --data-path=prepared/llama-tiny-64 --output=runs/llama-tiny/eval "
        "--max-depth=4 --batch-size=4",
        "",
        "loss at depth 1 / 4",
    ),
    (
        "interop",
        "docs/interop.md",
        "fbt-train --config=configs/upcycle.py:runs/llama-tiny --config.data.path=prepared/llama-tiny-64   # kill it at any moment …",
        "--config.train.steps=20 --config.optimizer.warmup_steps=5 --config.eval.every_steps=10 --config.eval.num_batches=1",
        "initialised parameters from",
    ),
    (
        "interop",
        "docs/interop.md",
        "fbt-train --config=configs/upcycle.py:runs/llama-tiny --config.data.path=prepared/llama-tiny-64   # … and run it again: it resumes",
        "--config.train.steps=30 --config.optimizer.warmup_steps=5 --config.eval.every_steps=10 --config.eval.num_batches=1",
        "resuming from checkpoint",
    ),
    *(
        (
            "interop",
            "docs/interop.md",
            f'fbt-decode --checkpoint=runs/llama-tiny-feedback --mode={mode} --prompt="import os" --max-new-tokens=16',
            "",
            f'"mode": "{mode}"',
        )
        for mode in ("standard", "soft", "fused")
    ),
    (
        "interop",
        "docs/interop.md",
        "fbt-eval --checkpoint=runs/llama-tiny-feedback --output=runs/llama-tiny-feedback/eval --max-depth=4 --batch-size=4",
        "",
        "    soft | …",
    ),
    (
        "interop",
        "docs/interop.md",
        "fbt-export runs/llama-tiny-feedback runs/llama-tiny-feedback-hf",
        "",
        "LlamaForCausalLM in float32",
    ),
]
# What each chain of commands creates in the checkout (kept aside beforehand, removed afterwards).
CREATED = {
    "tiny": ["runs/tiny", "serve.log"],
    # docs/operations.md's profiled run (left behind, it made a second run of this test resume it)
    "short-runs": ["runs/profiled", "runs/schedule"],
    "text": ["runs/text", "prepared/stdlib-bpe", "prepared/stdlib-128", "prompts.txt", "gen.jsonl"],
    "launchers": ["runs/local2"],
    "sweeps": ["runs/sweeps"],
    "chat": ["runs/chat-data", "runs/chat", "chat-serve.log"],
    "self-train": ["runs/adds", "runs/adds-self-train"],
    "phases": [
        "runs/llama-base",
        "runs/llama-chatml",
        "runs/llama-chat-data",
        "runs/llama-chat",
        "runs/llama-chat-256",
        "runs/llama-long",
        "runs/llama-long-hf",
    ],  # fmt: skip
    "interop": ["runs/llama-tiny", "runs/llama-tiny-feedback", "runs/llama-tiny-feedback-hf", "prepared/llama-tiny-64"],
    "dry-run-cpu": [],
    "dry-run-tpu": [],
    "dry-run-splash": [],
}
# Each chain is a test of its own, so that pytest-xdist's workers share them (tests/scheduling.py).
XDIST_SPLIT = True


def documented_commands():
    """(doc, line number, command) of every line in a ```sh block, continuation lines joined."""
    found = []
    for doc in DOCS:
        language = None
        pending = ""
        for number, line in enumerate(open(os.path.join(ROOT, doc), encoding="utf-8"), start=1):
            line = line.rstrip("\n")
            fence = FENCE.match(line)
            if fence:
                language = None if language is not None else fence.group(1)
                continue
            if language in ("sh", "bash") and line.strip():
                pending += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
                if not line.endswith("\\"):
                    found.append((doc, number, pending.strip()))
                    pending = ""
    return found


def test_code_blocks_are_fenced_and_typed():
    """Commands are findable only if every code block says what it holds."""
    for doc in DOCS:
        lines = open(os.path.join(ROOT, doc), encoding="utf-8").read().split("\n")
        inside = False
        for number, line in enumerate(lines, start=1):
            fence = FENCE.match(line)
            if fence:
                if not inside:
                    assert fence.group(1) in ("sh", "bash", "text", "python"), f"{doc}:{number}: untyped code block"
                inside = not inside
                continue
            indented_code = line.startswith("    ") and number > 1 and not lines[number - 2].strip()
            in_list = line.lstrip().startswith(("-", "*", "|")) or re.match(r"\s*\d+\.", line)
            assert inside or not indented_code or in_list, (
                f"{doc}:{number}: indented code block; fence it with ```sh or ```text"
            )
        assert not inside, f"{doc}: unclosed code block"


def test_every_documented_command_is_run_or_marked():
    registered = {(doc, command) for _, doc, command, _, _ in RUNS}
    for doc, number, command in documented_commands():
        if command == CI_COMMAND:
            assert CI_COMMAND in open(os.path.join(ROOT, ".ci", "run")).read(), (
                ".ci/run must run the README's test command"
            )
            continue
        assert (doc, command) in registered or NEEDS.search(command), (
            f"{doc}:{number}: `{command}` is neither run by tests/test_docs.py (add it to RUNS) nor marked `# needs: ...`"
        )
    documented = {(doc, command) for doc, _, command in documented_commands()}
    stale = registered - documented
    assert not stale, f"RUNS lists commands the docs no longer have: {stale}"


def test_figures_in_docs_come_from_their_scripts():
    """Every block of figures names the benchmark or experiment that writes it, which exists, and
    is filled."""
    for doc in DOCS:
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        for script, variant in re.findall(r"<!-- begin: ((?:benchmarks|experiments)/\S+\.py)( --\S+)? -->", text):
            assert os.path.isfile(os.path.join(ROOT, script)), f"{doc}: {script} does not exist"
            block = text.split(f"<!-- begin: {script}{variant} -->")[1].split(f"<!-- end: {script}{variant} -->")[0]
            assert f"Written by `python {script}{variant}" in block, (  # a variant: the script run with it
                f"{doc}: the block of {script}{variant} is empty; run it with{variant} --write-docs {doc}"
            )


@pytest.fixture
def checkout_outputs(request):
    """Keep aside what a chain of documented commands would overwrite in the checkout, and put it back."""
    created = CREATED[request.param]
    stash = os.path.join(ROOT, "runs", f".docs-test-stash-{os.getpid()}-{request.param}")
    kept = []
    for path in created:
        if os.path.exists(os.path.join(ROOT, path)):
            os.makedirs(os.path.dirname(os.path.join(stash, path)), exist_ok=True)
            shutil.move(os.path.join(ROOT, path), os.path.join(stash, path))
            kept.append(path)
    made_dirs = [d for d in ("runs", "prepared") if not os.path.exists(os.path.join(ROOT, d))]
    yield request.param
    for path in created:
        full = os.path.join(ROOT, path)
        if os.path.isdir(full):
            shutil.rmtree(full)
        elif os.path.exists(full):
            os.remove(full)
    for path in kept:
        shutil.move(os.path.join(stash, path), os.path.join(ROOT, path))
    shutil.rmtree(stash, ignore_errors=True)
    for d in made_dirs:  # another chain may still be writing there: only an empty directory goes
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(ROOT, d))


def test_every_chain_says_what_it_creates():
    assert {chain for chain, *_ in RUNS} == set(CREATED)


@pytest.mark.slow
@pytest.mark.parametrize("checkout_outputs", list(CREATED), indirect=True)
def test_documented_commands_work_as_written(checkout_outputs):
    chain = checkout_outputs
    for doc, command, append, expected in [run[1:] for run in RUNS if run[0] == chain]:
        line = f"{command} {append}".strip() if "#" not in command else command.replace("#", f"{append} #", 1)
        # As a user runs it: one CPU device (no XLA_FLAGS), this environment's commands on PATH (warm:
        # tests/warm_commands.py).
        result = run_command(["bash", "-c", line], with_warm_commands(cpu_env(None)), timeout=900)
        output = result.stdout + result.stderr
        assert result.returncode == 0, f"{doc}: `{line}` failed ({result.returncode}):\n{output[-3000:]}"
        assert expected in output, f"{doc}: `{line}` did not print {expected!r}:\n{output[-3000:]}"
        if (doc, append) == ("README.md", "--config.train.steps=300"):  # its first checkpoint, before any resume
            assert os.path.isfile(os.path.join(ROOT, "runs", "tiny", "checkpoints", "300", "commit_success.txt"))
    if chain == "tiny":
        assert os.path.isfile(os.path.join(ROOT, "runs", "tiny", "eval", "report.json"))


@pytest.mark.slow
def test_first_command_from_another_directory_with_relative_paths(tmp_path):
    """Relative paths are relative to where the command starts, whatever the command does later."""

    def run(*args):
        return run_command(list(args), cpu_env(None), cwd=tmp_path)

    train = [
        "fbt-train",
        f"--config={ROOT}/configs/tiny.py",
        "--config.workdir=rel/tiny",
        "--config.eval.num_batches=1",
    ]
    first = run(*train, "--config.train.steps=60", "--config.checkpoint.every_steps=30")
    assert first.returncode == 0, first.stderr[-2000:]
    assert os.path.isdir(tmp_path / "rel" / "tiny" / "checkpoints" / "30")
    again = run(*train, "--config.train.steps=90", "--config.checkpoint.every_steps=30")
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"{tmp_path}/rel/tiny/checkpoints/60 (step 60)" in again.stdout
    decode = ["fbt-decode", "--checkpoint=rel/tiny", "--prompt=1 2 3", "--max-new-tokens=4", "--output=out/gen.jsonl"]
    missing_dir = run(*decode)
    assert (
        missing_dir.returncode == 2 and "out/gen.jsonl" in missing_dir.stderr and "does not exist" in missing_dir.stderr
    )
    os.makedirs(tmp_path / "out")
    written = run(*decode)
    assert written.returncode == 0 and os.path.isfile(tmp_path / "out" / "gen.jsonl"), written.stderr[-2000:]
