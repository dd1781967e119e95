"""Building blocks of the stack, each with explicit sizes: norm, rotary positions, attention,
the SwiGLU MLP and the latent-feedback fusion (docs/method.md §2–3).

Every parameter carries logical axis names (`out_sharding` metadata, e.g. ('embed', 'mlp')) so
the sharding rules map names to mesh axes; `eager_sharding=False` lets a layer be built on any
device set (the mesh-aware init applies the rules through jit's out_shardings).

Shape suffixes: B batch, T sequence (queries), S cached sequence (keys), D model width,
N query heads, G kv heads (one per group of N/G query heads), R = N/G query heads per kv head,
H head dim, F MLP hidden width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fbt_jax.attention import MaskSpec, attend, cached_attention

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

FUSIONS = ("glu", "add")

# A layer's key and value cache, (k_BSGH, v_BSGH).
KVCache = tuple[jax.Array, jax.Array]


def at_least_f32(dtype: Any) -> Any:
    """Accumulation dtype: fp32 for bf16/fp32 compute, fp64 when computing in fp64."""
    return jnp.promote_types(dtype, jnp.float32)


def param(value: jax.Array, axes: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


def normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype: Any) -> jax.Array:
    return std * jax.random.normal(rngs.params(), shape, dtype)


def default_positions(shape_BT: tuple[int, ...]) -> jax.Array:
    """Positions 0..T-1 for every row (unpacked sequences)."""
    return jnp.broadcast_to(jnp.arange(shape_BT[1], dtype=jnp.int32), shape_BT)


ROPE_SCALINGS = ("none", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary frequencies: base `theta`, optionally rescaled for a longer context. `linear`
    divides every frequency by `factor`; `llama3` divides only the low frequencies (wavelength
    above original_max_positions / low_freq_factor), keeps the high ones (below
    original_max_positions / high_freq_factor) and interpolates smoothly in between."""

    theta: float = 10_000.0
    scaling: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def frequencies(self, head_dim: int, dtype: Any) -> jax.Array:
        half = head_dim // 2
        freq_H = self.theta ** (-jnp.arange(half, dtype=dtype) / half)
        if self.scaling == "linear":
            return freq_H / self.factor
        if self.scaling == "llama3":
            wavelength_H = 2 * jnp.pi / freq_H
            # 0 at the low-frequency end (fully divided), 1 at the high end (kept).
            smooth_H = (self.original_max_positions / wavelength_H - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            blended_H = (1 - smooth_H) * freq_H / self.factor + smooth_H * freq_H
            low = wavelength_H > self.original_max_positions / self.low_freq_factor
            high = wavelength_H < self.original_max_positions / self.high_freq_factor
            return jnp.where(low, freq_H / self.factor, jnp.where(high, freq_H, blended_H))
        return freq_H


def rotary(x_BTNH: jax.Array, positions_BT: jax.Array, rope: Rope) -> jax.Array:
    """Rotary position embedding (split-half form), computed in at least fp32."""
    acc = at_least_f32(x_BTNH.dtype)
    freq_H = rope.frequencies(x_BTNH.shape[-1], acc)
    angle_BTH = positions_BT[..., None].astype(acc) * freq_H
    sin, cos = jnp.sin(angle_BTH)[:, :, None, :], jnp.cos(angle_BTH)[:, :, None, :]
    x1, x2 = jnp.split(x_BTNH.astype(acc), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype: Any):
        self.scale = param(jnp.ones((dim,), param_dtype), (AXIS_NORM,))
        self.eps = eps

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        # Normalise in fp32 whatever the compute dtype: bf16 mean-of-squares loses too much.
        acc = at_least_f32(x_BTD.dtype)
        x = x_BTD.astype(acc)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(acc)).astype(x_BTD.dtype)


class Attention(nnx.Module):
    """Multi-head causal attention with grouped kv heads (num_kv_heads divides num_heads), optional
    q/k/v biases (Qwen2) and an optional sliding window (Mistral; part of the caller's MaskSpec).
    The attention itself is `fbt_jax.attention.attend` with the implementation `impl`."""

    def __init__(
        self,
        embed_dim: int,
        shape_NGH: tuple[int, int, int],
        rope: Rope,
        param_dtype: Any,
        out_std: float,
        rngs: nnx.Rngs,
        impl: str = "xla",
        qkv_bias: bool = False,
        layout: Any = None,
    ):
        D, (N, G, H) = embed_dim, shape_NGH
        in_std = D**-0.5
        self.q_DNH = param(normal(rngs, (D, N, H), in_std, param_dtype), (AXIS_EMBED, AXIS_HEADS, AXIS_HEAD_DIM))
        self.k_DGH = param(normal(rngs, (D, G, H), in_std, param_dtype), (AXIS_EMBED, AXIS_KV_HEADS, AXIS_HEAD_DIM))
        self.v_DGH = param(normal(rngs, (D, G, H), in_std, param_dtype), (AXIS_EMBED, AXIS_KV_HEADS, AXIS_HEAD_DIM))
        self.o_NHD = param(normal(rngs, (N, H, D), out_std, param_dtype), (AXIS_HEADS, AXIS_HEAD_DIM, AXIS_EMBED))
        if qkv_bias:
            self.q_bias_NH = param(jnp.zeros((N, H), param_dtype), (AXIS_HEADS, AXIS_HEAD_DIM))
            self.k_bias_GH = param(jnp.zeros((G, H), param_dtype), (AXIS_KV_HEADS, AXIS_HEAD_DIM))
            self.v_bias_GH = param(jnp.zeros((G, H), param_dtype), (AXIS_KV_HEADS, AXIS_HEAD_DIM))
        self.qkv_bias = qkv_bias
        self.rope = rope
        self.impl = impl
        self.layout = layout  # sharding.ActivationLayout or None: where a kernel's shard_map splits q/k/v

    def __call__(self, x_BTD: jax.Array, spec: MaskSpec) -> jax.Array:
        q_BTNH, k_BTGH, v_BTGH = self._project(x_BTD, spec.positions_BT)
        return self._output(attend(q_BTNH, k_BTGH, v_BTGH, spec, self.impl, self.layout))

    def prefill(self, x_BTD: jax.Array, spec: MaskSpec, cache: KVCache) -> tuple[jax.Array, KVCache]:
        """Attention over the T prompt positions themselves (the flash path where there is one),
        their keys/values written at the start of each row's cache. Keys past a row's prompt are
        never seen by its prompt (causality), so this equals attending over the cache."""
        q_BTNH, k_BTGH, v_BTGH = self._project(x_BTD, spec.positions_BT)
        T = x_BTD.shape[1]
        cache = tuple(c.at[:, :T].set(new.astype(c.dtype)) for c, new in zip(cache, (k_BTGH, v_BTGH)))
        return self._output(attend(q_BTNH, k_BTGH, v_BTGH, spec, self.impl, self.layout)), cache

    def cached(
        self, x_BTD: jax.Array, positions_BT: jax.Array, mask_B1TS: jax.Array, cache: KVCache, write_index_B: jax.Array
    ) -> tuple[jax.Array, KVCache]:
        """Attention over a KV cache: writes this call's keys/values at each row's `write_index`
        (rows may be at different lengths), then attends over the whole cache under the mask."""
        q_BTNH, k_BTGH, v_BTGH = self._project(x_BTD, positions_BT)

        def write(cache_SGH: jax.Array, new_TGH: jax.Array, index: jax.Array) -> jax.Array:
            return jax.lax.dynamic_update_slice(cache_SGH, new_TGH.astype(cache_SGH.dtype), (index, 0, 0))

        k_BSGH = jax.vmap(write)(cache[0], k_BTGH, write_index_B)
        v_BSGH = jax.vmap(write)(cache[1], v_BTGH, write_index_B)
        cd = x_BTD.dtype
        out_BTNH = cached_attention(q_BTNH, k_BSGH.astype(cd), v_BSGH.astype(cd), mask_B1TS, self.impl)
        return self._output(out_BTNH), (k_BSGH, v_BSGH)

    def _project(self, x_BTD: jax.Array, positions_BT: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cd = x_BTD.dtype
        q_BTNH = jnp.einsum("btd,dnh->btnh", x_BTD, self.q_DNH[...].astype(cd))
        k_BTGH = jnp.einsum("btd,dgh->btgh", x_BTD, self.k_DGH[...].astype(cd))
        v_BTGH = jnp.einsum("btd,dgh->btgh", x_BTD, self.v_DGH[...].astype(cd))
        if self.qkv_bias:
            q_BTNH = q_BTNH + self.q_bias_NH[...].astype(cd)
            k_BTGH = k_BTGH + self.k_bias_GH[...].astype(cd)
            v_BTGH = v_BTGH + self.v_bias_GH[...].astype(cd)
        return rotary(q_BTNH, positions_BT, self.rope), rotary(k_BTGH, positions_BT, self.rope), v_BTGH

    def _output(self, out_BTNH: jax.Array) -> jax.Array:
        return jnp.einsum("btnh,nhd->btd", out_BTNH, self.o_NHD[...].astype(out_BTNH.dtype))


class SwiGLU(nnx.Module):
    def __init__(self, embed_dim: int, mlp_dim: int, param_dtype: Any, out_std: float, rngs: nnx.Rngs):
        D, F = embed_dim, mlp_dim
        self.gate_DF = param(normal(rngs, (D, F), D**-0.5, param_dtype), (AXIS_EMBED, AXIS_MLP))
        self.up_DF = param(normal(rngs, (D, F), D**-0.5, param_dtype), (AXIS_EMBED, AXIS_MLP))
        # Contracted dim `mlp` first (Megatron layout): see docs/platform-notes on silent
        # wrong gradients when the contracted dim of w2 sat on a different mesh axis.
        self.down_FD = param(normal(rngs, (F, D), out_std, param_dtype), (AXIS_MLP, AXIS_EMBED))

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        cd = x_BTD.dtype
        gate_BTF = jnp.einsum("btd,df->btf", x_BTD, self.gate_DF[...].astype(cd))
        up_BTF = jnp.einsum("btd,df->btf", x_BTD, self.up_DF[...].astype(cd))
        return jnp.einsum("btf,fd->btd", jax.nn.silu(gate_BTF) * up_BTF, self.down_FD[...].astype(cd))


class Fusion(nnx.Module):
    """fuse(e, h) = (W_U h) ⊙ σ(W_G e)  ("glu"), or e + W_U h  ("add", an ablation only).

    Asymmetric on purpose: the carried state supplies the values and the token only gates them,
    so the model cannot fall back to plain token inputs by shrinking the state path (which the
    symmetric additive form allows).
    """

    def __init__(self, dim: int, kind: str, param_dtype: Any, compute_dtype: Any, rngs: nnx.Rngs):
        if kind not in FUSIONS:
            raise ValueError(f"model.fusion={kind!r} is unknown; use one of {FUSIONS}")
        self.kind = kind
        self.compute_dtype = jnp.dtype(compute_dtype)
        std = dim**-0.5  # keeps W_U h at unit RMS, like e, for a final-normed h
        axes = (AXIS_EMBED, AXIS_FUSION)
        self.state_proj_DD = param(normal(rngs, (dim, dim), std, param_dtype), axes)  # W_U
        if kind == "glu":
            self.gate_proj_DD = param(normal(rngs, (dim, dim), std, param_dtype), axes)  # W_G

    def __call__(self, e_BTD: jax.Array, h_BTD: jax.Array) -> jax.Array:
        cd = self.compute_dtype
        value_BTD = jnp.einsum("btd,de->bte", h_BTD.astype(cd), self.state_proj_DD[...].astype(cd))
        if self.kind == "add":
            return e_BTD.astype(cd) + value_BTD
        gate_BTD = jnp.einsum("btd,de->bte", e_BTD.astype(cd), self.gate_proj_DD[...].astype(cd))
        return value_BTD * jax.nn.sigmoid(gate_BTD)
