"""data.mixture: the dataset of each global example is a seeded function of its index, exact in every
block, the same on any number of hosts and after a resume; each dataset's held-out loss is logged."""

import numpy as np
import pytest
from conftest import load_config, write_corpus

from fbt_jax.data.mixture import Mixture, block_counts, parse_mixture
from fbt_jax.data.pipeline import StepBatches, make_source
from fbt_jax.data.plan import plan_data
from fbt_jax.data.prepare import main as fbt_prepare
from fbt_jax.errors import ConfigError


class Counter:
    """A stand-in dataset whose example i is the number i (enough to see which rows come from where)."""

    seq_len = 1
    vocab_size = 2

    def __init__(self, n, tag):
        self.n, self.tag = n, tag

    def __len__(self):
        return self.n

    def examples(self, indices):
        return {"inputs": np.stack([np.asarray(indices), np.full(len(indices), self.tag)], axis=1)}


def test_block_counts_are_exact_where_a_small_block_allows():
    assert block_counts([0.7, 0.2, 0.1]) == [7, 2, 1]
    assert block_counts([3, 1]) == [3, 1]
    assert block_counts([1, 0, 1]) == [1, 0, 1]
    thirds = block_counts([1 / 3, 1 / 3, 1 / 3])
    assert thirds == [1, 1, 1]
    odd = block_counts([0.5123, 0.4877])
    assert sum(odd) <= 10_000 and abs(odd[0] / sum(odd) - 0.5123) < 1e-3


def test_the_mix_is_exact_in_every_block_and_reads_each_dataset_in_order():
    mixture = Mixture(["a", "b", "c"], [Counter(50, 0), Counter(7, 1), Counter(1000, 2)], [0.7, 0.2, 0.1], seed=3)
    block = mixture.block
    dataset, index = mixture.assign(np.arange(40 * block))
    for b in range(40):
        assert np.bincount(dataset[b * block : (b + 1) * block], minlength=3).tolist() == mixture.counts
    for window in (13, 100, 257):  # any window: within one block of the weights
        for start in (0, 5, 91):
            counts = np.bincount(dataset[start : start + window], minlength=3)
            assert np.all(np.abs(counts - window * np.array([0.7, 0.2, 0.1])) <= block)
    for i, count in enumerate(mixture.counts):  # each dataset's examples 0, 1, 2, … in the order drawn
        assert sorted(index[dataset == i].tolist()) == list(range(40 * count))
    assert dataset[:block].tolist() != sorted(dataset[:block].tolist())  # places within a block are shuffled
    again = Mixture(["a", "b", "c"], [Counter(50, 0), Counter(7, 1), Counter(1000, 2)], [0.7, 0.2, 0.1], seed=3)
    assert np.array_equal(again.assign(np.arange(123, 323))[0], dataset[123:323])  # a function of the index
    other = Mixture(["a", "b", "c"], [Counter(50, 0), Counter(7, 1), Counter(1000, 2)], [0.7, 0.2, 0.1], seed=4)
    assert not np.array_equal(other.assign(np.arange(400))[0], dataset[:400])


def test_hosts_load_disjoint_rows_whose_union_is_the_batch_and_resume_needs_only_the_step():
    mixture = Mixture(["a", "b"], [Counter(30, 0), Counter(11, 1)], [0.5, 0.5], seed=0)
    whole = StepBatches(mixture, 8, tuple(range(8)), seed=1, shuffle=True)
    halves = [StepBatches(mixture, 8, rows, seed=1, shuffle=True) for rows in ((0, 1, 2, 3), (4, 5, 6, 7))]
    for step in (0, 3, 17):
        batch = whole(step)["inputs"]
        assert np.array_equal(np.concatenate([h(step)["inputs"] for h in halves]), batch)
        assert np.array_equal(StepBatches(mixture, 8, tuple(range(8)), seed=1, shuffle=True)(step)["inputs"], batch)
    # Over an epoch of the small dataset each of its records is read once.
    rows = np.concatenate([whole(s)["inputs"] for s in range(40)])
    small = rows[rows[:, 1] == 1][:11, 0]
    assert sorted(small.tolist()) == list(range(11))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("a=x:0.5,b=y:-1", r"the weight of 'b=y:-1' is -1; weights must be >= 0"),
        ("a=x:0,b=y:0", r"the weights sum to 0; give at least one dataset a positive weight"),
        ("a=x", r"'a=x' is not \[name=\]path:weight"),
        ("x:1,x:2", r"names a dataset twice"),
        ("a=x:nan", r"weights must be >= 0 \(and finite\)"),
    ],
    ids=["negative", "zero-sum", "no-weight", "twice", "nan"],
)
def test_bad_mixtures_are_one_line(spec, message):
    with pytest.raises(ConfigError, match=message):
        parse_mixture(spec)


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for name, seed in (("web", 0), ("code", 1)):
        write_corpus(root / f"{name}-corpus", num_docs=40, seed=seed)
        out[name] = str(root / name)
        fbt_prepare([f"--input={root}/{name}-corpus/*", f"--output={out[name]}", "--seq-len=16",
                     "--validation-fraction=0.25"])  # fmt: skip
    return out


def mixture_config(tmp_path, datasets, seq_len=16):
    config = load_config("tiny")
    config.workdir = str(tmp_path / "run")
    config.data.source = "mixture"
    config.data.mixture = f"web={datasets['web']}:0.75,code={datasets['code']}:0.25"
    config.data.seq_len = seq_len
    config.model.vocab_size = 257
    return config


def test_a_run_on_a_mixture_evaluates_each_dataset_on_its_own(tmp_path, two_datasets):
    """Every eval (what the Evaluator hook writes to eval.jsonl) has each dataset's loss beside the
    overall one, which pools the tokens of all of them."""
    from fbt_jax.train.trainer import Trainer

    config = mixture_config(tmp_path, two_datasets)
    config.eval.num_batches = 1
    config.eval.contraction_passes = 0
    trainer = Trainer(config, log=lambda *_: None)
    trainer.compile(pass_counts=())  # the eval program only
    trainer.init_state()
    ev = trainer.evaluate()
    assert {"loss_K1/web", "loss_K1/code", "accuracy_K1/web", "accuracy_K2/code"} <= set(ev)
    assert ev["loss_K1/web"] != ev["loss_K1/code"]
    assert min(ev["loss_K1/web"], ev["loss_K1/code"]) <= ev["loss_K1"] <= max(ev["loss_K1/web"], ev["loss_K1/code"])


def test_mixed_datasets_must_share_seq_len(tmp_path, two_datasets, corpus):
    other = str(tmp_path / "other")
    fbt_prepare([f"--input={corpus[0]}/*", f"--output={other}", "--seq-len=32"])
    config = mixture_config(tmp_path, {**two_datasets, "code": other})
    with pytest.raises(ConfigError, match=r"data.mixture: the datasets differ in seq_len"):
        make_source(plan_data(config), "train")
