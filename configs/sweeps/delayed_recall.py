"""Delayed recall out of a plain pass's reach (docs/results.md, `experiments/layer_probes.py`):
predict the token seen 8 positions earlier, with every layer attending to the last 4 positions
only (a sliding window), so that two layers see at most 6 positions back and a plain pass cannot
solve it at all; latent feedback can, by carrying the token from position to position in the
state. Without feedback, with the paper's mixture and with the heavier 50/25/25 one, three seeds
each, on the tiny model at 16 tokens over 16 symbols.

    fbt-sweep run configs/sweeps/delayed_recall.py --parallel=2
"""


def get_sweep():
    return {
        "base": "../tiny.py",  # relative to this file
        "overrides": {
            "data.task": "delayed_recall",
            "data.delay": 8,
            "model.sliding_window": 4,  # query t attends to t-3 … t: reach 3 positions per layer
            "model.vocab_size": 16,
            "train.steps": 2000,
            "train.log_every": 100,
            "checkpoint.every_steps": 500,
            "eval.every_steps": 100,  # 20 evals: the budget check reads the last 20% of the curve
            "eval.num_batches": 4,
        },
        "grid": {
            "passes.schedule": {
                "k1": "0:1",  # no feedback
                "paper": "0:1; 0.75:2=0.88,3=0.12",  # 75/22/3 overall, as in the paper
                "heavy": "0:1; 0.5:2=0.5,3=0.5",  # feedback for half the run: 50/25/25
            },
        },
        "seeds": [0, 1, 2],
    }
