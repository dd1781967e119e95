"""Attention, computed by the implementation `model.attention_impl` names (fbt_jax/attention/spec.py).

One entry point for the model: `attend(q, k, v, spec, impl, layout)`. It resolves `impl` for the
call (backend, dtype, packed rows, window), builds the mask only on the reference paths, and runs
a kernel inside `shard_map` over the mesh's batch and head axes when the model has a mesh layout
(a Pallas call cannot be partitioned by XLA; each device computes its own rows and heads, as
MaxText runs Splash).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from fbt_jax.attention.cudnn import cudnn_attention
from fbt_jax.attention.pallas_gpu import pallas_gpu_attention
from fbt_jax.attention.reference import dot_product_attention, xla_attention
from fbt_jax.attention.spec import (
    IMPLS,
    MaskSpec,
    call_of,
    describe,
    interpret_mode,
    interpret_warning,
    reference_mask,
    resolve,
)
from fbt_jax.attention.splash import splash_attention

__all__ = [
    "IMPLS",
    "MaskSpec",
    "attend",
    "cached_attention",
    "describe",
    "interpret_mode",
    "interpret_warning",
    "reference_mask",
    "resolve",
    "target_platform",
]

KERNELS = {"cudnn": cudnn_attention, "pallas_gpu": pallas_gpu_attention, "splash": splash_attention}


def attend(
    q_BTNH: jax.Array, k_BTGH: jax.Array, v_BTGH: jax.Array, spec: MaskSpec, impl: str, layout: Any = None
) -> jax.Array:
    """Causal self-attention of T queries over the same T positions' keys and values, under `spec`.

    `layout` (sharding.ActivationLayout or None) says where q/k/v live on the mesh. The choice of
    implementation and a Pallas kernel's mode (native or interpreted) follow the platform of the
    mesh's devices, which is not this process's backend when a program is compiled for a TPU slice
    or a GPU node from another machine (the dry run's `dry_run_topology`)."""
    platform = target_platform(layout)
    chosen = resolve(impl, call_of(q_BTNH, spec, platform))
    if chosen == "xla":
        return xla_attention(q_BTNH, k_BTGH, v_BTGH, reference_mask(spec))
    if chosen == "dot_product":
        return dot_product_attention(q_BTNH, k_BTGH, v_BTGH, reference_mask(spec))
    kernel = functools.partial(KERNELS[chosen], interpret=interpret_mode(chosen, platform))
    if layout is None:
        return kernel(q_BTNH, k_BTGH, v_BTGH, spec)
    q_spec, kv_spec, rows_spec = layout.heads_BTNH.spec, layout.kv_heads_BTGH.spec, layout.rows_BT.spec
    spec_specs = MaskSpec(rows_spec, None if spec.segment_ids_BT is None else rows_spec, spec.window)
    sharded = jax.shard_map(
        kernel,
        mesh=layout.heads_BTNH.mesh,
        in_specs=(q_spec, kv_spec, kv_spec, spec_specs),
        out_specs=q_spec,
        check_vma=False,
    )
    return sharded(q_BTNH, k_BTGH, v_BTGH, spec)


def target_platform(layout: Any) -> str:
    """cpu | gpu | tpu: where the program is compiled for (the layout's mesh), else this process's backend."""
    if layout is None:
        return jax.default_backend()
    return layout.heads_BTNH.mesh.devices.flat[0].platform


def cached_attention(
    q_BTNH: jax.Array, k_BSGH: jax.Array, v_BSGH: jax.Array, mask_B1TS: jax.Array, impl: str
) -> jax.Array:
    """Attention of new positions over a KV cache (decoding's steps): the reference paths, since a
    step is a few queries against the cache (`dot_product` where the run asks for it)."""
    if impl == "dot_product":
        return dot_product_attention(q_BTNH, k_BSGH, v_BSGH, mask_B1TS)
    return xla_attention(q_BTNH, k_BSGH, v_BSGH, mask_B1TS)
