"""Packing documents into records: every token once, positions and loss weights per document, and
packed documents that do not see each other in the model."""

import jax.numpy as jnp
import numpy as np

from fbt_jax.data.packing import pack_documents, record_to_example
from fbt_jax.feedback import kpass_forward


def test_packing_keeps_every_token_once_and_restarts_segments():
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 50, size=n) for n in (3, 17, 5, 40, 1, 8, 12)]
    recs = list(pack_documents(docs, seq_len=15))
    assert all(r.shape == (2, 16) for r in recs)
    tokens = np.concatenate([r[0][r[1] > 0] for r in recs])
    assert np.array_equal(tokens, np.concatenate(docs))  # every token once, in order
    for r in recs:
        ex = record_to_example(r)
        seg = r[1]
        for t in range(15):
            if seg[t] == 0:
                assert ex["weights"][t] == 0  # padding never scored
            elif t == 0 or seg[t] != seg[t - 1]:
                assert ex["positions"][t] == 0  # positions restart at each document
            else:
                assert ex["positions"][t] == ex["positions"][t - 1] + 1
            assert ex["weights"][t] == float(seg[t] > 0 and seg[t + 1] == seg[t])  # never across documents
        assert np.array_equal(ex["targets"], r[0][1:])


def test_packed_documents_do_not_see_each_other_in_the_model(small_model):
    model = small_model
    a, b = np.arange(1, 6), np.arange(7, 14)
    (record,) = list(pack_documents([a, b], seq_len=12))
    ex = record_to_example(record)
    batch = {k: jnp.asarray(v)[None] for k, v in ex.items()}
    p = jnp.array([2])
    h = kpass_forward(
        model, batch["inputs"], p, 3, positions_BT=batch["positions"], segment_ids_BT=batch["segment_ids"]
    )[-1]
    alone_a = kpass_forward(model, jnp.asarray(a)[None], p, 3)[-1]
    alone_b = kpass_forward(model, jnp.asarray(b[:-1])[None], p, 3)[-1]  # b's last token is only a target
    assert float(jnp.max(jnp.abs(h[:, :5] - alone_a))) <= 1e-5
    assert float(jnp.max(jnp.abs(h[:, 5:11] - alone_b))) <= 1e-5
