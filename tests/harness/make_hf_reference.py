"""Writes tests/harness/hf_reference.json: what lm-evaluation-harness's own `hf` backend scores for
REQUESTS on tests/interop/reference/llama (a tiny random Llama that transformers saved, with its
byte-level BPE tokenizer), in float32, one request at a time.

tests/test_harness_reference.py scores the same requests with the fbt backend, in standard mode, on
`fbt-import` of that directory and compares each loglikelihood (and is_greedy) with these; where
torch and transformers are installed it also runs the `hf` backend itself on `fbt-export` of the
imported run. The contexts end in spaces, tabs, newlines and indentation, and some are empty: the
cases where how a backend splits context from continuation changes the tokens it scores.

Needs what the project does not install (torch, transformers, lm-eval's hf backend):

    pip install torch==2.13.0 transformers==5.24.0 lm-eval==0.4.13 accelerate
    python tests/harness/make_hf_reference.py

Last run with Python 3.11.7, torch 2.13.0 (CPU), transformers 5.24.0, lm-eval 0.4.13.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(os.path.dirname(HERE), "interop", "reference", "llama")
OUT = os.path.join(HERE, "hf_reference.json")

CODE = "def add(a, b):\n    "
REQUESTS: list[tuple[str, str]] = [
    ("The market was quiet.", " By noon"),
    ("The market was quiet. ", "By noon"),
    ("The market was quiet.  ", "By noon"),
    ("The market was quiet.\t", "By noon"),
    ("The market was quiet.\n", "By noon"),
    ("The market was quiet.\n\n", "By noon"),
    ("The market was quiet. \n ", "By noon"),
    ("", "The market was quiet."),
    ("", " The market"),
    (CODE, "return a + b"),
    (CODE[:-4], "    return a + b"),
    (CODE.rstrip(), "\n    return a + b"),
    ("def f(x):\n\t", "return x"),
    ("def f(x):\n\t\t", "return x"),
    ("for i in range(3):\n        ", "print(i)"),
    ("one, two, three,", " four"),
    ("one, two, three, ", "four"),
    ("one, two, three,\n", "four"),
    ("She wrote the numbers", " down"),
    ("She wrote the numbers ", "down carefully"),
    ("She wrote the numbers\t", "down"),
    ("apples, pears,", " bread and cheese"),
    ("apples, pears, ", "bread"),
    ("apples, pears,\r\n", "bread"),
    ("a small mistake", " at the start"),
    ("a small mistake   ", "at"),
    ("Rotary position\n", "embeddings"),
    ("Rotary position \t", "embeddings rotate"),
    ("x = 1\n", "y = 2"),
    ("x = 1\n    ", "y = 2"),
    ("if x:\n    ", "pass"),
    ("the weather", "."),
]


def hf_loglikelihoods(model_dir: str, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's `hf` backend on `model_dir`: (loglikelihood, is_greedy) per request."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model_dir, dtype="float32", batch_size=1, device="cpu")
    instances = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(requests)]
    return [(float(total), bool(greedy)) for total, greedy in lm.loglikelihood(instances, disable_tqdm=True)]


def main() -> None:
    import lm_eval
    import torch
    import transformers

    scored = hf_loglikelihoods(MODEL, REQUESTS)
    record = {
        "model": "tests/interop/reference/llama",
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "lm_eval": lm_eval.__version__,
            "python": sys.version.split()[0],
        },  # fmt: skip
        "requests": [
            {"context": c, "continuation": x, "loglikelihood": ll, "is_greedy": g}
            for (c, x), (ll, g) in zip(REQUESTS, scored)
        ],  # fmt: skip
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(REQUESTS)} requests")


if __name__ == "__main__":
    main()
