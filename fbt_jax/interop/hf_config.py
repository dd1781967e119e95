"""Hugging Face `config.json` ↔ `ModelConfig`, for the Llama family (Llama 3.x, SmolLM2,
TinyLlama, Mistral, Qwen2).

Reading accepts both conventions for rotary settings: `rope_theta` + `rope_scaling` (what
checkpoints on the hub carry) and `rope_parameters` (what transformers 5 writes). Anything the
model here does not compute (another activation, MoE, a rotary scaling we do not implement,
per-layer sliding windows) is refused by name before any weight is read. Writing starts from the
imported model's own config.json when the run has one, so fields we do not model (token ids,
`max_position_embeddings`, `initializer_range`, …) survive the round trip unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fbt_jax.errors import ConfigError
from fbt_jax.model import ModelConfig

# Hugging Face class name → model_type.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
# Keys that mean a mixture of experts, whatever the architecture says.
MOE_KEYS = ("num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size")


class Refused(ConfigError):
    """A model directory asks for something fbt-jax does not load (named in the message)."""


def architecture_of(hf: dict[str, Any], where: str) -> str:
    names = hf.get("architectures") or []
    supported = ", ".join(ARCHITECTURES)
    if len(names) != 1 or names[0] not in ARCHITECTURES:
        raise Refused(
            f"{where}: architecture {names or hf.get('model_type')!r} is not supported; fbt-import reads {supported}"
        )
    return names[0]


def read_rope(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """The rotary fields of ModelConfig from either convention."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        distinct = {repr(sorted(v.items())) for v in params.values()}  # one entry per layer type
        if len(distinct) > 1:
            raise Refused(f"{where}: rotary parameters differ between layer types ({sorted(params)}); not supported")
        params = next(iter(params.values()))
    scaling = params if params is not None else (hf.get("rope_scaling") or {})
    theta = (params or {}).get("rope_theta", hf.get("rope_theta", 10_000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if float(hf.get("partial_rotary_factor", scaling.get("partial_rotary_factor", 1.0))) != 1.0:
        raise Refused(f"{where}: partial_rotary_factor != 1 (rotary on part of each head) is not supported")
    fields: dict[str, Any] = {"rope_theta": float(theta)}
    if kind == "default":
        return fields
    if kind not in ("linear", "llama3"):
        raise Refused(
            f"{where}: rotary scaling {kind!r} is not supported (default, linear and llama3 are); "
            "import a checkpoint without it or add it to fbt_jax/layers.py Rope"
        )
    fields |= {"rope_scaling": kind, "rope_scaling_factor": float(scaling["factor"])}
    if kind == "llama3":
        fields |= {
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_max_positions": int(scaling["original_max_position_embeddings"]),
        }
    return fields


def model_config_from_hf(hf: dict[str, Any], where: str) -> ModelConfig:
    """The ModelConfig computing what the Hugging Face model computes (fp32 parameters, no logit
    scale), or Refused naming the first feature it lacks."""
    arch = architecture_of(hf, where)
    for key in MOE_KEYS:
        if hf.get(key):
            raise Refused(f"{where}: {key}={hf[key]} (a mixture of experts) is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise Refused(f"{where}: hidden_act={hf['hidden_act']!r} is not supported; the MLP here is SwiGLU (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise Refused(f"{where}: {key}=true is not supported (only Qwen2's q/k/v biases are)")
    window = 0
    if arch == "MistralForCausalLM":
        window = int(hf.get("sliding_window") or 0)
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
        raise Refused(f"{where}: use_sliding_window=true (windows on some layers only) is not supported")
    try:
        embed_dim, num_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or embed_dim // num_heads)
        cfg = ModelConfig(
            vocab_size=int(hf["vocab_size"]),
            embed_dim=embed_dim,
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            mlp_dim=int(hf["intermediate_size"]),
            head_dim=0 if head_dim * num_heads == embed_dim else head_dim,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            sliding_window=window,
            qkv_bias=arch == "Qwen2ForCausalLM",
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            scale_logits=False,
            **read_rope(hf, where),
        )
    except KeyError as err:
        raise Refused(f"{where}: config.json lacks {err.args[0]!r}; is this a complete model directory?") from None
    cfg.check()
    return cfg


def export_architecture(cfg: ModelConfig, source: dict[str, Any] | None) -> str:
    """The Hugging Face class of a model: the one it was imported from, else the one that has its
    features; ConfigError when none does."""
    if cfg.qkv_bias and (cfg.sliding_window or cfg.head_dim):
        raise ConfigError(
            "this model has no Hugging Face counterpart: q/k/v biases exist only in Qwen2, which has neither a "
            "sliding window on every layer nor an explicit head_dim; export a model without one of them"
        )
    wanted = "Qwen2ForCausalLM" if cfg.qkv_bias else "MistralForCausalLM" if cfg.sliding_window else "LlamaForCausalLM"
    if not source:
        return wanted
    arch = architecture_of(source, "the run's recorded Hugging Face config (hf_config)")
    if wanted != "LlamaForCausalLM" and arch != wanted:
        raise ConfigError(f"this model needs {wanted} (q/k/v biases or a sliding window), but it came from {arch}")
    return arch


def _template(arch: str) -> dict[str, Any]:
    """What transformers writes for a fresh config of `arch` (5.x, fields we do not model at
    their defaults)."""
    out: dict[str, Any] = {
        "architectures": [arch],
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": "float32",
        "eos_token_id": None,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "max_position_embeddings": 2048,
        "model_type": ARCHITECTURES[arch],
        "pad_token_id": None,
        "rope_parameters": {},
        "use_cache": True,
    }
    if arch == "LlamaForCausalLM":
        out |= {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "head_dim": 0}
    if arch == "MistralForCausalLM":
        out |= {"head_dim": 0, "sliding_window": None}
    if arch == "Qwen2ForCausalLM":
        out |= {"layer_types": [], "max_window_layers": 28, "sliding_window": None, "use_sliding_window": False}
    return out


def hf_config_from_model(
    cfg: ModelConfig, source: dict[str, Any] | None, dtype: str, fresh: dict[str, Any]
) -> dict[str, Any]:
    """config.json for `cfg`: the source's own config with every field we model rewritten (so an
    imported model exports the config it came with), or the architecture's fresh one with the
    fields in `fresh` (token ids, context)."""
    arch = export_architecture(cfg, source)
    out = dict(source) if source else _template(arch) | fresh
    # A run that trained at a longer context than its source declared (a long-context phase) says so.
    longer = int(fresh.get("max_position_embeddings") or 0)
    if source and longer > int(out.get("max_position_embeddings") or 0):
        out["max_position_embeddings"] = longer
    out |= {
        "architectures": [arch],
        "model_type": ARCHITECTURES[arch],
        "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.mlp_dim,
        "num_attention_heads": cfg.num_heads,
        "num_hidden_layers": cfg.num_layers,
        "num_key_value_heads": cfg.num_kv_heads,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "vocab_size": cfg.vocab_size,
    }
    if "head_dim" in out or cfg.head_dim:
        out["head_dim"] = cfg.head_size
    if arch == "MistralForCausalLM":
        out["sliding_window"] = cfg.sliding_window or None
    if "layer_types" in out:
        out["layer_types"] = ["full_attention"] * cfg.num_layers
    out["torch_dtype" if "torch_dtype" in out else "dtype"] = dtype
    rope = _rope_parameters(cfg)
    if "rope_parameters" in out or not source:
        out["rope_parameters"] = rope
    else:  # the older convention, as the source had it
        out["rope_theta"] = rope.pop("rope_theta")
        kind = rope.pop("rope_type")
        out["rope_scaling"] = None if kind == "default" else {"rope_type": kind, **rope}
    return dict(sorted(out.items()))


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling == "linear":
        out |= {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling == "llama3":
        out |= {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_positions,
        }
    return dict(sorted(out.items()))


# The fields a Hugging Face config determines (the rest are fbt's own: fusion, dtypes, logit scale, …).
STANDARD_FIELDS = (
    "vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "mlp_dim", "rope_theta", "rope_scaling",
    "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_positions",
    "sliding_window", "qkv_bias", "tie_embeddings", "norm_eps",
)  # fmt: skip


def standard_fields(cfg: ModelConfig) -> dict[str, Any]:
    fields = dataclasses.asdict(cfg)
    return {"head_size": cfg.head_size, **{k: fields[k] for k in STANDARD_FIELDS}}
