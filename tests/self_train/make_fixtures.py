"""Writes the self-training fixtures (docs/post-training.md's example, tests/test_self_train.py): a
word-level tokenizer with the ChatML markers and the shipped ChatML template, chat conversations that
add three digits mod 10 (`add 3 4 5` → `= 2 .`), and disjoint training and held-out problems with a
task spec whose last number is compared. Deterministic; run from anywhere:
    python tests/self_train/make_fixtures.py
"""

import json
import os
import shutil

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "[UNK]")
WORDS = (*map(str, range(10)), "add", "=", ".", "user", "assistant")


def main() -> None:
    directory = os.path.join(HERE, "tokenizer")
    os.makedirs(directory, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel({t: i for i, t in enumerate((*SPECIALS, *WORDS))}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": SPECIALS[0], "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)
    shutil.copyfile(
        os.path.join(ROOT, "configs", "chat_templates", "chatml.jinja"), os.path.join(directory, "chat_template.jinja")
    )

    digits = [(i // 100, i // 10 % 10, i % 10) for i in range(1000)]
    order = sorted(
        digits, key=lambda d: (d[0] * 7 + d[1] * 3 + d[2] * 11) % 1000 + 1000 * ((d[0] + 2 * d[1] + 5 * d[2]) % 3)
    )
    parts = {"chat": order[:200], "train": order[200:264], "held": order[264:328]}

    def prompt(d: tuple[int, int, int]) -> str:
        return "add " + " ".join(map(str, d))

    with open(os.path.join(HERE, "chat.jsonl"), "w", encoding="utf-8") as f:
        for d in parts["chat"]:
            turns = [{"role": "user", "content": prompt(d)}, {"role": "assistant", "content": f"= {sum(d) % 10} ."}]
            f.write(json.dumps({"messages": turns}) + "\n")
    for name in ("train", "held"):
        with open(os.path.join(HERE, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for i, d in enumerate(parts[name]):
                f.write(json.dumps({"id": f"{name}-{i}", "question": prompt(d), "answer": str(sum(d) % 10)}) + "\n")
    spec = {"name": "adds", "description": "Three digits added mod 10, asked as a user turn; the last number of the "
            "reply is compared.", "fields": {"prompt": "question", "answer": "answer"}, "max_new_tokens": 6,
            "extract": {"kind": "last_number"}, "compare": "numeric"}  # fmt: skip
    with open(os.path.join(HERE, "adds.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=1)


if __name__ == "__main__":
    main()
