"""Tokenizers: bytes with an end-of-document id, and a SentencePiece model given by path."""

import pytest
from conftest import text_config

from fbt_jax.data.pipeline import make_source
from fbt_jax.data.tokenizers import ByteTokenizer, load_tokenizer
from fbt_jax.errors import ConfigError


def test_byte_tokenizer_appends_end_of_document_and_decodes_back():
    tokenizer = load_tokenizer("byte")
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer.vocab_size == 257
    ids = tokenizer.encode("héllo")
    assert list(ids) == [*"héllo".encode(), 256]
    assert tokenizer.decode(ids) == "héllo"  # the end-of-document id decodes to nothing


def test_a_missing_model_file_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"--tokenizer='.*none.model' is neither 'byte' nor an existing"):
        load_tokenizer(str(tmp_path / "none.model"), flag="--tokenizer")


def test_sentencepiece_tokenizer_by_path(tmp_path, corpus):
    import sentencepiece

    corpus, _ = corpus
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus / "doc0.txt"),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=40,
        character_coverage=1.0,
        model_type="bpe",
        minloglevel=2,
    )
    config = text_config(tmp_path, f"{corpus}/*")
    config.data.tokenizer = str(tmp_path / "sp.model")
    config.model.vocab_size = 32
    from fbt_jax.train.trainer import Trainer

    with pytest.raises(ConfigError, match="smaller than the data's vocabulary"):
        Trainer(config, log=lambda *_: None)
    config.model.vocab_size = 64
    source = make_source(config, "train")
    assert source.meta["tokenizer"].endswith("sp.model") and source.vocab_size <= 64
    assert 0 < int(source.example(0)["inputs"].max()) < source.vocab_size
