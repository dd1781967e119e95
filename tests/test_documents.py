"""Where documents come from: text files by glob (.jsonl: a document per line), split into train and
validation by a hash of the text."""

import json

import pytest

from fbt_jax.data.documents import is_validation, read_documents, text_files
from fbt_jax.errors import ConfigError


def test_jsonl_files_hold_a_document_per_line_and_other_files_one_each(tmp_path):
    (tmp_path / "b.txt").write_text("a whole\nfile")
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one"}) + "\n\n" + json.dumps({"text": "two"}) + "\n")
    paths = text_files(f"{tmp_path}/*")
    assert paths == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt")]  # sorted: the order is fixed
    assert list(read_documents(paths)) == ["one", "two", "a whole\nfile"]


def test_the_validation_split_is_a_function_of_the_text():
    texts = [f"document {i}" for i in range(4000)]
    held_out = [t for t in texts if is_validation(t, 0.2)]
    assert abs(len(held_out) / len(texts) - 0.2) < 0.03
    assert held_out == [t for t in texts if is_validation(t, 0.2)]  # the same text, the same split
    assert not any(is_validation(t, 0.0) for t in texts)
    assert set(held_out) <= {t for t in texts if is_validation(t, 0.5)}  # a larger fraction only adds


@pytest.mark.parametrize(
    "name, content, message",
    [
        (None, None, r"--input='.*/\*\.txt' matches no file"),
        ("empty.txt", "", r"empty\.txt is empty; remove it or fix --input"),
    ],
    ids=["no-match", "empty-file"],
)
def test_a_glob_without_usable_files_names_the_flag(tmp_path, name, content, message):
    if name is not None:
        (tmp_path / name).write_text(content)
    with pytest.raises(ConfigError, match=message):
        text_files(f"{tmp_path}/*.txt", flag="--input")
