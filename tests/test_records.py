"""Records written by fbt-prepare: each split holds its documents, every one once, and none of the
other split's."""

import numpy as np

from fbt_jax.data import records
from fbt_jax.data.documents import is_validation
from fbt_jax.data.sources import list_inputs, read_documents


def test_prepared_splits_hold_every_document_once_and_never_overlap(prepared):
    corpus, out, _ = prepared
    meta = records.read_meta(out)
    expected = [d for f in list_inputs(f"{corpus}/*") for d in read_documents(f)]
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


def test_a_prepared_directory_the_user_cannot_read_says_so(monkeypatch, tmp_path):
    """Not "holds no prepared data": the permission is the cause (faked, since tests run as root)."""
    import os

    import pytest

    from fbt_jax.errors import ConfigError

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else real_access(p, mode))
    with pytest.raises(ConfigError, match=r"cannot be read: permission denied on .*locked; fix its permissions"):
        records.read_meta(str(locked))
