"""Built-in synthetic tasks, generated from the example index (no files).

- `word_problem`: tokens are elements g_0 … g_{T-1} of a permutation group; the target at t is the
  prefix product g_0 ∘ … ∘ g_t ((a ∘ b)(i) = a(b(i))). State tracking: where latent feedback
  should matter most.
- `modular_sum`: tokens in {0 … m−1}; the target at t is (x_0 + … + x_t) mod m (parity for m = 2).
- `delayed_recall`: tokens from an alphabet of `task_vocab_size` symbols; the target at t is the
  token seen `delay` positions earlier (positions t < delay are not scored).

Example i of a split is a pure function of (seed, split, i) (a counter-based hash, vectorised). The splits are disjoint by content:
an example belongs to the split selected by a hash of its tokens, and generation redraws (with the
next attempt number) until the example hashes into its own split, so no validation sequence can
ever appear in training, even for tasks with few distinct sequences.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from fbt_jax.errors import ConfigError

SPLITS = {"train": 0, "validation": 1}
TASKS = ("word_problem", "modular_sum", "delayed_recall")


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


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fast, well-mixed bijection on uint64 (vectorised)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def split_of(tokens_BT: np.ndarray) -> np.ndarray:
    """The split (0 train, 1 validation) of each row, from its content alone."""
    t = np.arange(tokens_BT.shape[-1], dtype=np.uint64)
    h = _mix(tokens_BT.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + t)
    return (_mix(np.bitwise_xor.reduce(h, axis=-1)) & np.uint64(1)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class SyntheticTask:
    """A random-access source of task examples (`inputs`, `targets`, `weights`, each (T,))."""

    task: str
    seq_len: int
    seed: int
    group: str = "S5"
    modulus: int = 2
    delay: int = 4
    task_vocab_size: int = 16

    packed = False  # no segment ids / positions: one sequence per example

    @property
    def vocab_size(self) -> int:
        if self.task == "word_problem":
            return len(group_elements(self.group))
        if self.task == "modular_sum":
            return self.modulus
        return self.task_vocab_size

    def __len__(self) -> int:
        return 2**62  # effectively unbounded: every index is a fresh example

    def _draw(self, split: str, indices: np.ndarray) -> np.ndarray:
        """Tokens of the given examples: a counter-based hash of (seed, split, index, attempt, t),
        taking the first attempt whose row hashes into `split`. Attempts are tried 8 at a time,
        vectorised (a row needs 2 on average; all 8 miss with probability 1/256)."""
        indices = np.asarray(indices, np.uint64)
        t = np.arange(self.seq_len, dtype=np.uint64)
        tokens = np.empty((len(indices), self.seq_len), np.int32)
        base = _mix(np.array([self.seed], np.uint64) * np.uint64(0xD1B54A32D192ED03) + np.uint64(SPLITS[split]))
        todo, first_attempt = np.arange(len(indices)), 0
        while len(todo):
            attempts = np.arange(first_attempt, first_attempt + 8, dtype=np.uint64)
            key = _mix(base ^ _mix(indices[todo, None] * np.uint64(0x9E3779B97F4A7C15) + attempts[None, :]))
            words = _mix(key[..., None] + t * np.uint64(0xA0761D6478BD642F))  # (rows, 8, T)
            candidates = (words % np.uint64(self.vocab_size)).astype(np.int32)
            ok = split_of(candidates) == SPLITS[split]  # (rows, 8)
            found = ok.any(axis=1)
            choice = ok.argmax(axis=1)
            tokens[todo[found]] = candidates[found, choice[found]]
            todo, first_attempt = todo[~found], first_attempt + 8
        return tokens

    def labels(self, tokens_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Targets and loss weights for a batch of token sequences."""
        targets = np.zeros_like(tokens_BT)
        weights = np.ones(tokens_BT.shape, np.float32)
        if self.task == "word_problem":
            table = composition_table(self.group)
            running = tokens_BT[:, 0]
            targets[:, 0] = running
            for t in range(1, self.seq_len):
                running = table[running, tokens_BT[:, t]]
                targets[:, t] = running
        elif self.task == "modular_sum":
            targets = (np.cumsum(tokens_BT, axis=1) % self.modulus).astype(np.int32)
        else:
            targets[:, self.delay :] = tokens_BT[:, : -self.delay]
            weights[:, : self.delay] = 0.0
        return targets, weights

    def examples(self, split: str, indices: np.ndarray) -> dict[str, np.ndarray]:
        """The examples with the given indices of `split`, as arrays (len(indices), seq_len)."""
        inputs = self._draw(split, indices)
        targets, weights = self.labels(inputs)
        return {"inputs": inputs, "targets": targets, "weights": weights}

    def batch(self, split: str, step: int, batch_size: int) -> dict[str, np.ndarray]:
        """Examples step·B … step·B + B − 1 of `split`."""
        return self.examples(split, np.arange(step * batch_size, (step + 1) * batch_size))


def prompt_length(seq_len: int) -> int:
    """How many of a sequence's tokens are the prompt when decoding modes are compared (a quarter):
    the rest are fed one by one in the mode (fbt-eval's per-position and generative accuracies)."""
    return max(1, seq_len // 4)


def make_task(config) -> SyntheticTask:
    """The task named by `config.data`, validated (one-line errors; seq_len is checked by the
    data plan for every source, `plan.plan_data`)."""
    data = config.data
    if data.task not in TASKS:
        raise ConfigError(f"data.task={data.task!r} is unknown; use one of {TASKS}")
    if data.task == "word_problem":
        group_elements(data.group)  # validates the name
    if data.task == "modular_sum" and data.modulus < 2:
        raise ConfigError(f"data.modulus={data.modulus} must be at least 2 (2 = parity)")
    if data.task == "delayed_recall":
        if data.task_vocab_size < 2:
            raise ConfigError(f"data.task_vocab_size={data.task_vocab_size} must be at least 2")
        if not 1 <= data.delay < data.seq_len:
            raise ConfigError(
                f"data.delay={data.delay} cannot be filled by data.seq_len={data.seq_len}; use 1 <= delay < seq_len"
            )
    return SyntheticTask(
        task=data.task,
        seq_len=data.seq_len,
        seed=config.seed,
        group=data.group,
        modulus=data.modulus,
        delay=data.delay,
        task_vocab_size=data.task_vocab_size,
    )
