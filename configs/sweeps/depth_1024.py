"""Depth stability at a long context (docs/results.md, `experiments/depth_stability.py`): a narrow
byte-level language model trained at 1024 tokens on this Python's standard-library sources, which
it learns within a few hundred steps (the S3 word problem at 1024 tokens it did not learn at all),
with {1, 2} passes, the paper's 3% of 3-pass batches, and the heavier 50/25/25 mixture, three seeds
each; then up to 1000 feedback passes are run before the states become the exact recurrence
(pass T). The prepared corpus is the experiment's (`data.path` is set by it):

    fbt-sweep run configs/sweeps/depth_1024.py --override=data.path=PREPARED_1024 --parallel=2
"""


def get_sweep():
    return {
        "base": "../tiny.py",  # relative to this file
        "overrides": {
            "data.source": "text",
            "data.seq_len": 1024,
            "model.vocab_size": 257,  # the byte tokenizer's 256 bytes + end of document
            "model.embed_dim": 32,
            "model.num_heads": 2,
            "model.num_kv_heads": 1,
            "model.mlp_dim": 128,
            "train.batch_size": 4,
            "train.steps": 900,
            "train.log_every": 50,
            "optimizer.warmup_steps": 30,
            "checkpoint.every_steps": 150,
            "eval.every_steps": 60,  # 15 evals: the budget check reads the last 20% of the curve
            "eval.batch_size": 4,
            "eval.num_batches": 2,
            "eval.contraction_every_steps": 60,
        },
        "grid": {
            "passes.schedule": {
                "k12": "0:1; 0.75:2",  # {1, 2} only
                "paper": "0:1; 0.75:2=0.88,3=0.12",  # with 3% of 3-pass batches
                "heavy": "0:1; 0.5:2=0.5,3=0.5",  # feedback for half the run: 50/25/25
            },
        },
        "seeds": [0, 1, 2],
    }
