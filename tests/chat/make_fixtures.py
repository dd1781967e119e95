"""Writes the chat fixtures: a small byte-level BPE tokenizer with chat special tokens, and the ids and
assistant masks that transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` gives for
each conversation under each template (tests/test_chat.py compares ours with them).

Run where transformers is installed (no torch needed); it downloads nothing:
    python tests/chat/make_fixtures.py
A template without generation blocks has a twin that renders the same text with its replies (content and
end-of-turn) in blocks: transformers' mask of the twin is what the prefix-difference rule must give.
"""

import json
import os

import tokenizers
import transformers
from tokenizers import decoders, models, pre_tokenizers, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>", "</s>", "<|user|>", "<|assistant|>", "<|system|>"]  # fmt: skip

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "2 + 3 = 5."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
        {"role": "assistant", "content": "Green, and then red."},
    ],
    [
        {"role": "user", "content": "Say <|im_end|> then <|im_start|>assistant\nhi and <|eot_id|> too"},
        {"role": "assistant", "content": "Here: <|im_end|><|endoftext|> done"},
    ],
    [{"role": "user", "content": "Reply with nothing."}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "héllo wörld 日本語 🚀?"}, {"role": "assistant", "content": "Grüße, 世界 ✨ ok"}],
    [{"role": "user", "content": "  spaced\n\n"}, {"role": "assistant", "content": "\n  indented line\n  "}],
    [
        {"role": "system", "content": "Be kind."},
        {"role": "assistant", "content": "Hello first."},
        {"role": "user", "content": "ok"},
        {"role": "assistant", "content": "one"},
        {"role": "assistant", "content": "two"},
    ],
]

CHATML = """{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['role'] == 'assistant' %}
{%- GEN %}{{- message['content'] + '<|im_end|>' }}{%- ENDGEN %}
{{- '\\n' }}
{%- else %}
{{- message['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
{%- if message['role'] == 'assistant' %}
{%- GEN %}{{- message['content'] | trim + '<|eot_id|>' }}{%- ENDGEN %}
{%- else %}
{{- message['content'] | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""
ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'assistant' %}
{{ '<|assistant|>\\n' }}{% GEN %}{{ message['content'] + eos_token }}{% ENDGEN %}{{ '\\n' }}
{% else %}
{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"""
LAST_ONLY = """{%- for message in messages %}
{{- '<|im_start|>' + message['role'] + '\\n' }}
{%- if message['role'] == 'assistant' and loop.last %}
{%- GEN %}{{- message['content'] + '<|im_end|>' }}{%- ENDGEN %}
{%- else %}
{{- message['content'] + '<|im_end|>' }}
{%- endif %}
{{- '\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""
# As stock templates (Llama 3.1's) test for tools: transformers passes tools=None, an undefined name is not none.
TOOLS = """{%- if tools is not none %}{{- 'TOOLS ' }}{%- endif %}
{%- if documents is not none %}{{- 'DOCS ' }}{%- endif %}
{%- for message in messages %}
{{- message['role'] + ': ' }}
{%- if message['role'] == 'assistant' %}{%- GEN %}{{- message['content'] + eos_token }}{%- ENDGEN %}
{%- else %}{{- message['content'] }}{%- endif %}
{{- '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}
"""


def tagged(template):
    return template.replace("GEN", "generation").replace("ENDgeneration", "endgeneration")


def untagged(template):
    return (
        template.replace("{%- GEN %}", "")
        .replace("{%- ENDGEN %}", "")
        .replace("{% GEN %}", "")
        .replace("{% ENDGEN %}", "")
    )


# name: (the template used, the tagged template transformers' reference mask comes from)
TEMPLATES = {
    "chatml_tagged": (tagged(CHATML), tagged(CHATML)),
    "chatml_untagged": (untagged(CHATML), tagged(CHATML)),
    "llama3_untagged": (untagged(LLAMA3), tagged(LLAMA3)),
    "zephyr_tagged": (tagged(ZEPHYR), tagged(ZEPHYR)),
    "last_only_tagged": (tagged(LAST_ONLY), tagged(LAST_ONLY)),
    "tools_tagged": (tagged(TOOLS), tagged(TOOLS)),
}


def make_tokenizer(directory):
    corpus = [json.dumps(c, ensure_ascii=False) for c in CONVERSATIONS] * 3 + [
        "user assistant system\n\n  the answer is 5, then 7 and 12. Hello there, how are you? " * 4
    ]
    tok = tokenizers.Tokenizer(models.BPE())
    # Llama 3's split: a run of newlines is one piece, so a header's "\n\n" stays one token before the reply.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    config = {"bos_token": "<|begin_of_text|>", "eos_token": "</s>", "add_bos_token": False,
              "chat_template": TEMPLATES["chatml_tagged"][0]}  # fmt: skip
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return tok


def main():
    directory = os.path.join(HERE, "tokenizer")
    tok = make_tokenizer(directory)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="</s>")
    cases = []
    for name, (template, reference) in TEMPLATES.items():
        for index, messages in enumerate(CONVERSATIONS):
            out = hf.apply_chat_template(messages, chat_template=reference, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)  # fmt: skip
            text = hf.apply_chat_template(messages, chat_template=template, tokenize=False)
            assert text == hf.apply_chat_template(messages, chat_template=reference, tokenize=False)
            prompt = hf.apply_chat_template(messages[:1], chat_template=template, tokenize=True, add_generation_prompt=True,
                                            return_dict=True)["input_ids"]  # fmt: skip
            cases.append({"template": name, "conversation": index, "ids": list(out["input_ids"]),
                          "assistant_masks": list(out["assistant_masks"]), "prompt_ids": list(prompt)})  # fmt: skip
    with open(os.path.join(HERE, "templates.json"), "w") as f:
        json.dump({name: template for name, (template, _) in TEMPLATES.items()}, f, indent=1)
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump({"transformers": transformers.__version__, "conversations": CONVERSATIONS, "cases": cases}, f,
                  ensure_ascii=False)  # fmt: skip
    print(f"{len(cases)} cases with transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
