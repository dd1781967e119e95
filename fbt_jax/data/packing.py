"""Packing variable-length documents into fixed-length records, and records into examples.

A record holds T + 1 token ids and their segment ids (1, 2, … per document piece; 0 = padding),
so that inputs = tokens[:-1] and targets = tokens[1:]. A record of chat data has a third row: each
token's `trained` flag (conversations.py), its loss weight as a target and its fuse flag as an input. Documents are placed in order; one that
does not fit the space left starts a new record if it fits a whole one, and a document longer
than a record is split into record-sized pieces. Every input token lands in exactly one record.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class RecordPacker:
    """Packs documents pushed one at a time (`add`), for preparing two splits from one stream."""

    def __init__(self, seq_len: int, rows: int = 2):
        self.length, self.rows = seq_len + 1, rows
        self._new()

    def _new(self) -> None:
        self.record, self.fill, self.segment = np.zeros((self.rows, self.length), np.int32), 0, 0

    def add(self, doc: np.ndarray) -> list[np.ndarray]:
        """The records that `doc` completes (int32, (rows, seq_len + 1): token ids, segment ids, then the
        rows after a document's ids: `doc` is (n,) ids, or (rows - 1, n) with its ids first)."""
        done = []
        doc = np.atleast_2d(np.asarray(doc, np.int32))
        if doc.shape[0] != self.rows - 1:
            raise ValueError(f"a document of {doc.shape[0]} rows packed into records of {self.rows}")
        while doc.shape[1]:
            room = self.length - self.fill
            if doc.shape[1] > room and self.fill > 0 and doc.shape[1] <= self.length:
                done.append(self.record)  # keep the document whole: start it in a fresh record
                self._new()
                continue
            piece, doc = doc[:, :room], doc[:, room:]
            self.segment += 1
            filled = slice(self.fill, self.fill + piece.shape[1])
            self.record[0, filled] = piece[0]
            self.record[1, filled] = self.segment
            self.record[2:, filled] = piece[1:]
            self.fill += piece.shape[1]
            if self.fill == self.length:
                done.append(self.record)
                self._new()
        return done

    def finish(self) -> list[np.ndarray]:
        """The last, partly filled record (if any)."""
        done = [self.record] if self.fill else []
        self._new()
        return done


def pack_documents(documents: Iterable[np.ndarray], seq_len: int, rows: int = 2) -> Iterator[np.ndarray]:
    """Yield int32 records of shape (rows, seq_len + 1): row 0 token ids, row 1 segment ids (row 2 trained flags)."""
    packer = RecordPacker(seq_len, rows)
    for doc in documents:
        yield from packer.add(doc)
    yield from packer.finish()


def segment_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Position of each token within its segment (restarting at 0 at every boundary); (..., T)."""
    index = np.broadcast_to(np.arange(segment_ids.shape[-1]), segment_ids.shape)
    starts = np.ones(segment_ids.shape, bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    start_index = np.maximum.accumulate(np.where(starts, index, 0), axis=-1)
    return (index - start_index).astype(np.int32)


def records_to_examples(records: np.ndarray) -> dict[str, np.ndarray]:
    """Inputs, targets, loss weights, segment ids and positions, each (..., T), of records
    (..., 2, T + 1). A target counts only inside one document: never across a boundary, never
    on padding. Chat records (..., 3, T + 1) weigh only the trained targets, and add `fuse`: 1 where
    an input is fused, 0 where it is read plainly (a pretraining row has none: its fuse-from is drawn)."""
    tokens, segments = records[..., 0, :], records[..., 1, :]
    in_segments = segments[..., :-1]
    weights = (segments[..., 1:] == in_segments) & (in_segments > 0)
    chat = records.shape[-2] == 3
    if chat:
        weights &= records[..., 2, 1:] > 0
    examples = {
        "inputs": np.ascontiguousarray(tokens[..., :-1]),
        "targets": np.ascontiguousarray(tokens[..., 1:]),
        "weights": weights.astype(np.float32),
        "segment_ids": np.ascontiguousarray(in_segments),
        "positions": segment_positions(in_segments),
    }
    if chat:
        examples["fuse"] = np.ascontiguousarray(records[..., 2, :-1])
    return examples


def record_to_example(record: np.ndarray) -> dict[str, np.ndarray]:
    """`records_to_examples` for one record (2 or 3, T + 1)."""
    return records_to_examples(record)
