"""Pass mixtures on the S3 and S5 word problems (docs/results.md, `experiments/state_tracking.py`):
K = 1 only, {1, 2}, the paper's 75/22/3 and a heavier 50/25/25 mixture, three seeds each, on the
tiny model at 16 tokens. S5 (120 elements) is the hard case: no fixed-depth transformer can track
it over long sequences, while feedback passes add sequential depth.

    fbt-sweep run configs/sweeps/state_tracking.py --parallel=2 && fbt-sweep report
"""


def get_sweep():
    return {
        "base": "../tiny.py",  # relative to this file
        "overrides": {
            "train.steps": 2000,
            "train.log_every": 100,
            "checkpoint.every_steps": 500,
            "eval.every_steps": 500,
            "eval.num_batches": 4,
        },
        "runs": [
            {"name": "S3", "data.group": "S3", "model.vocab_size": 6},
            {"name": "S5", "data.group": "S5", "model.vocab_size": 120},
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
