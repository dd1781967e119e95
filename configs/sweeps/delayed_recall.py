"""Delayed recall (docs/results.md, `experiments/layer_probes.py`): predict the token seen 4
positions earlier, without feedback and with the paper's mixture, three seeds each, on the tiny
model at 16 tokens over 16 symbols.

    fbt-sweep run configs/sweeps/delayed_recall.py --parallel=2
"""


def get_sweep():
    return {
        "base": "../tiny.py",  # relative to this file
        "overrides": {
            "data.task": "delayed_recall",
            "model.vocab_size": 16,
            "train.steps": 2000,
            "train.log_every": 100,
            "checkpoint.every_steps": 500,
            "eval.every_steps": 500,
            "eval.num_batches": 4,
        },
        "grid": {
            "passes.schedule": {
                "k1": "0:1",  # no feedback
                "paper": "0:1; 0.75:2=0.88,3=0.12",  # 75/22/3 overall, as in the paper
            },
        },
        "seeds": [0, 1, 2],
    }
