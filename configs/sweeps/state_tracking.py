"""Pass mixtures on the S3 word problem (docs/results.md, `experiments/state_tracking.py`): K = 1
only, {1, 2}, the paper's 75/22/3 and a heavier 50/25/25 mixture, three seeds each, on the tiny
model at 16 tokens, 6000 steps: three times the first version's budget, which left every arm still
improving (the experiment's budget check says whether this one suffices). S5 is not in this sweep:
at 2000 steps no mixture learned it (held-out accuracy at chance in every decoding mode; see
docs/results.md), and a model that could is beyond this CPU's budget for 12 runs.

    fbt-sweep run configs/sweeps/state_tracking.py --parallel=2 && fbt-sweep report
"""


def get_sweep():
    return {
        "base": "../tiny.py",  # relative to this file
        "overrides": {
            "train.steps": 6000,
            "train.log_every": 200,
            "checkpoint.every_steps": 1500,
            "eval.every_steps": 300,  # 20 evals: the budget check reads the last 20% of the curve
            "eval.num_batches": 4,
        },
        "runs": [
            {"name": "S3", "data.group": "S3", "model.vocab_size": 6},
        ],
        "grid": {
            "passes.schedule": {
                "k1": "0:1",  # no feedback
                "k12": "0:1; 0.75:2",  # 75% one pass, 25% two passes
                "paper": "0:1; 0.75:2=0.88,3=0.12",  # 75/22/3 overall, as in the paper
                "heavy": "0:1; 0.5:2=0.5,3=0.5",  # feedback for half the run: 50/25/25
            },
        },
        "seeds": [0, 1, 2],
    }
