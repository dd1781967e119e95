"""Tokenizers: bytes with an end-of-document id, a SentencePiece model, and Hugging Face tokenizers (a
tokenizer.json or a save_pretrained directory), each encoding one document or a batch the same way."""

import hashlib
import json
import os
import pickle
import shutil
import sys

import numpy as np
import pytest
from conftest import text_config

import fbt_jax.data.tokenizers as tokenizers_module
from fbt_jax.data.tokenizers import (
    ByteTokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    limit_encoder_threads,
    load_tokenizer,
)
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
    model = train_sentencepiece(tmp_path, corpus)
    config = text_config(tmp_path, f"{corpus[0]}/*")
    config.data.tokenizer = model
    config.model.vocab_size = 32
    from fbt_jax.data.pipeline import make_source
    from fbt_jax.data.plan import plan_data
    from fbt_jax.train.trainer import Trainer

    with pytest.raises(ConfigError, match="smaller than the data's vocabulary"):
        Trainer(config, log=lambda *_: None)
    config.model.vocab_size = 64
    source = make_source(plan_data(config), "train")
    assert source.meta["tokenizer"].endswith("sp.model") and source.vocab_size <= 64
    assert 0 < int(source.example(0)["inputs"].max()) < source.vocab_size


# --- Hugging Face tokenizers (tokenizer.json, save_pretrained directories), batch encoding, pickling ---

DOCUMENTS = [
    "def f(x):\n    return x + 1\n",
    "héllo wörld — naïve café",
    "日本語のテキストと中文文本",
    "emoji 🙂🚀 and combining e\u0301",
    "",
    " ",
    "\n\n\t  trailing  ",
    "class A:\n    pass\n" * 20,
    "Ünïcödé ∑∫√ ← →",
]


def library(path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def save_pretrained_dir(directory, tokenizer_json, config=None, special_tokens_map=None):
    """A directory laid out as transformers' save_pretrained writes it, by hand."""
    os.makedirs(directory, exist_ok=True)
    shutil.copy(tokenizer_json, os.path.join(directory, "tokenizer.json"))
    for name, values in (("tokenizer_config.json", config), ("special_tokens_map.json", special_tokens_map)):
        if values is not None:
            with open(os.path.join(directory, name), "w") as f:
                json.dump(values, f)
    return str(directory)


def with_template(tokenizer_json, directory, single):
    """tokenizer_json with a TemplateProcessing post-processor (`single`, e.g. "<s> $A"), saved in directory."""
    from tokenizers import processors

    tokenizer = library(tokenizer_json)
    names = [t for t in single.split() if t != "$A"]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, special_tokens=[(t, tokenizer.token_to_id(t)) for t in dict.fromkeys(names)]
    )
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(str(directory), "tokenizer.json")
    tokenizer.save(path)
    return path


def assert_batch_matches(tokenizer, texts=DOCUMENTS):
    batch = tokenizer.encode_batch(texts)
    assert len(batch) == len(texts)
    for text, ids in zip(texts, batch, strict=True):
        assert ids.dtype == np.int32 and list(ids) == list(tokenizer.encode(text))
        assert list(ids).count(tokenizer.eos_id) == 1 and ids[-1] == tokenizer.eos_id
        assert tokenizer.encode_prompt(text) == list(ids[:-1])


def test_byte_tokenizer_batch_equals_per_document():
    tokenizer = load_tokenizer("byte")
    assert tokenizer.identity == "byte" and tokenizer.bos_id is None
    assert_batch_matches(tokenizer)
    assert tokenizer.encode_batch([]) == [] and list(tokenizer.encode_batch([""])[0]) == [256]


def test_tokenizer_json_encodes_as_the_library_does(bpe_tokenizer_json):
    tokenizer = load_tokenizer(bpe_tokenizer_json)
    lib = library(bpe_tokenizer_json)
    assert isinstance(tokenizer, HuggingFaceTokenizer) and tokenizer.name == os.path.abspath(bpe_tokenizer_json)
    assert tokenizer.eos_id == lib.token_to_id("<|endoftext|>") and tokenizer.bos_id is None
    assert tokenizer.vocab_size == lib.get_vocab_size() == 1000
    assert tokenizer.identity.startswith("hf:") and len(tokenizer.identity) == 3 + 32
    texts = DOCUMENTS * 30
    for text, ids in zip(texts, tokenizer.encode_batch(texts), strict=True):
        assert list(ids) == [*lib.encode(text).ids, tokenizer.eos_id]
        assert tokenizer.decode(ids) == text  # byte-level BPE round-trips, and eos decodes to nothing
    assert_batch_matches(tokenizer)
    # A .json by content: a tokenizer.json under another name loads as one too.
    other = os.path.join(os.path.dirname(bpe_tokenizer_json), "tok.bin")
    shutil.copy(bpe_tokenizer_json, other)
    assert load_tokenizer(other).identity == tokenizer.identity


def test_save_pretrained_directory_adds_bos_and_eos_from_its_config(bpe_tokenizer_json, tmp_path):
    config = {"bos_token": {"content": "<s>", "lstrip": False}, "add_bos_token": True, "eos_token": "</s>"}
    directory = save_pretrained_dir(tmp_path / "model", bpe_tokenizer_json, config)
    tokenizer = load_tokenizer(directory)
    lib = library(bpe_tokenizer_json)
    bos, eos = lib.token_to_id("<s>"), lib.token_to_id("</s>")
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.name) == (bos, eos, os.path.abspath(directory))
    for text, ids in zip(DOCUMENTS, tokenizer.encode_batch(DOCUMENTS), strict=True):
        assert list(ids) == [bos, *lib.encode(text).ids, eos]
        assert tokenizer.decode(ids) == text
    assert tokenizer.encode_prompt("hi") == [bos, *lib.encode("hi").ids]
    assert_batch_matches(tokenizer)
    # The identity follows the files' contents and settings, not their path.
    copy = shutil.copytree(directory, tmp_path / "elsewhere" / "copy")
    assert load_tokenizer(str(copy)).identity == tokenizer.identity
    assert load_tokenizer(bpe_tokenizer_json).identity != tokenizer.identity
    no_bos = save_pretrained_dir(tmp_path / "no-bos", bpe_tokenizer_json, {**config, "add_bos_token": False})
    assert load_tokenizer(no_bos).identity not in (tokenizer.identity, load_tokenizer(bpe_tokenizer_json).identity)
    assert load_tokenizer(no_bos).bos_id is None


def test_save_pretrained_directory_falls_back_to_special_tokens_map(bpe_tokenizer_json, tmp_path):
    directory = save_pretrained_dir(tmp_path / "m", bpe_tokenizer_json, {}, {"eos_token": {"content": "</s>"}})
    tokenizer = load_tokenizer(directory)
    assert tokenizer.eos_id == library(bpe_tokenizer_json).token_to_id("</s>") and tokenizer.bos_id is None
    plain = save_pretrained_dir(tmp_path / "plain", bpe_tokenizer_json)  # no config: as the bare file
    assert load_tokenizer(plain).identity == load_tokenizer(bpe_tokenizer_json).identity


def test_a_post_processor_bos_is_honoured_and_not_doubled(bpe_tokenizer_json, tmp_path):
    llama3 = with_template(bpe_tokenizer_json, tmp_path / "llama3", "<s> $A")
    lib = library(llama3)
    bos, eot = lib.token_to_id("<s>"), lib.token_to_id("<|endoftext|>")
    tokenizer = load_tokenizer(llama3)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (bos, eot)
    for text, ids in zip(DOCUMENTS, tokenizer.encode_batch(DOCUMENTS), strict=True):
        assert list(ids) == [*lib.encode(text).ids, eot] and list(ids).count(bos) == 1 and ids[0] == bos
    assert_batch_matches(tokenizer)
    # add_bos_token in a config does not add a second bos; add_bos_token false removes it, as transformers does.
    config = {"bos_token": "<s>", "eos_token": "<|endoftext|>"}
    on = load_tokenizer(save_pretrained_dir(tmp_path / "on", llama3, {**config, "add_bos_token": True}))
    assert on.encode("x").tolist() == tokenizer.encode("x").tolist() and on.identity == tokenizer.identity
    off = load_tokenizer(save_pretrained_dir(tmp_path / "off", llama3, {**config, "add_bos_token": False}))
    assert off.bos_id is None and off.encode("x").tolist() == [*lib.encode("x", add_special_tokens=False).ids, eot]


def test_a_post_processor_eos_is_not_doubled(bpe_tokenizer_json, tmp_path):
    roberta = with_template(bpe_tokenizer_json, tmp_path / "roberta", "<s> $A </s>")
    lib = library(roberta)
    tokenizer = load_tokenizer(roberta)
    assert (tokenizer.bos_id, tokenizer.eos_id) == (lib.token_to_id("<s>"), lib.token_to_id("</s>"))
    for text, ids in zip(DOCUMENTS, tokenizer.encode_batch(DOCUMENTS), strict=True):
        assert list(ids) == lib.encode(text).ids  # the template's own </s> ends the document
        assert tokenizer.decode(ids) == text
    assert_batch_matches(tokenizer)
    assert tokenizer.encode_prompt("x") == lib.encode("x").ids[:-1]


def test_saved_truncation_and_padding_do_not_cut_documents(bpe_tokenizer_json, tmp_path):
    lib = library(bpe_tokenizer_json)
    lib.enable_truncation(4)
    lib.enable_padding(length=8, pad_id=3, pad_token="<pad>")
    path = str(tmp_path / "tokenizer.json")
    lib.save(path)
    text = DOCUMENTS[7]
    assert list(load_tokenizer(path).encode(text)) == list(load_tokenizer(bpe_tokenizer_json).encode(text))


def train_sentencepiece(tmp_path, corpus):
    import sentencepiece

    directory, _ = corpus
    sentencepiece.SentencePieceTrainer.train(
        input=str(directory / "doc0.txt"),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=40,
        character_coverage=1.0,
        model_type="bpe",
        minloglevel=2,
    )
    return str(tmp_path / "sp.model")


def test_sentencepiece_batch_equals_per_document_and_directory(tmp_path, corpus):
    model = train_sentencepiece(tmp_path, corpus)
    tokenizer = load_tokenizer(model)
    assert isinstance(tokenizer, SentencePieceTokenizer) and tokenizer.bos_id is None
    with open(model, "rb") as f:
        assert tokenizer.identity == "sentencepiece:" + hashlib.blake2b(f.read(), digest_size=16).hexdigest()
    texts = [d for d in DOCUMENTS if d.strip()]
    assert_batch_matches(tokenizer, texts)
    seen = (corpus[0] / "doc0.txt").read_text()  # the model's training text: every character has a piece
    assert tokenizer.decode(tokenizer.encode(seen)) == seen
    # An older Llama / Mistral save_pretrained directory: only a SentencePiece tokenizer.model.
    (tmp_path / "llama").mkdir()
    shutil.copy(model, tmp_path / "llama" / "tokenizer.model")
    in_dir = load_tokenizer(str(tmp_path / "llama"))
    assert isinstance(in_dir, SentencePieceTokenizer) and in_dir.identity == tokenizer.identity
    assert in_dir.name == str(tmp_path / "llama")
    # The batch encoder's threads are limited for this process.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokenizers_module, "_sp_threads", tokenizers_module._sp_threads)
        patch.setenv("RAYON_NUM_THREADS", os.environ.get("RAYON_NUM_THREADS", ""))
        limit_encoder_threads(1)
        assert os.environ["RAYON_NUM_THREADS"] == "1" and tokenizers_module._sp_threads == 1
        assert_batch_matches(tokenizer, texts)
        with pytest.raises(ConfigError, match=r"encoder threads must be at least 1, not 0"):
            limit_encoder_threads(0)


def test_tokenizers_pickle_and_encode_the_same(bpe_tokenizer_json, tmp_path, corpus):
    directory = save_pretrained_dir(tmp_path / "d", bpe_tokenizer_json, {"bos_token": "<s>", "add_bos_token": True})
    for spec in ("byte", bpe_tokenizer_json, directory, train_sentencepiece(tmp_path, corpus)):
        tokenizer = load_tokenizer(spec)
        copy = pickle.loads(pickle.dumps(tokenizer))
        assert (copy.name, copy.identity, copy.vocab_size, copy.eos_id, copy.bos_id) == (
            tokenizer.name,
            tokenizer.identity,
            tokenizer.vocab_size,
            tokenizer.eos_id,
            tokenizer.bos_id,
        )
        texts = [d for d in DOCUMENTS if d.strip()]
        assert [list(i) for i in copy.encode_batch(texts)] == [list(i) for i in tokenizer.encode_batch(texts)]
    # Files changed between pickling and unpickling would encode differently in the two processes: refused.
    pickled = pickle.dumps(load_tokenizer(directory))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "add_bos_token": False}, f)
    with pytest.raises(ConfigError, match=r"tokenizer '.*d' changed on disk since it was loaded; restart"):
        pickle.loads(pickled)


def write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return str(path)


@pytest.mark.parametrize(
    ("content", "reason"),
    [("{not json", r"key must be a string at line 1 column 2"), ('{"model": 1}', r"\S")],
)
def test_a_malformed_tokenizer_json_names_the_file_and_the_reason(tmp_path, content, reason):
    path = write(tmp_path / "tokenizer.json", content)
    with pytest.raises(ConfigError, match=rf"--tok: '.*tokenizer.json' is not a valid tokenizer.json \(.*{reason}"):
        load_tokenizer(path, "--tok")


def test_a_directory_without_a_tokenizer_is_refused(tmp_path):
    write(tmp_path / "config.json", "{}")
    with pytest.raises(ConfigError, match=r"--tok='.*' is a directory without tokenizer.json or tokenizer.model; give"):
        load_tokenizer(str(tmp_path), "--tok")


def test_an_eos_token_not_in_the_vocabulary_is_refused(bpe_tokenizer_json, tmp_path):
    directory = save_pretrained_dir(tmp_path / "m", bpe_tokenizer_json, {"eos_token": {"content": "<|eot|>"}})
    with pytest.raises(ConfigError, match=r"names eos_token '<\|eot\|>', which is not in its vocabulary; name a"):
        load_tokenizer(directory)


def test_a_tokenizer_json_without_an_end_of_document_token_is_refused(bpe_tokenizer_json, tmp_path):
    with open(bpe_tokenizer_json) as f:
        spec = json.load(f)
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] == "<pad>"]
    path = write(tmp_path / "tokenizer.json", json.dumps(spec))
    with pytest.raises(ConfigError, match=r"names no end-of-document token .*tokenizer_config.json names eos_token$"):
        load_tokenizer(path)
    directory = save_pretrained_dir(tmp_path / "fixed", path, {"eos_token": "<pad>"})  # the fix the message gives
    assert load_tokenizer(directory).eos_id == library(path).token_to_id("<pad>")


def test_a_bad_tokenizer_config_names_the_file(bpe_tokenizer_json, tmp_path):
    directory = save_pretrained_dir(tmp_path / "m", bpe_tokenizer_json)
    write(tmp_path / "m" / "tokenizer_config.json", "{oops")
    with pytest.raises(ConfigError, match=r"'.*tokenizer_config.json' is not readable JSON \(.*\); fix or remove it"):
        load_tokenizer(directory)


def test_tiktoken_files_are_not_supported(tmp_path):
    path = write(tmp_path / "cl100k_base.tiktoken", "IQ== 0\n")
    with pytest.raises(
        ConfigError, match=r"is a tiktoken BPE file, which is not supported .* convert it to a tokenizer"
    ):
        load_tokenizer(path)


def test_tokenizers_not_installed(bpe_tokenizer_json, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers then raises ImportError
    monkeypatch.setattr(tokenizers_module, "_LOADED", {})  # as in a fresh process: nothing loaded yet
    with pytest.raises(ConfigError, match=r"the tokenizers library is not installed; pip install tokenizers$"):
        load_tokenizer(bpe_tokenizer_json)
