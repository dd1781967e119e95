"""The Full-Bandwidth Transformer: its config, the pre-norm block and the stack F (docs/method.md §2).

`FBTransformer` owns every parameter: the tied embedding table, L pre-norm blocks, the final
RMSNorm and the fusion (the only new parameters). It exposes the pieces the K-pass objective
(`feedback.py`), decoding and evaluation compose, rather than one opaque `__call__`:

    e_BTD = model.embed(tokens_BT)              # e_t = E[x_t]
    h_BTD = model.stack(u_BTD, positions_BT)    # H = F(U): blocks + final norm
    u_BTD = model.fusion(e_BTD, h_prev_BTD)     # fuse(e_t, h_{t-1})
    logits_BTV = model.logits(h_BTD)            # tied readout h · Eᵀ

Shape suffixes as in `layers.py`; L is the number of layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fbt_jax import attention
from fbt_jax.errors import ConfigError
from fbt_jax.layers import (
    AXIS_EMBED,
    AXIS_LAYERS,
    AXIS_VOCAB,
    FUSIONS,
    ROPE_SCALINGS,
    Attention,
    Fusion,
    KVCache,
    RMSNorm,
    Rope,
    SwiGLU,
    at_least_f32,
    default_positions,
    normal,
    param,
)

# float16 is left out on purpose: it needs loss scaling, which the trainer does not do.
DTYPES = ("float32", "bfloat16")

# Rematerialisation policies for the blocks' backward pass (model.remat).
REMAT_POLICIES = {
    "none": None,  # keep every activation
    "block": jax.checkpoint_policies.nothing_saveable,  # keep block inputs only, recompute the rest
    "save_matmuls": jax.checkpoint_policies.dots_saveable,  # keep matmul outputs, recompute the cheap ops
    "save_matmuls_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # weights·x only
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static model hyper-parameters: the single definition of `config.model`'s fields and defaults
    (`default_config()` is built from this class; docs/config.md documents each field)."""

    vocab_size: int = 120
    embed_dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 4  # grouped-query attention when smaller than num_heads (must divide it)
    mlp_dim: int = 256
    head_dim: int = 0  # 0: embed_dim // num_heads; imported models may set another (heads × head_dim ≠ embed_dim)
    rope_theta: float = 10_000.0
    rope_scaling: str = "none"  # none | linear | llama3 (layers.Rope): a context extended after pretraining
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0  # llama3 only
    rope_high_freq_factor: float = 4.0  # llama3 only
    rope_original_max_positions: int = 8192  # llama3 only: the context before the extension
    sliding_window: int = 0  # >0: query t attends to keys s with t − s < sliding_window (Mistral)
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    tie_embeddings: bool = True  # False: a separate readout table (TinyLlama, Mistral)
    norm_eps: float = 1e-6
    fusion: str = "glu"  # glu | add (an ablation)
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    scale_logits: bool = True  # readout scaled by 1/sqrt(embed_dim), since the final-normed h has norm ~sqrt(D)
    remat: str = "none"  # a key of REMAT_POLICIES
    scan_layers: bool = False  # one scanned block: compile time flat in depth
    attention_impl: str = "auto"  # spec.IMPLS: auto, xla (= einsum), dot_product, cudnn, pallas_gpu, splash
    loss_chunk_size: int = 0  # >0: readout + cross-entropy over chunks of this many positions (memory)

    @property
    def head_size(self) -> int:
        """The width of one attention head: `head_dim`, or embed_dim / num_heads when it is 0."""
        return self.head_dim or self.embed_dim // self.num_heads

    @property
    def rope(self) -> Rope:
        return Rope(
            self.rope_theta,
            self.rope_scaling,
            self.rope_scaling_factor,
            self.rope_low_freq_factor,
            self.rope_high_freq_factor,
            self.rope_original_max_positions,
        )

    @classmethod
    def from_config(cls, model_cfg: Any) -> ModelConfig:
        return cls(**dict(model_cfg))

    def check(self) -> None:
        """ConfigError naming the first invalid field (`config.model.<field>`) and the fix."""

        def require(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        for name in ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads", "mlp_dim"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, f"model.{name}={value!r} must be a positive integer")
        for name in ("head_dim", "sliding_window"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, f"model.{name}={value!r} must be a non-negative integer")
        require(
            self.head_dim > 0 or self.embed_dim % self.num_heads == 0,
            f"model.num_heads={self.num_heads} does not divide model.embed_dim={self.embed_dim}; "
            "choose heads so that embed_dim % num_heads == 0, or set model.head_dim",
        )
        require(
            self.num_heads % self.num_kv_heads == 0,
            f"model.num_kv_heads={self.num_kv_heads} does not divide model.num_heads={self.num_heads}; "
            "grouped attention needs num_heads % num_kv_heads == 0",
        )
        require(self.head_size % 2 == 0, f"head dim {self.head_size} is odd; rotary positions need an even head dim")
        require(
            self.rope_scaling in ROPE_SCALINGS,
            f"model.rope_scaling={self.rope_scaling!r} is unknown; use one of {ROPE_SCALINGS}",
        )
        require(self.rope_scaling_factor > 0, f"model.rope_scaling_factor={self.rope_scaling_factor} must be positive")
        require(
            self.rope_scaling != "llama3" or self.rope_high_freq_factor > self.rope_low_freq_factor,
            "model.rope_high_freq_factor must exceed model.rope_low_freq_factor for llama3 rotary scaling",
        )
        require(self.fusion in FUSIONS, f"model.fusion={self.fusion!r} is unknown; use one of {FUSIONS}")
        for name in ("param_dtype", "compute_dtype"):
            require(
                getattr(self, name) in DTYPES, f"model.{name}={getattr(self, name)!r} is unknown; use one of {DTYPES}"
            )
        require(self.rope_theta > 0, f"model.rope_theta={self.rope_theta} must be positive")
        require(self.norm_eps > 0, f"model.norm_eps={self.norm_eps} must be positive")
        require(
            isinstance(self.loss_chunk_size, int) and self.loss_chunk_size >= 0,
            f"model.loss_chunk_size={self.loss_chunk_size!r} must be a non-negative integer (0: the whole sequence at once)",
        )
        require(
            self.attention_impl in attention.IMPLS,
            f"model.attention_impl={self.attention_impl!r} is unknown; use one of {attention.IMPLS}",
        )
        require(
            self.remat in REMAT_POLICIES, f"model.remat={self.remat!r} is unknown; use one of {tuple(REMAT_POLICIES)}"
        )


class Block(nnx.Module):
    """Pre-norm residual block: x + Attn(norm(x)), then + MLP(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layout: Any = None):
        # Depth scaling (docs/method.md §7): residual branch outputs start at std / sqrt(2L) so the
        # residual stream, and hence the carried top state, stays O(1) as depth grows.
        out_std = cfg.embed_dim**-0.5 / math.sqrt(2 * cfg.num_layers)
        pdt = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pdt)
        shape_NGH = (cfg.num_heads, cfg.num_kv_heads, cfg.head_size)
        impl, bias = cfg.attention_impl, cfg.qkv_bias
        self.attn = Attention(cfg.embed_dim, shape_NGH, cfg.rope, pdt, out_std, rngs, impl, bias, layout)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pdt)
        self.mlp = SwiGLU(cfg.embed_dim, cfg.mlp_dim, pdt, out_std, rngs)

    def __call__(self, x_BTD: jax.Array, spec: attention.MaskSpec) -> jax.Array:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), spec)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))

    def prefill(self, x_BTD: jax.Array, spec: attention.MaskSpec, cache: KVCache) -> tuple[jax.Array, KVCache]:
        attn_BTD, cache = self.attn.prefill(self.attn_norm(x_BTD), spec, cache)
        x_BTD = x_BTD + attn_BTD
        return x_BTD + self.mlp(self.mlp_norm(x_BTD)), cache

    def cached(
        self, x_BTD: jax.Array, positions_BT: jax.Array, mask_B1TS: jax.Array, cache: KVCache, write_index_B: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        attn_BTD, cache = self.attn.cached(self.attn_norm(x_BTD), positions_BT, mask_B1TS, cache, write_index_B)
        x_BTD = x_BTD + attn_BTD
        return x_BTD + self.mlp(self.mlp_norm(x_BTD)), cache


class FBTransformer(nnx.Module):
    """Decoder-only transformer with tied embeddings and a latent-feedback fusion."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layout: Any = None):
        self.cfg = cfg
        # Where activations live on the mesh (sharding.ActivationLayout), or None to let XLA pick.
        self.layout = layout
        pdt = jnp.dtype(cfg.param_dtype)
        # Unit-variance embeddings: e_t has per-feature RMS ≈ 1, the same scale as the
        # final-normed state h that is fed back, so plain and fused inputs live in one space.
        self.embedding_VD = param(normal(rngs, (cfg.vocab_size, cfg.embed_dim), 1.0, pdt), (AXIS_VOCAB, AXIS_EMBED))
        if not cfg.tie_embeddings:
            self.readout_VD = param(normal(rngs, (cfg.vocab_size, cfg.embed_dim), 1.0, pdt), (AXIS_VOCAB, AXIS_EMBED))
        if cfg.scan_layers:
            # One Block whose parameters have a leading `layers` axis, applied with a scan: the
            # compiled program holds one block body, so compile time stays flat in depth.
            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: AXIS_LAYERS})
            def stacked_blocks(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs, layout)

            self.blocks = stacked_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs, layout) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pdt)
        self.fusion = Fusion(cfg.embed_dim, cfg.fusion, pdt, cfg.compute_dtype, rngs)

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.cfg.compute_dtype)

    def embed(self, tokens_BT: jax.Array) -> jax.Array:
        table_VD = self.embedding_VD[...]
        if self.layout is not None:
            table_VD = jax.lax.with_sharding_constraint(table_VD, self.layout.embedding_table)
        return self._constrain(jnp.take(table_VD, tokens_BT, axis=0).astype(self.compute_dtype))

    def stack(
        self,
        u_BTD: jax.Array,
        positions_BT: jax.Array | None = None,
        segment_ids_BT: jax.Array | None = None,
    ) -> jax.Array:
        """H = F(U): the L blocks and the final norm. Returns the top states h (compute dtype)."""
        if positions_BT is None:
            positions_BT = default_positions(u_BTD.shape[:2])
        spec = attention.MaskSpec(positions_BT, segment_ids_BT, self.cfg.sliding_window)
        x_BTD = self._constrain(u_BTD.astype(self.compute_dtype))
        policy = REMAT_POLICIES[self.cfg.remat]
        apply = _apply_block if self.cfg.remat == "none" else nnx.remat(_apply_block, policy=policy)
        if self.cfg.scan_layers:

            @nnx.scan(in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
            def scan_blocks(x_BTD: jax.Array, block: Block, spec: attention.MaskSpec):
                return self._constrain(apply(block, x_BTD, spec))

            x_BTD = scan_blocks(x_BTD, self.blocks, spec)
        else:
            for block in self.blocks:
                x_BTD = self._constrain(apply(block, x_BTD, spec))
        return self.final_norm(x_BTD)

    def stack_prefill(self, u_BTD: jax.Array, cache_L: KVCache) -> tuple[jax.Array, KVCache]:
        """F over the first T positions of every row (decoding's prefill), filling the start of a
        KV cache of any length: the same attention as training (a flash kernel where there is one)."""
        spec = attention.MaskSpec(default_positions(u_BTD.shape[:2]), None, self.cfg.sliding_window)
        x_BTD = u_BTD.astype(self.compute_dtype)
        if self.cfg.scan_layers:

            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
            def scan_blocks(x_BTD: jax.Array, block: Block, cache: KVCache):
                return block.prefill(x_BTD, spec, cache)

            x_BTD, cache_L = scan_blocks(x_BTD, self.blocks, cache_L)
        else:
            layers = []
            for i, block in enumerate(self.blocks):
                x_BTD, layer_cache = block.prefill(x_BTD, spec, (cache_L[0][i], cache_L[1][i]))
                layers.append(layer_cache)
            cache_L = (jnp.stack([k for k, _ in layers]), jnp.stack([v for _, v in layers]))
        return self.final_norm(x_BTD), cache_L

    def stack_cached(self, u_BTD: jax.Array, cache_L: KVCache, write_index_B: jax.Array) -> tuple[jax.Array, KVCache]:
        """F over T new positions per row, continuing a KV cache (decoding).

        `cache_L` is (k_LBSGH, v_LBSGH), the layers stacked on axis 0. Row b's new positions are
        write_index[b] … write_index[b] + T − 1; each attends to the cache up to itself. Returns the
        top states and the updated cache.
        """
        T, S = u_BTD.shape[1], cache_L[0].shape[2]
        positions_BT = write_index_B[:, None] + jnp.arange(T, dtype=jnp.int32)
        offset_BTS = positions_BT[:, :, None] - jnp.arange(S)[None, None, :]
        mask_BTS = offset_BTS >= 0
        if self.cfg.sliding_window:
            mask_BTS = mask_BTS & (offset_BTS < self.cfg.sliding_window)
        mask_B1TS = mask_BTS[:, None]
        x_BTD = u_BTD.astype(self.compute_dtype)
        if self.cfg.scan_layers:

            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
            def scan_blocks(x_BTD: jax.Array, block: Block, cache: KVCache):
                return block.cached(x_BTD, positions_BT, mask_B1TS, cache, write_index_B)

            x_BTD, cache_L = scan_blocks(x_BTD, self.blocks, cache_L)
        else:
            caches = []
            for i, block in enumerate(self.blocks):
                layer_cache = (cache_L[0][i], cache_L[1][i])
                x_BTD, layer_cache = block.cached(x_BTD, positions_BT, mask_B1TS, layer_cache, write_index_B)
                caches.append(layer_cache)
            cache_L = (jnp.stack([k for k, _ in caches]), jnp.stack([v for _, v in caches]))
        return self.final_norm(x_BTD), cache_L

    def _constrain(self, x_BTD: jax.Array) -> jax.Array:
        if self.layout is None:
            return x_BTD
        return jax.lax.with_sharding_constraint(x_BTD, self.layout.activations)

    def readout_table(self) -> jax.Array:
        """The readout's (V, D) table: the embedding when tied, else its own."""
        return self.embedding_VD[...] if self.cfg.tie_embeddings else self.readout_VD[...]

    def logits(self, h_BTD: jax.Array) -> jax.Array:
        """Readout h · Eᵀ (E tied or not) in (at least) fp32, optionally scaled by 1/√D since ‖h‖ ≈ √D."""
        logits_BTV = jnp.einsum(
            "btd,vd->btv",
            h_BTD,
            self.readout_table().astype(h_BTD.dtype),
            preferred_element_type=at_least_f32(h_BTD.dtype),
        )
        if self.cfg.scale_logits:
            logits_BTV = logits_BTV * self.readout_scale()
        return logits_BTV

    def readout_scale(self) -> float:
        """The factor on h · Eᵀ: 1/√D with `scale_logits`, else 1 (shared with the fused loss)."""
        return self.cfg.embed_dim**-0.5 if self.cfg.scale_logits else 1.0


def _apply_block(block: Block, x_BTD: jax.Array, spec: attention.MaskSpec) -> jax.Array:
    return block(x_BTD, spec)


def build_model(cfg: ModelConfig, seed: int, layout: Any = None) -> FBTransformer:
    return FBTransformer(cfg, nnx.Rngs(params=seed), layout)


def abstract_model(cfg: ModelConfig, layout: Any = None) -> FBTransformer:
    """The model's structure and shapes without allocating weights (for big configs)."""
    return nnx.eval_shape(lambda: build_model(cfg, 0, layout))


def count_params(model_or_params: FBTransformer | nnx.State) -> int:
    """Number of parameters of a model, or of a (possibly abstract) parameter state."""
    tree = nnx.state(model_or_params, nnx.Param) if isinstance(model_or_params, nnx.Module) else model_or_params
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
