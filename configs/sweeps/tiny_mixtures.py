"""Pass mixtures on the tiny S3 word problem: K = 1 only, {1, 2}, the paper's 75/22/3 and a
heavier feedback mixture, two seeds each. The four mixtures agree (K = 1) for the first half,
three of them for three quarters, so fbt-sweep trains those steps once per seed.

    fbt-sweep run configs/sweeps/tiny_mixtures.py && fbt-sweep report
"""


def get_sweep():
    return {
        "base": "../tiny.py",  # relative to this file
        "overrides": {
            "train.steps": 2000,
            "train.log_every": 100,
            "checkpoint.every_steps": 500,
            "eval.every_steps": 250,
            "eval.num_batches": 2,
        },
        "grid": {
            "passes.schedule": {
                "k1": "0:1",  # no feedback
                "k12": "0:1; 0.75:2",  # 75% one pass, 25% two passes
                "paper": "0:1; 0.75:2=0.88,3=0.12",  # 75/22/3 overall, as in the paper
                "heavy": "0:1; 0.5:2=0.5,3=0.5",  # half the run with feedback: 50/25/25
            },
        },
        "seeds": [0, 1],
    }
