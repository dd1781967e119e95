"""The fbt backend scores what lm-evaluation-harness's own `hf` backend scores (issue #43): per
request, in float32, on the same model, with contexts ending in spaces, tabs, newlines and
indentation (where the split of context from continuation changes the tokens scored) and empty ones.

The reference is tests/harness/hf_reference.json, written by lm-eval's `hf` backend itself
(tests/harness/make_hf_reference.py) on tests/interop/reference/llama; here the fbt backend reads
`fbt-import` of that directory. Where torch and transformers are installed the `hf` backend also
runs live, on `fbt-export` of the imported run."""

import json
import os

import numpy as np
import pytest
from conftest import ROOT

HARNESS = os.path.join(ROOT, "tests", "harness")
LLAMA = os.path.join(ROOT, "tests", "interop", "reference", "llama")


def reference() -> list[dict]:
    with open(os.path.join(HARNESS, "hf_reference.json"), encoding="utf-8") as f:
        return json.load(f)["requests"]


def instances(pairs):
    from lm_eval.api.instance import Instance

    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> str:
    """fbt-import of the reference Llama: the run's workdir."""
    from fbt_jax.interop import importer

    return importer.import_model(LLAMA, str(tmp_path_factory.mktemp("llama") / "run"), log=lambda *_: None).workdir


@pytest.fixture(scope="module")
def backend(imported):
    """The fbt backend, standard mode, on the imported run."""
    from fbt_jax.evals.harness import FBTLM, Loaded

    return FBTLM(mode="standard", loaded=Loaded.read(imported, log=lambda *_: None), batch_size=8, progress=False)


def close(ours: float, theirs: float) -> bool:
    """Equal to 1e-5, or to 4 float32 ulps where the total is too large for that (this random model's
    requests total -11 to -255 nats; an ulp of 128..256 in float32 is 1.5e-5)."""
    return abs(ours - theirs) <= max(1e-5, 4 * float(np.spacing(np.float32(abs(theirs)))))


def test_each_loglikelihood_is_the_hf_backends_on_the_same_model(backend):
    requests = reference()
    scored = backend.loglikelihood(instances([(r["context"], r["continuation"]) for r in requests]), True)
    for request, (total, greedy) in zip(requests, scored):
        assert close(total, request["loglikelihood"]) and greedy == request["is_greedy"], (total, request)


@pytest.mark.parametrize("tokenizer", ["reference", "python_bpe"])
def test_contexts_are_split_from_their_continuations_as_the_harnesss_own_loglikelihood_splits_them(
    backend, bpe_tokenizer_json, tokenizer
):
    """Compared with the split lm-eval's TemplateLM.loglikelihood hands its scorer, over the same
    tokens: the reference Llama's, and a BPE trained on Python sources (where indentation merges).
    The old rule (only trailing spaces move) differs on these, so the check bites."""
    from lm_eval.api.model import TemplateLM

    from fbt_jax.data.tokenizers import load_tokenizer

    backend.tokenizer = load_tokenizer(bpe_tokenizer_json) if tokenizer == "python_bpe" else backend.loaded.tokenizer

    class Recorder(TemplateLM):  # the harness's own request handling, over the backend's tokens
        eot_token_id = property(lambda self: backend.eot_token_id)
        prefix_token_id = property(lambda self: backend.prefix_token_id)

        def tok_encode(self, string, add_special_tokens=None, **kwargs):
            return backend.tok_encode(string, add_special_tokens)

        def _loglikelihood_tokens(self, requests, **kwargs):
            return [(context, continuation) for _, context, continuation in requests]

        loglikelihood_rolling = generate_until = None

    def spaces_only(context, continuation):  # what the backend did before
        moved = len(context) - len(context.rstrip(" "))
        if moved:
            context, continuation = context[:-moved], context[-moved:] + continuation
        whole, head = backend.encode(context + continuation), backend.encode(context)
        return head, whole[len(head) :]

    try:
        pairs = [(r["context"], r["continuation"]) for r in reference()]
        theirs = Recorder().loglikelihood(instances(pairs), disable_tqdm=True)
        assert [backend.pair(c, x) for c, x in pairs] == theirs
        differ = [c for (c, x), split in zip(pairs, theirs) if c and spaces_only(c, x) != split]
    finally:
        backend.tokenizer = backend.loaded.tokenizer
    assert differ and all(c[-1] in " \t\n" for c in differ)
    if tokenizer == "python_bpe":
        assert any(c.endswith("\n    ") for c in differ) and any(c.endswith("\t") for c in differ), differ


def test_the_hf_backend_on_the_export_scores_what_the_fbt_backend_scores(backend, imported, tmp_path):
    """Live, where torch and transformers are installed (they are not in CI: the stored reference
    stands in there)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import sys

    from fbt_jax.interop import exporter

    sys.path.insert(0, HARNESS)
    from make_hf_reference import REQUESTS, hf_loglikelihoods

    exporter.export_run(imported, str(tmp_path / "export"), log=lambda *_: None)
    theirs = hf_loglikelihoods(str(tmp_path / "export"), REQUESTS)
    ours = backend.loglikelihood(instances(REQUESTS), True)
    for pair, (total, greedy), (want, want_greedy) in zip(REQUESTS, ours, theirs):
        assert close(total, want) and greedy == want_greedy, (pair, total, want)
