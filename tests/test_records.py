"""Records written by fbt-prepare: each split holds its documents, every one once, and none of the
other split's."""

import numpy as np

from fbt_jax.data import records
from fbt_jax.data.documents import is_validation, read_documents, text_files


def test_prepared_splits_hold_every_document_once_and_never_overlap(prepared):
    corpus, out, _ = prepared
    meta = records.read_meta(out)
    expected = list(read_documents(text_files(f"{corpus}/*")))
    for split in ("train", "validation"):
        source = records.PackedRecords(out, split)
        assert meta["records"][split] == len(source)
        stream = np.concatenate(
            [tokens[segments > 0] for tokens, segments in (source._record(i) for i in range(len(source)))]
        )
        documents = [
            bytes(piece[:-1].tolist()).decode() for piece in np.split(stream, np.flatnonzero(stream == 256) + 1)[:-1]
        ]
        held_out = split == "validation"
        assert documents == [d for d in expected if is_validation(d, 0.2) == held_out]
    assert meta["documents"]["train"] + meta["documents"]["validation"] == len(expected)
    assert 0 < meta["documents"]["validation"] < len(expected)
