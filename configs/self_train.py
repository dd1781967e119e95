"""Self-training on a tuned run's own shortest correct answers (docs/post-training.md, "Self-training").

fbt-self-train --config=configs/self_train.py:RUN --config.self_train.tasks=SPEC@TRAIN.jsonl \\
    --config.self_train.held_out=SPEC@HELD_OUT.jsonl [--config.workdir=RUN-self-train]

Each round samples `self_train.samples` answers per training problem from the current weights in
`self_train.mode` at `self_train.temperature`, keeps per problem its shortest correct answer
(`self_train.keep`), and tunes on the kept answers from those weights: a run of its own, with RUN's
model, tokenizer and context and this config's train, optimizer and passes sections (the late
2/3-pass mixture, each reply fused from its first token, as after instruction tuning). Then the
held-out problems are answered greedily in every `self_train.eval_modes`.
"""

import json

import ml_collections
from etils import epath

from fbt_jax.config import default_config


def get_config(run: str = "") -> ml_collections.ConfigDict:
    c = default_config()
    if not run:
        raise ValueError("give the run to start from: --config=configs/self_train.py:RUN (a tuned run's workdir)")
    recorded_path = epath.Path(run) / "config.json"
    if not recorded_path.exists():
        raise ValueError(f"{run} is not a run directory (no config.json); give a trained run's workdir")
    recorded = json.loads(recorded_path.read_text())
    c.model.update(recorded["model"])
    c.hf_config = recorded.get("hf_config", "")
    c.init_from = run
    c.workdir = f"{str(run).rstrip('/')}-self-train"
    c.data.tokenizer = recorded["data"]["tokenizer"]
    c.data.seq_len = recorded["data"]["seq_len"]
    c.data.validation_fraction = 0.0  # the held-out problems measure each round
    c.passes.schedule = "0:2=0.88,3=0.12"
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 10
    c.optimizer.weight_decay = 0.0  # decay would pull tuned weights towards zero, not towards where they were
    c.train.steps = 100  # per round
    c.train.batch_size = 32
    c.train.log_every = 10
    c.checkpoint.every_steps = 50
    c.eval.num_batches = 0
    c.eval.contraction_passes = 0

    c.unlock()
    c.self_train = ml_collections.ConfigDict()
    c.self_train.rounds = 3
    c.self_train.tasks = ""  # the training problems: fbt-eval --tasks specs, SPEC[@PROBLEMS.jsonl], comma-separated
    c.self_train.held_out = ""  # the problems each round is measured on, in the same form
    c.self_train.mode = "soft"  # standard | soft | fused: how the answers are sampled
    c.self_train.samples = 16  # answers per training problem and round
    c.self_train.temperature = 1.0
    c.self_train.top_p = 1.0
    c.self_train.top_k = 0
    c.self_train.keep = "shortest"  # shortest | correct: per problem its shortest correct answer, or every correct one
    c.self_train.chat = True  # prompts as a user turn of the run's chat template; else prompt and completion
    c.self_train.eval_modes = "standard,soft,fused"
    c.self_train.num_problems = 0  # first N training problems per task (0: all)
    c.self_train.held_out_problems = 0  # first N held-out problems per task (0: all)
    c.self_train.batch_size = 64  # sequences per sampling batch
    c.self_train.max_new_tokens = 0  # 0: each task's own
    c.self_train.prefill_passes = 2  # passes of the fused prefill
    c.lock()
    return c
