"""Depth stability at a long sequence (docs/results.md, `experiments/depth_stability.py`): a very
narrow model trained at 1024 tokens on the S3 word problem with {1, 2} passes or with the
paper's 3% of 3-pass batches, three seeds each, so that up to 1000 feedback passes can be run
before the states become the exact recurrence (pass T).

    fbt-sweep run configs/sweeps/depth_1024.py --parallel=2
"""


def get_sweep():
    return {
        "base": "../tiny.py",  # relative to this file
        "overrides": {
            "data.seq_len": 1024,
            "model.embed_dim": 32,
            "model.num_heads": 2,
            "model.num_kv_heads": 1,
            "model.mlp_dim": 128,
            "train.batch_size": 4,
            "train.steps": 200,
            "train.log_every": 50,
            "optimizer.warmup_steps": 20,
            "checkpoint.every_steps": 50,
            "eval.every_steps": 50,
            "eval.batch_size": 4,
            "eval.num_batches": 1,
            "eval.contraction_every_steps": 50,
        },
        "grid": {
            "passes.schedule": {
                "k12": "0:1; 0.75:2",  # {1, 2} only
                "paper": "0:1; 0.75:2=0.88,3=0.12",  # with 3% of 3-pass batches
            },
        },
        "seeds": [0, 1, 2],
    }
