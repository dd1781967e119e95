"""Built-in offline data: the group word problem (state tracking), generated from an index.

Tokens are group elements g_0 … g_{T-1}; the target at position t is the prefix product
g_0 ∘ g_1 ∘ … ∘ g_t (permutations composed as functions, (a ∘ b)(i) = a(b(i))). Solving it needs
a running state that every position updates, which is where latent feedback should matter most.

Batches are step-indexed: example i of split s is a pure function of (seed, s, i), and the batch at
step n holds examples n·B … n·B + B − 1. Restarts and any number of hosts therefore see the same
data with no iterator state. Train and validation use different split keys.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from fbt_jax.errors import ConfigError

SPLITS = {"train": 0, "validation": 1}


@functools.cache
def group_elements(group: str) -> tuple[tuple[int, ...], ...]:
    """Elements of a permutation group as tuples; index 0 is the identity.

    Supported: "S<n>" (symmetric), "A<n>" (alternating, even permutations), "Z<n>" (cyclic).
    """
    kind, n_text = group[:1].upper(), group[1:]
    if kind not in "SAZ" or not n_text.isdigit() or not 2 <= int(n_text) <= 7:
        raise ConfigError(f"data.group={group!r} is unknown; use S<n>, A<n> or Z<n> with 2 <= n <= 7, e.g. 'S5'")
    n = int(n_text)
    if kind == "Z":
        return tuple(tuple((i + shift) % n for i in range(n)) for shift in range(n))
    perms = sorted(itertools.permutations(range(n)))
    if kind == "A":
        perms = [p for p in perms if _is_even(p)]
    return tuple(perms)


def _is_even(perm: tuple[int, ...]) -> bool:
    inversions = sum(1 for i in range(len(perm)) for j in range(i + 1, len(perm)) if perm[i] > perm[j])
    return inversions % 2 == 0


@functools.cache
def composition_table(group: str) -> np.ndarray:
    """table[a, b] = index of a ∘ b."""
    elements = group_elements(group)
    index = {p: i for i, p in enumerate(elements)}
    return np.array([[index[tuple(a[b[i]] for i in range(len(a)))] for b in elements] for a in elements], np.int32)


@dataclasses.dataclass(frozen=True)
class WordProblem:
    group: str
    seq_len: int
    seed: int

    @property
    def vocab_size(self) -> int:
        return len(group_elements(self.group))

    def examples(self, split: str, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The examples with the given global indices, as int32 arrays (len(indices), seq_len)."""
        split_key = SPLITS[split]
        inputs = np.stack(
            [
                np.random.default_rng([self.seed, split_key, int(i)]).integers(0, self.vocab_size, self.seq_len)
                for i in indices
            ]
        ).astype(np.int32)
        table = composition_table(self.group)
        targets = np.empty_like(inputs)
        running = inputs[:, 0]
        targets[:, 0] = running
        for t in range(1, self.seq_len):
            running = table[running, inputs[:, t]]
            targets[:, t] = running
        return {"inputs": inputs, "targets": targets, "weights": np.ones(inputs.shape, np.float32)}

    def batch(self, split: str, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """The global batch for `step` (examples step·B … step·B + B − 1 of `split`)."""
        return self.examples(split, np.arange(step * batch_size, (step + 1) * batch_size))


def make_task(config) -> WordProblem:
    """The data source named by `config.data` (validated)."""
    data = config.data
    if data.task != "word_problem":
        raise ConfigError(f"data.task={data.task!r} is unknown; the built-in task is 'word_problem'")
    if data.seq_len < 2:
        raise ConfigError(f"data.seq_len={data.seq_len} is too short; use at least 2 tokens")
    group_elements(data.group)  # validates the name
    return WordProblem(group=data.group, seq_len=data.seq_len, seed=config.seed)
