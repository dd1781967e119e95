"""The causal transformer stack F of a Full-Bandwidth Transformer (docs/method.md §2).

`FBTransformer` owns every parameter: the tied embedding table, L pre-norm blocks, the final
RMSNorm and the fusion (the only new parameters, defined in `feedback.py`). It exposes the pieces
the K-pass objective and the sequential recurrence compose, rather than one opaque `__call__`:

    e_BTD = model.embed(tokens_BT)              # e_t = E[x_t]
    h_BTD = model.stack(u_BTD, positions_BT)    # H = F(U): blocks + final norm
    u_BTD = model.fusion(e_BTD, h_prev_BTD)     # fuse(e_t, h_{t-1})
    logits_BTV = model.logits(h_BTD)            # tied readout h · Eᵀ

Every parameter carries logical axis names (`out_sharding` metadata, e.g. ('embed', 'mlp')) so the
sharding layer maps names to mesh axes; `eager_sharding=False` lets the model be built on any
device set (the mesh-aware init applies the rules through jit's out_shardings).

Shape suffixes: B batch, T sequence, D model width, N query heads, K kv heads, H head dim,
F MLP hidden width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fbt_jax.feedback import Fusion, default_positions

# Logical axis names used by the parameters. The sharding rules map these to mesh axes.
AXIS_VOCAB = "vocab"
AXIS_EMBED = "embed"
AXIS_MLP = "mlp"
AXIS_HEADS = "heads"
AXIS_KV_HEADS = "kv_heads"
AXIS_HEAD_DIM = "head_dim"
AXIS_NORM = "norm"
AXIS_FUSION = "fusion"
AXIS_LAYERS = "layers"  # the stacked-layer axis of scanned blocks
PARAM_AXES = (
    AXIS_VOCAB,
    AXIS_EMBED,
    AXIS_MLP,
    AXIS_HEADS,
    AXIS_KV_HEADS,
    AXIS_HEAD_DIM,
    AXIS_NORM,
    AXIS_FUSION,
    AXIS_LAYERS,
)

# Rematerialisation policies for the blocks' backward pass (model.remat).
REMAT_POLICIES = {
    "none": None,  # keep every activation
    "block": jax.checkpoint_policies.nothing_saveable,  # keep block inputs only, recompute the rest
    "save_matmuls": jax.checkpoint_policies.dots_saveable,  # keep matmul outputs, recompute the cheap ops
    "save_matmuls_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # weights·x only
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static model hyper-parameters (built from `config.model`; see docs/config.md)."""

    vocab_size: int
    embed_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mlp_dim: int
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    fusion: str = "glu"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    scale_logits: bool = True
    remat: str = "none"
    scan_layers: bool = False

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @classmethod
    def from_config(cls, model_cfg: Any) -> ModelConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(model_cfg).items() if k in fields})


def at_least_f32(dtype: Any) -> Any:
    """Accumulation dtype: fp32 for bf16/fp32 compute, fp64 when computing in fp64."""
    return jnp.promote_types(dtype, jnp.float32)


def _param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype: Any) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype: Any):
        self.scale = _param(jnp.ones((dim,), param_dtype), (AXIS_NORM,))
        self.eps = eps

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        # Normalise in fp32 whatever the compute dtype: bf16 mean-of-squares loses too much.
        acc = at_least_f32(x_BTD.dtype)
        x = x_BTD.astype(acc)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(acc)).astype(x_BTD.dtype)


def rotary(x_BTNH: jax.Array, positions_BT: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding (split-half form), computed in at least fp32."""
    acc = at_least_f32(x_BTNH.dtype)
    half = x_BTNH.shape[-1] // 2
    freq_H = theta ** (-jnp.arange(half, dtype=acc) / half)
    angle_BTH = positions_BT[..., None].astype(acc) * freq_H
    sin, cos = jnp.sin(angle_BTH)[:, :, None, :], jnp.cos(angle_BTH)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(acc), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


def attention_mask(positions_BT: jax.Array, segment_ids_BT: jax.Array | None) -> jax.Array:
    """Causal mask (B, 1, T, T): query t sees key s iff s ≤ t (and both share a segment)."""
    T = positions_BT.shape[1]
    mask_TT = jnp.tril(jnp.ones((T, T), bool))
    mask_BTT = jnp.broadcast_to(mask_TT, (positions_BT.shape[0], T, T))
    if segment_ids_BT is not None:
        mask_BTT = mask_BTT & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])
    return mask_BTT[:, None]


class Attention(nnx.Module):
    """Multi-head causal attention with grouped KV heads (num_kv_heads divides num_heads)."""

    def __init__(self, cfg: ModelConfig, out_std: float, rngs: nnx.Rngs):
        D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dt = jnp.dtype(cfg.param_dtype)
        in_std = D**-0.5
        self.q_DNH = _param(_normal(rngs, (D, N, H), in_std, dt), (AXIS_EMBED, AXIS_HEADS, AXIS_HEAD_DIM))
        self.k_DKH = _param(_normal(rngs, (D, K, H), in_std, dt), (AXIS_EMBED, AXIS_KV_HEADS, AXIS_HEAD_DIM))
        self.v_DKH = _param(_normal(rngs, (D, K, H), in_std, dt), (AXIS_EMBED, AXIS_KV_HEADS, AXIS_HEAD_DIM))
        self.o_NHD = _param(_normal(rngs, (N, H, D), out_std, dt), (AXIS_HEADS, AXIS_HEAD_DIM, AXIS_EMBED))
        self.num_groups = N // K
        self.rope_theta = cfg.rope_theta

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, mask_B1TT: jax.Array) -> jax.Array:
        q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD, positions_BT)
        return self._attend(q_BTNH, k_BTKH, v_BTKH, mask_B1TT)

    def cached(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        mask_B1TS: jax.Array,
        k_BSKH: jax.Array,
        v_BSKH: jax.Array,
        write_index_B: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention over a KV cache: writes this call's keys/values at each row's `write_index`
        (rows may be at different lengths), then attends over the whole cache under `mask`."""
        q_BTNH, k_BTKH, v_BTKH = self._project(x_BTD, positions_BT)

        def write(cache_SKH: jax.Array, new_TKH: jax.Array, index: jax.Array) -> jax.Array:
            return jax.lax.dynamic_update_slice(cache_SKH, new_TKH.astype(cache_SKH.dtype), (index, 0, 0))

        k_BSKH = jax.vmap(write)(k_BSKH, k_BTKH, write_index_B)
        v_BSKH = jax.vmap(write)(v_BSKH, v_BTKH, write_index_B)
        return self._attend(q_BTNH, k_BSKH.astype(x_BTD.dtype), v_BSKH.astype(x_BTD.dtype), mask_B1TS), k_BSKH, v_BSKH

    def _project(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cd = x_BTD.dtype
        q_BTNH = jnp.einsum("btd,dnh->btnh", x_BTD, self.q_DNH[...].astype(cd))
        k_BTKH = jnp.einsum("btd,dkh->btkh", x_BTD, self.k_DKH[...].astype(cd))
        v_BTKH = jnp.einsum("btd,dkh->btkh", x_BTD, self.v_DKH[...].astype(cd))
        return rotary(q_BTNH, positions_BT, self.rope_theta), rotary(k_BTKH, positions_BT, self.rope_theta), v_BTKH

    def _attend(self, q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, mask_B1TS: jax.Array) -> jax.Array:
        cd = q_BTNH.dtype
        B, T, N, H = q_BTNH.shape
        acc = at_least_f32(cd)
        # Query head n uses kv head n // num_groups: split N into (K, G) instead of repeating KV.
        q_BTKGH = q_BTNH.reshape(B, T, N // self.num_groups, self.num_groups, H)
        scores_BKGTS = jnp.einsum("btkgh,bskh->bkgts", q_BTKGH, k_BSKH, preferred_element_type=acc) * (H**-0.5)
        scores_BKGTS = jnp.where(mask_B1TS[:, :, None], scores_BKGTS, jnp.finfo(acc).min)
        probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(cd)
        out_BTKGH = jnp.einsum("bkgts,bskh->btkgh", probs_BKGTS, v_BSKH)
        out_BTNH = out_BTKGH.reshape(B, T, N, H)
        return jnp.einsum("btnh,nhd->btd", out_BTNH, self.o_NHD[...].astype(cd))


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, out_std: float, rngs: nnx.Rngs):
        D, F = cfg.embed_dim, cfg.mlp_dim
        dt = jnp.dtype(cfg.param_dtype)
        self.gate_DF = _param(_normal(rngs, (D, F), D**-0.5, dt), (AXIS_EMBED, AXIS_MLP))
        self.up_DF = _param(_normal(rngs, (D, F), D**-0.5, dt), (AXIS_EMBED, AXIS_MLP))
        # Contracted dim `mlp` first (Megatron layout): see docs/platform-notes on silent
        # wrong gradients when the contracted dim of w2 sat on a different mesh axis.
        self.down_FD = _param(_normal(rngs, (F, D), out_std, dt), (AXIS_MLP, AXIS_EMBED))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        cd = x_BTD.dtype
        gate_BTF = jnp.einsum("btd,df->btf", x_BTD, self.gate_DF[...].astype(cd))
        up_BTF = jnp.einsum("btd,df->btf", x_BTD, self.up_DF[...].astype(cd))
        return jnp.einsum("btf,fd->btd", jax.nn.silu(gate_BTF) * up_BTF, self.down_FD[...].astype(cd))


class Block(nnx.Module):
    """Pre-norm residual block: x + Attn(norm(x)), then + MLP(norm(x))."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        # Depth scaling (docs/method.md §7): residual branch outputs start at std / sqrt(2L) so the
        # residual stream, and hence the carried top state, stays O(1) as depth grows.
        out_std = cfg.embed_dim**-0.5 / math.sqrt(2 * cfg.num_layers)
        pdt = jnp.dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pdt)
        self.attn = Attention(cfg, out_std, rngs)
        self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, pdt)
        self.mlp = SwiGLU(cfg, out_std, rngs)

    def __call__(self, x_BTD: jax.Array, positions_BT: jax.Array, mask_B1TT: jax.Array) -> jax.Array:
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), positions_BT, mask_B1TT)
        return x_BTD + self.mlp(self.mlp_norm(x_BTD))

    def cached(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        mask_B1TS: jax.Array,
        k_BSKH: jax.Array,
        v_BSKH: jax.Array,
        write_index_B: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        attn_BTD, k_BSKH, v_BSKH = self.attn.cached(
            self.attn_norm(x_BTD), positions_BT, mask_B1TS, k_BSKH, v_BSKH, write_index_B
        )
        x_BTD = x_BTD + attn_BTD
        return x_BTD + self.mlp(self.mlp_norm(x_BTD)), k_BSKH, v_BSKH


class FBTransformer(nnx.Module):
    """Decoder-only transformer with tied embeddings and a latent-feedback fusion."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layout: Any = None):
        self.cfg = cfg
        # Where activations live on the mesh (sharding.ActivationLayout), or None to let XLA pick.
        self.layout = layout
        pdt = jnp.dtype(cfg.param_dtype)
        # Unit-variance embeddings: e_t has per-feature RMS ≈ 1, the same scale as the
        # final-normed state h that is fed back, so plain and fused inputs live in one space.
        self.embedding_VD = _param(_normal(rngs, (cfg.vocab_size, cfg.embed_dim), 1.0, pdt), (AXIS_VOCAB, AXIS_EMBED))
        if cfg.scan_layers:
            # One Block whose parameters have a leading `layers` axis, applied with a scan: the
            # compiled program holds one block body, so compile time stays flat in depth.
            @nnx.split_rngs(splits=cfg.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: AXIS_LAYERS})
            def stacked_blocks(rngs: nnx.Rngs) -> Block:
                return Block(cfg, rngs)

            self.blocks = stacked_blocks(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.num_layers)])
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
        mask_B1TT = attention_mask(positions_BT, segment_ids_BT)
        x_BTD = self._constrain(u_BTD.astype(self.compute_dtype))
        policy = REMAT_POLICIES[self.cfg.remat]
        apply = _apply_block if self.cfg.remat == "none" else nnx.remat(_apply_block, policy=policy)
        if self.cfg.scan_layers:

            @nnx.scan(in_axes=(nnx.Carry, 0, None, None), out_axes=nnx.Carry)
            def scan_blocks(x_BTD: jax.Array, block: Block, positions_BT: jax.Array, mask_B1TT: jax.Array):
                return self._constrain(apply(block, x_BTD, positions_BT, mask_B1TT))

            x_BTD = scan_blocks(x_BTD, self.blocks, positions_BT, mask_B1TT)
        else:
            for block in self.blocks:
                x_BTD = self._constrain(apply(block, x_BTD, positions_BT, mask_B1TT))
        return self.final_norm(x_BTD)

    def stack_cached(
        self, u_BTD: jax.Array, k_LBSKH: jax.Array, v_LBSKH: jax.Array, write_index_B: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """F over T new positions per row, continuing a KV cache (decoding).

        Row b's new positions are write_index[b] … write_index[b] + T − 1; each attends to the cache
        up to itself. Returns the top states and the updated caches (layers stacked on axis 0).
        """
        T, S = u_BTD.shape[1], k_LBSKH.shape[2]
        positions_BT = write_index_B[:, None] + jnp.arange(T, dtype=jnp.int32)
        mask_B1TS = (jnp.arange(S)[None, None, :] <= positions_BT[:, :, None])[:, None]
        x_BTD = u_BTD.astype(self.compute_dtype)
        if self.cfg.scan_layers:

            @nnx.scan(in_axes=(nnx.Carry, 0, 0, 0), out_axes=(nnx.Carry, 0, 0))
            def scan_blocks(x_BTD: jax.Array, block: Block, k_BSKH: jax.Array, v_BSKH: jax.Array):
                return block.cached(x_BTD, positions_BT, mask_B1TS, k_BSKH, v_BSKH, write_index_B)

            x_BTD, k_LBSKH, v_LBSKH = scan_blocks(x_BTD, self.blocks, k_LBSKH, v_LBSKH)
        else:
            ks, vs = [], []
            for i, block in enumerate(self.blocks):
                x_BTD, k_BSKH, v_BSKH = block.cached(
                    x_BTD, positions_BT, mask_B1TS, k_LBSKH[i], v_LBSKH[i], write_index_B
                )
                ks.append(k_BSKH)
                vs.append(v_BSKH)
            k_LBSKH, v_LBSKH = jnp.stack(ks), jnp.stack(vs)
        return self.final_norm(x_BTD), k_LBSKH, v_LBSKH

    def _constrain(self, x_BTD: jax.Array) -> jax.Array:
        if self.layout is None:
            return x_BTD
        return jax.lax.with_sharding_constraint(x_BTD, self.layout.activations)

    def logits(self, h_BTD: jax.Array) -> jax.Array:
        """Tied readout h · Eᵀ in (at least) fp32, optionally scaled by 1/√D since ‖h‖ ≈ √D."""
        logits_BTV = jnp.einsum(
            "btd,vd->btv",
            h_BTD,
            self.embedding_VD[...].astype(h_BTD.dtype),
            preferred_element_type=at_least_f32(h_BTD.dtype),
        )
        if self.cfg.scale_logits:
            logits_BTV = logits_BTV * (self.cfg.embed_dim**-0.5)
        return logits_BTV


def _apply_block(block: Block, x_BTD: jax.Array, positions_BT: jax.Array, mask_B1TT: jax.Array) -> jax.Array:
    return block(x_BTD, positions_BT, mask_B1TT)


def build_model(cfg: ModelConfig, seed: int, layout: Any = None) -> FBTransformer:
    return FBTransformer(cfg, nnx.Rngs(params=seed), layout)


def abstract_model(cfg: ModelConfig, layout: Any = None) -> FBTransformer:
    """The model's structure and shapes without allocating weights (for big configs)."""
    return nnx.eval_shape(lambda: build_model(cfg, 0, layout))


def count_params(model_or_params: FBTransformer | nnx.State) -> int:
    """Number of parameters of a model, or of a (possibly abstract) parameter state."""
    tree = nnx.state(model_or_params, nnx.Param) if isinstance(model_or_params, nnx.Module) else model_or_params
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
