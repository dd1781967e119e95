"""Writes the Hugging Face reference fixtures under tests/interop/reference/ (run by hand, never by the tests).

Each fixture is a tiny random checkpoint saved by transformers' own `save_pretrained` (config.json, safetensors
weights, and for `llama` a tokenizer) plus `reference_logits.safetensors`: the logits the transformers
implementation itself gives on fixed tokens. The JAX importer is tested against these files alone, so torch and
transformers stay out of the project's dependencies (and out of its test environment): they are needed only to
rerun this script, in a separate virtual environment.

Run from the repository root:

    /work/refvenv/bin/python tests/interop/make_reference.py [NAME ...]   # all fixtures, or those named

Last run with Python 3.11.7, torch 2.13.0 (CPU), transformers 5.24.0, safetensors 0.8.0, tokenizers 0.23.3
(the script also writes these into tests/interop/reference/versions.json). With these versions a rerun writes
byte-identical files; other versions may change the bytes (and the saved config.json layout).

Per model directory:
    config.json, generation_config.json, model.safetensors (or shards + model.safetensors.index.json)
    reference_logits.safetensors: tokens (int32, (2, 13)), logits (float32, (2, 13, vocab)) and
        logits_prefix (float32, (1, 7, vocab)) = the logits of tokens[:1, :7] alone.
"""

from __future__ import annotations

import json
import platform
import shutil
from collections.abc import Callable
from pathlib import Path

import safetensors
import tokenizers
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

OUT = Path(__file__).resolve().parent / "reference"
BATCH, SEQ, PREFIX = 2, 13, 7  # 13 is odd on purpose (no accidental power-of-two shapes); 7 is a shorter prompt
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

# A few paragraphs of plain English: enough for 128 - 2 special tokens of byte-level alphabet and merges.
TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. The dog does not seem to mind; it has seen the fox before.",
    "A transformer reads a sequence of tokens and predicts the next one. Each layer mixes information across "
    "positions with attention, then transforms every position on its own with a small feed-forward network.",
    "Rotary position embeddings rotate pairs of query and key features by an angle that grows with the position, "
    "so that the dot product between a query and a key depends only on how far apart they are.",
    "In the morning the market was quiet. By noon the stalls were full of apples, pears, bread and cheese, and the "
    "square rang with the voices of people buying, selling and talking about the weather.",
    "She wrote the numbers down carefully: one, two, three, four, five. Then she checked them twice, because a "
    "small mistake at the start of a long calculation can spoil everything that follows.",
]


def train_tokenizer(directory: Path) -> tuple[int, int]:
    """Trains a 128-entry byte-level BPE, saves it as a transformers tokenizer; returns the (bos, eos) ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # No initial alphabet: all 256 byte symbols would not fit in 128 entries, so the alphabet is the bytes seen.
    trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=[BOS, EOS], show_progress=False)
    tok.train_from_iterator(TOKENIZER_TEXT, trainer=trainer)
    assert tok.get_vocab_size() == 128, tok.get_vocab_size()
    bos_id, eos_id = tok.token_to_id(BOS), tok.token_to_id(EOS)
    # Like Llama 3's tokenizer.json: encoding prepends <|begin_of_text|>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    wrapped.save_pretrained(directory)
    return bos_id, eos_id


def redraw_parameters(model: PreTrainedModel, seed: int) -> None:
    """Replaces transformers' std-0.02 init (near-zero logits) with draws that give logits of order 1 or more."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # Sorted names fix the draw order; named_parameters lists a tied lm_head once (as embed_tokens).
        for name, param in sorted(model.named_parameters()):
            if name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
                new = torch.randn(param.shape, generator=gen)
            elif name.endswith("norm.weight"):  # RMSNorm scales away from 1 so that a missing scale shows
                new = 0.5 + torch.rand(param.shape, generator=gen)
            elif name.endswith(".bias"):
                new = 0.3 * torch.randn(param.shape, generator=gen)
            elif param.ndim == 2:  # nn.Linear weight (out, in): unit-variance outputs for unit-variance inputs
                new = torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5
            else:
                raise ValueError(f"no rule to redraw parameter {name} {tuple(param.shape)}")
            param.copy_(new)


def logits_of(model: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    """The float32 logits transformers gives for `tokens` (no padding, no attention mask)."""
    with torch.no_grad():
        return model(input_ids=tokens.long()).logits.float()


def build(
    name: str,
    config_cls: type[PretrainedConfig],
    model_cls: type[PreTrainedModel],
    config_kwargs: dict,
    seed: int,
    save_kwargs: dict | None = None,
    with_tokenizer: bool = False,
    feature_off: dict | None = None,
) -> dict:
    """Builds, re-draws, saves and checks one model; returns what the report prints."""
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)  # stale shards from an earlier run must not survive
    directory.mkdir(parents=True)
    if with_tokenizer:
        bos_id, eos_id = train_tokenizer(directory)
        config_kwargs = {**config_kwargs, "bos_token_id": bos_id, "eos_token_id": eos_id}

    config = config_cls(**config_kwargs, dtype="float32")
    torch.manual_seed(seed)
    model = model_cls._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    redraw_parameters(model, seed + 1)

    vocab = config.vocab_size
    tokens = torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed + 2))
    tokens = tokens.to(torch.int32)
    logits = logits_of(model, tokens)
    logits_prefix = logits_of(model, tokens[:1, :PREFIX])
    assert logits.shape == (BATCH, SEQ, vocab) and logits_prefix.shape == (1, PREFIX, vocab)

    model.save_pretrained(directory, **(save_kwargs or {}))
    # Contiguous copies: safetensors refuses views of a larger tensor.
    save_file(
        {"tokens": tokens.contiguous(), "logits": logits.contiguous(), "logits_prefix": logits_prefix.contiguous()},
        directory / "reference_logits.safetensors",
    )

    # The saved directory alone must reproduce the logits bit for bit (same kernels, same weights).
    reloaded = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)
    reloaded.eval()
    assert torch.equal(logits_of(reloaded, tokens), logits), f"{name}: reloaded logits differ"
    assert torch.equal(logits_of(reloaded, tokens[:1, :PREFIX]), logits_prefix), f"{name}: reloaded prefix differs"

    # The feature this fixture is for (rope scaling, sliding window) must change the logits, or the test could
    # pass against an importer that ignores it: same weights, config with the feature off.
    feature_effect = None
    if feature_off is not None:
        plain = model_cls._from_config(
            config_cls(**{**config_kwargs, **feature_off}, dtype="float32"), attn_implementation="eager"
        ).eval()
        plain.load_state_dict(model.state_dict())
        feature_effect = (logits_of(plain, tokens) - logits).abs().max().item()
        assert feature_effect > 1e-2, f"{name}: {feature_off} leaves the logits unchanged ({feature_effect})"

    return {
        "name": name,
        "logits_std": logits.std().item(),
        # Causal attention: the prefix logits are the first row's first 7 positions, up to summation order.
        "prefix_vs_full_max_abs": (logits_prefix[0] - logits[0, :PREFIX]).abs().max().item(),
        "tokens": tokens.tolist(),
        "feature_effect": feature_effect,
    }


EXTENDED_VOCAB, LONG_SEQ = 130, 40  # two new tokens; a batch longer than the 16 original positions


def build_extended() -> dict:
    """`llama` after a new phase as fbt-jax makes one (`init_from`, docs/post-training.md): its weights,
    two new tokens whose embedding rows are the mean of the 128 old rows (computed in float64), and a
    longer context (rope_theta 2,000,000; llama3 factor 16 over 16 original positions; 128 positions).
    Saved with transformers' logits on a 2 × 40 batch holding the new tokens: what transformers computes
    from such a config, which fbt-export must write for an extended run."""
    directory = OUT / "llama_extended"
    shutil.rmtree(directory, ignore_errors=True)
    base = LlamaForCausalLM.from_pretrained(OUT / "llama", attn_implementation="eager", dtype=torch.float32)
    state = base.state_dict()
    old = state["model.embed_tokens.weight"]
    mean = old.double().mean(dim=0).float()
    state["model.embed_tokens.weight"] = torch.cat([old, mean.expand(EXTENDED_VOCAB - old.shape[0], -1)])
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied
    rope = {"rope_type": "llama3", "rope_theta": 2000000.0, "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    config = LlamaConfig(**{**base.config.to_dict(), "vocab_size": EXTENDED_VOCAB, "rope_parameters": rope,
                            "max_position_embeddings": 128})  # fmt: skip
    model = LlamaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    model.load_state_dict(state)
    tokens = torch.randint(0, EXTENDED_VOCAB, (BATCH, LONG_SEQ), generator=torch.Generator().manual_seed(7))
    tokens[:, 5], tokens[:, 30] = 128, 129  # the new tokens at a short and a long position
    tokens = tokens.to(torch.int32)
    logits = logits_of(model, tokens)
    model.save_pretrained(directory)
    save_file(
        {"tokens": tokens.contiguous(), "logits": logits.contiguous()}, directory / "reference_logits.safetensors"
    )
    reloaded = AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", dtype=torch.float32)
    assert torch.equal(logits_of(reloaded.eval(), tokens), logits), "llama_extended: reloaded logits differ"
    # The new rotary settings must change the logits, or the test could pass against an export that drops them.
    before = LlamaForCausalLM._from_config(LlamaConfig(**{**config.to_dict(), "rope_parameters": base.config.rope_parameters}),
                                           attn_implementation="eager", dtype=torch.float32).eval()  # fmt: skip
    before.load_state_dict(state)
    effect = (logits_of(before, tokens) - logits).abs().max().item()
    assert effect > 1e-2, f"llama_extended: the rotary change leaves the logits unchanged ({effect})"
    return {"name": "llama_extended", "logits_std": logits.std().item(), "prefix_vs_full_max_abs": 0.0,
            "tokens": tokens.tolist(), "feature_effect": effect}  # fmt: skip


def weight_keys(directory: Path) -> dict[str, dict[str, list[int]]]:
    """Tensor names and shapes of every weight file, by file name."""
    out = {}
    for path in sorted(directory.glob("model*.safetensors")):
        with safe_open(path, framework="pt") as f:
            out[path.name] = {key: list(f.get_slice(key).get_shape()) for key in sorted(f.keys())}
    return out


def main(only: list[str]) -> None:
    """Write every fixture, or those named on the command line (each rewritten whole)."""
    OUT.mkdir(exist_ok=True)
    small = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 48}
    specs: list[tuple[str, Callable[[], dict]]] = [
        (
            "llama",
            lambda: build(
                "llama",
                LlamaConfig,
                LlamaForCausalLM,
                {
                    **small,
                    "num_key_value_heads": 2,
                    "vocab_size": 128,
                    "tie_word_embeddings": True,
                    "rms_norm_eps": 1e-5,
                    "max_position_embeddings": 64,
                    # original_max_position_embeddings 8: wavelengths (2*pi ... ) straddle 8/4 and 8/1, so the
                    # llama3 rule both smooths and divides frequencies already at positions 0..12.
                    "rope_parameters": {
                        "rope_type": "llama3",
                        "rope_theta": 500000.0,
                        "factor": 8.0,
                        "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8,
                    },
                },
                seed=1,
                with_tokenizer=True,
                feature_off={"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
            ),
        ),
        (
            "llama_untied",
            lambda: build(
                "llama_untied",
                LlamaConfig,
                LlamaForCausalLM,
                {
                    **small,
                    "num_key_value_heads": 4,
                    "head_dim": 16,  # heads * head_dim = 64 != hidden 32
                    "vocab_size": 96,
                    "tie_word_embeddings": False,
                    "max_position_embeddings": 64,
                    "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                },
                seed=2,
                # About 140 KB of weights: 60KB shards give several files and an index.
                save_kwargs={"max_shard_size": "60KB"},
                feature_off={"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
            ),
        ),
        (
            "mistral",
            lambda: build(
                "mistral",
                MistralConfig,
                MistralForCausalLM,
                {
                    **small,
                    "num_key_value_heads": 1,
                    "head_dim": 8,
                    "vocab_size": 96,
                    "tie_word_embeddings": False,
                    "max_position_embeddings": 64,
                    "sliding_window": 5,  # shorter than the 13-token prompt, so the window masks keys
                    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                },
                seed=3,
                feature_off={"sliding_window": None},
            ),
        ),
        (
            "qwen2",
            lambda: build(
                "qwen2",
                Qwen2Config,
                Qwen2ForCausalLM,
                {
                    **small,
                    "num_key_value_heads": 2,
                    "vocab_size": 96,
                    "tie_word_embeddings": True,
                    "rms_norm_eps": 1e-6,
                    "max_position_embeddings": 64,
                    "use_sliding_window": False,
                    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                },
                seed=4,
            ),
        ),
        ("llama_extended", build_extended),  # after llama: its weights
    ]
    specs = [(name, run) for name, run in specs if not only or name in only]

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "tokenizers": tokenizers.__version__,
    }
    (OUT / "versions.json").write_text(json.dumps(versions, indent=2) + "\n")
    print("versions:", json.dumps(versions))

    for name, run in specs:
        summary = run()
        directory = OUT / name
        print(f"\n===== {name} =====")
        print(
            f"logits std {summary['logits_std']:.4f}, prefix vs full max |diff| {summary['prefix_vs_full_max_abs']:.2e}"
        )
        print("tokens:", summary["tokens"])
        if summary["feature_effect"] is not None:
            print(f"max |logits change| with the fixture's feature turned off: {summary['feature_effect']:.3f}")
        for path in sorted(directory.iterdir()):
            print(f"  {path.name}: {path.stat().st_size} bytes")
        print("config.json:")
        print((directory / "config.json").read_text())
        for file_name, keys in weight_keys(directory).items():
            print(f"{file_name}:")
            for key, shape in keys.items():
                print(f"  {key} {shape}")
        if (directory / "tokenizer.json").exists():
            tok = AutoTokenizer.from_pretrained(directory)
            text = "The fox reads the tokens."
            ids = tok(text)["input_ids"]
            print(f"tokenizer {type(tok).__name__}: bos {tok.bos_token_id} eos {tok.eos_token_id}; {text!r} -> {ids}")
            print("decoded:", repr(tok.decode(ids)))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
