"""Chat data: ids and trained tokens equal transformers' on the same templates and tokenizer
(tests/chat/expected.json, made by tests/chat/make_fixtures.py with transformers), the refusals, `--show`,
and prepared chat records: trained flags as loss weights and fuse flags, one segment per reply."""

import json
import os

import numpy as np
import pytest

from fbt_jax.data.chat import ChatTemplate, chat_template
from fbt_jax.data.conversations import ConversationEncoder, settings
from fbt_jax.data.packing import pack_documents, records_to_examples
from fbt_jax.data.tokenizers import ByteTokenizer, HuggingFaceTokenizer
from fbt_jax.errors import ConfigError

HERE = os.path.join(os.path.dirname(__file__), "chat")
EXPECTED = json.load(open(os.path.join(HERE, "expected.json"), encoding="utf-8"))
TEMPLATES = json.load(open(os.path.join(HERE, "templates.json"), encoding="utf-8"))
# The one case the prefix-difference rule refuses: the reply starts with "\n" after the header's "\n", and the
# two newlines are one token of the whole render but not of the prompt (serving would read other ids).
REFUSED = {("chatml_untagged", 5)}


@pytest.fixture(scope="module")
def tokenizer():
    return HuggingFaceTokenizer(os.path.join(HERE, "tokenizer"))


@pytest.mark.parametrize("case", EXPECTED["cases"], ids=lambda c: f"{c['template']}-{c['conversation']}")
def test_ids_and_trained_tokens_equal_transformers(tokenizer, case):
    """Tagged templates: the mask is transformers' assistant_masks. Untagged ones: the prefix-difference
    rule gives what transformers gives on a twin template whose replies (content, end-of-turn) are
    generation blocks. Ids are apply_chat_template's, special-token text in content included, and so are
    the prompt ids fbt-serve renders for a chat completion."""
    template = ChatTemplate(TEMPLATES[case["template"]], tokenizer)
    messages = EXPECTED["conversations"][case["conversation"]]
    assert template.encode(messages[:1]) == case["prompt_ids"]
    if (case["template"], case["conversation"]) in REFUSED:
        with pytest.raises(ConfigError, match="not a prefix of the whole's"):
            template.conversation(messages)
        return
    conversation = template.conversation(messages)
    assert conversation.ids.tolist() == case["ids"]
    assert conversation.trained.tolist() == case["assistant_masks"]
    for start, end in conversation.replies:  # each reply ends with the end-of-turn the model must write
        assert conversation.ids[end - 1] in tokenizer.special_ids and conversation.trained[start:end].all()


def test_transformers_live_on_random_conversations(tokenizer):
    """Where transformers is installed: random conversations (special-token text, unicode, empty replies,
    several turns) under every tagged template, ours against apply_chat_template's."""
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the stored cases ran)")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(HERE, "tokenizer", "tokenizer.json"),
        bos_token="<|begin_of_text|>",
        eos_token="</s>",
    )
    rng = np.random.default_rng(0)
    words = ["hi", "<|im_end|>", "日本", "🚀", "\n", "  ", "</s>", "2+2", "<|eot_id|>", "", "é", "ok."]
    for name in ("chatml_tagged", "zephyr_tagged"):
        template = ChatTemplate(TEMPLATES[name], tokenizer)
        for _ in range(20):
            turns = int(rng.integers(1, 4))
            messages = [{"role": "system", "content": "sys " + str(rng.choice(words))}] if rng.random() < 0.5 else []
            for _ in range(turns):
                for role in ("user", "assistant"):
                    content = "".join(rng.choice(words, size=int(rng.integers(0, 5))))
                    messages.append({"role": role, "content": content})
            out = tok.apply_chat_template(messages, chat_template=TEMPLATES[name], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)  # fmt: skip
            ours = template.conversation(messages)
            assert ours.ids.tolist() == list(out["input_ids"])
            assert ours.trained.tolist() == list(out["assistant_masks"])


@pytest.mark.parametrize(
    "messages, error",
    [
        ([], "not a non-empty list"),
        ([{"role": "user", "content": "hi"}], "no assistant message"),
        ([{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}], "role 'tool'"),
        ([{"role": "user"}, {"role": "assistant", "content": "y"}], "no 'content' string"),
        ("hello", "not a non-empty list"),
    ],
)
def test_bad_conversations_are_one_line_naming_the_record(tokenizer, messages, error):
    template = ChatTemplate(TEMPLATES["chatml_tagged"], tokenizer)
    with pytest.raises(ConfigError, match=error) as info:
        template.conversation(messages, "data.jsonl:7")
    assert str(info.value).startswith("data.jsonl:7: ") and "\n" not in str(info.value)


def test_a_template_that_marks_nothing_is_refused_not_trained_on_silently(tokenizer):
    """The last-reply template tags only a final assistant message: a conversation ending with the user's
    turn has nothing tagged (transformers: an all-zero mask, silently)."""
    template = ChatTemplate(TEMPLATES["last_only_tagged"], tokenizer)
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    with pytest.raises(ConfigError, match="marks no token of it as the assistant's"):
        template.conversation(messages, "r:1")


def test_chat_needs_a_template_and_a_hugging_face_tokenizer(tokenizer, tmp_path):
    with pytest.raises(ConfigError, match="needs a Hugging Face tokenizer"):
        ChatTemplate(TEMPLATES["chatml_tagged"], ByteTokenizer())
    with pytest.raises(ConfigError, match="needs a chat template"):
        settings("chat", ByteTokenizer())
    with pytest.raises(ConfigError, match="cannot be read"):
        chat_template(tokenizer, str(tmp_path / "missing.jinja"))
    assert chat_template(tokenizer) == TEMPLATES["chatml_tagged"]  # the tokenizer's own


def test_markers_the_tokenizer_lacks_are_refused_until_added_to_a_copy_of_it(tmp_path, capsys):
    """A ChatML template over a tokenizer without <|im_start|> / <|im_end|> would train them as pieces:
    refused, naming them and the command. fbt-train-tokenizer --from adds them after the last id, keeps
    the other files and saves the template; the copy renders, and the reply ends at <|im_end|>."""
    from fbt_jax.data import train_tokenizer

    bare = os.path.join(os.path.dirname(__file__), "interop", "reference", "llama")  # bos/eos, no markers
    chatml = TEMPLATES["chatml_tagged"]
    with pytest.raises(ConfigError, match=r"writes <\|im_end\|>, <\|im_start\|>, which the tokenizer has no token"):
        ChatTemplate(chatml, HuggingFaceTokenizer(bare))
    (tmp_path / "chatml.jinja").write_text(chatml)
    out = str(tmp_path / "extended")
    argv = [
        f"--from={bare}",
        "--add-special-tokens=<|im_start|>,<|im_end|>",
        f"--chat-template={tmp_path / 'chatml.jinja'}",
    ]
    train_tokenizer.main([*argv, f"--output={out}"])
    assert "added <|im_start|>, <|im_end|>" in capsys.readouterr().out
    extended = HuggingFaceTokenizer(out)
    assert extended.encode_plain("<|im_start|><|im_end|>") == [128, 129] and extended.vocab_size == 130
    assert extended.eos_id == HuggingFaceTokenizer(bare).eos_id and chat_template(extended) == chatml
    template = ChatTemplate(chat_template(extended), extended)
    assert template.end_of_turn_ids == (129,)
    conversation = template.conversation([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert conversation.ids[conversation.replies[0][1] - 1] == 129
    for bad, said in [
        ([*argv, f"--output={out}"], "must be a new local directory"),
        ([f"--from={bare}", f"--output={tmp_path / 'x'}"], "name what to add"),
        ([f"--from={bare}", "--input=x", f"--output={tmp_path / 'x'}"], "not both or neither"),
    ]:
        with pytest.raises(SystemExit):
            train_tokenizer.main(bad)
        assert said in capsys.readouterr().err


def _prepared(encoder, conversations):
    docs = encoder.encode_batch([(f"r:{i}", {"messages": m}) for i, m in enumerate(conversations)])
    return records_to_examples(np.stack(list(pack_documents(docs, 48, 3))))


def test_split_turns_train_each_reply_in_its_own_segment_read_plainly_before_it(tokenizer):
    """Two replies: two segments, the first ending at reply 1's end-of-turn, the second the whole
    conversation with only reply 2 trained. A target weighs where the token is trained; an input is fused
    where it is trained (the reply's tokens, from its first on)."""
    chat = settings("chat", tokenizer)
    conversation = EXPECTED["conversations"][1]
    encoder = ConversationEncoder(chat, tokenizer, 200)
    whole = encoder.render("r", {"messages": conversation})
    (first, end1), (second, end2) = whole.replies
    docs = encoder.documents("r", {"messages": conversation})
    assert [d.shape[1] for d in docs] == [end1, end2]
    assert docs[0][1].tolist() == whole.trained[:end1].tolist()
    assert docs[1][1, :first].sum() == 0 and docs[1][1, second:end2].all()
    examples = records_to_examples(np.stack(list(pack_documents(docs, 200, 3))))
    trained = np.concatenate([d[1] for d in docs])
    n = trained.size
    assert examples["fuse"][0, : n - 1].tolist() == trained[:-1].tolist()
    weights = examples["weights"][0]
    segment_end = end1 - 1  # the last token of segment 1 predicts nothing (the next segment starts)
    expected = trained[1:].astype(np.float32)
    expected[segment_end] = 0.0
    assert weights[: n - 1].tolist() == expected.tolist() and weights[n - 1 :].sum() == 0
    joint = ConversationEncoder({**chat, "turns": "joint"}, tokenizer, 200).documents("r", {"messages": conversation})
    assert len(joint) == 1 and joint[0][1].tolist() == whole.trained.tolist()


def test_over_long_conversations_are_dropped_or_truncated_and_counted(tokenizer):
    long = [{"role": "user", "content": "x " * 4}, {"role": "assistant", "content": "y " * 60}]
    short = EXPECTED["conversations"][0]
    dropped = ConversationEncoder(settings("chat", tokenizer), tokenizer, 47)
    assert len(dropped.encode_batch([("a", {"messages": long}), ("b", {"messages": short})])) == 1
    assert (dropped.counts.conversations, dropped.counts.dropped, dropped.counts.truncated) == (2, 1, 0)
    cut = ConversationEncoder(settings("chat", tokenizer, overlong="truncate"), tokenizer, 47)
    docs = cut.encode_batch([("a", {"messages": long})])
    assert docs[0].shape == (2, 48) and cut.counts.truncated == 1


def test_prompt_completion_without_a_template_is_prompt_then_completion_and_eos():
    """A base model's tokenizer (no template): the prompt as fbt-decode reads it, the completion's own ids
    and the end of document, trained on the completion and the end."""
    tok = ByteTokenizer()
    encoder = ConversationEncoder(settings("prompt-completion", tok), tok, 64)
    conversation = encoder.render("r:1", {"prompt": "2+3=", "completion": "5"})
    assert conversation.ids.tolist() == [*b"2+3=", *b"5", tok.eos_id]
    assert conversation.trained.tolist() == [0, 0, 0, 0, 1, 1]
    with pytest.raises(ConfigError, match="'completion' is int"):
        encoder.render("r:2", {"prompt": "a", "completion": 3})


def test_show_prints_what_is_trained_and_writes_nothing(tokenizer, tmp_path, capsys):
    from fbt_jax.data.prepare import main

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in EXPECTED["conversations"][:3]))
    out = tmp_path / "out"
    main([f"--input={data}", f"--output={out}", "--seq-len=64", f"--tokenizer={HERE}/tokenizer", "--format=chat",
          "--show=2"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    template = ChatTemplate(TEMPLATES["chatml_tagged"], tokenizer)
    for line, messages in zip(lines[:2], EXPECTED["conversations"]):
        conversation = template.conversation(messages)
        assert json.loads(line) == {"ids": conversation.ids.tolist(), "loss_weights": conversation.trained.tolist()}
    assert "⟦2 + 3 = 5.<|im_end|>⟧" in "\n".join(lines[2:])
    assert not out.exists()


def test_chat_files_train_through_data_source_text_with_their_settings_checked_first(tmp_path):
    """data.format=chat on jsonl files: the plan carries the chat settings, and the records prepared on
    first use are chat records; bad settings are one line naming the config field."""
    from conftest import load_config

    from fbt_jax.data.pipeline import make_source
    from fbt_jax.data.plan import plan_data

    config = load_config("tiny")
    config.workdir = str(tmp_path / "run")
    config.data.source, config.data.path = "text", os.path.join(HERE, "sample.jsonl")
    config.data.format, config.data.tokenizer, config.data.seq_len = "chat", os.path.join(HERE, "tokenizer"), 128
    config.data.validation_fraction = 0.1
    plan = plan_data(config)
    assert dict(plan.chat)["template"] == TEMPLATES["chatml_tagged"] and dict(plan.chat)["turns"] == "split"
    source = make_source(plan, "train")
    examples = source.examples(np.arange(4))
    assert source.chat and set(examples["fuse"].ravel()) <= {0, 1} and examples["fuse"].any()
    assert np.array_equal(
        examples["weights"][:, :-1] > 0, (examples["fuse"][:, 1:] > 0) & (examples["weights"][:, :-1] > 0)
    )
    for field, value, error in [("format", "chats", "data.format='chats' is not one of"),
                                ("turns", "each", "data.turns='each' is not one of"),
                                ("fields", "a,b,c", "data.fields='a,b,c'")]:  # fmt: skip
        bad = load_config("tiny")
        bad.data.update(source="text", path=config.data.path, format="chat", tokenizer=config.data.tokenizer)
        bad.data[field] = value
        with pytest.raises(ConfigError, match=error):
            plan_data(bad)


@pytest.mark.parametrize(
    "name, end", [("chatml_tagged", "<|im_end|>"), ("zephyr_tagged", "</s>"), ("llama3_untagged", "<|eot_id|>")]
)
def test_a_served_reply_stops_at_the_templates_end_of_turn(tokenizer, name, end):
    """fbt-serve stops a chat completion where the tuned model writes the end-of-turn its template ends replies with."""
    assert ChatTemplate(TEMPLATES[name], tokenizer).end_of_turn_ids == (tokenizer._tok.token_to_id(end),)
