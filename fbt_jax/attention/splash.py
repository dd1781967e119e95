"""The Pallas TPU Splash attention kernel with segment ids for packed rows and a causal or local
(sliding-window) mask; compiled for a TPU it is lowered by Mosaic, compiled for the CPU it runs in
interpret mode (the tests): the devices compiled for decide, not the host (`attend`).

Splash computes one example at a time with heads leading ([N, T, H]); grouped kv heads use its
multi-query form once per kv head (the R query heads of a group share one k, v). It does not scale
the scores: q is scaled by 1/√H first. Rows are padded at the end to a multiple of the block;
causality keeps every real query from seeing the padding. Under a mesh the caller runs it inside
`shard_map` over the batch and head axes (`fbt_jax.attention.attend`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from fbt_jax.attention.spec import MaskSpec, interpret_mode, pad_rows

BLOCK = 512  # MaxText's default Splash block on TPU v5e/v5p
QUANTUM = 128  # a block is a multiple of the TPU's 128-lane vector width (checked in interpret mode too)


def _kernel(seq_len: int, heads_per_group: int, window: int, block: int, interpret: bool):
    if window:
        # t − s < window  ⇔  s ≥ t − (window − 1); no key to the right of the query.
        head_mask = splash.LocalMask((seq_len, seq_len), window_size=(window - 1, 0), offset=0)
    else:
        head_mask = splash.CausalMask((seq_len, seq_len))
    mask = splash.MultiHeadMask([head_mask] * heads_per_group)
    blocks = splash.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        use_fused_bwd_kernel=True,
    )
    # Built per trace, not cached: the kernel holds its mask tables as arrays of the trace it is
    # made in (the numpy work on a lazy causal/local mask is cheap).
    return splash.make_splash_mqa(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret)


def padded_length(seq_len: int) -> tuple[int, int]:
    """(padded length, block) for a row of `seq_len` positions."""
    padded = -(-seq_len // QUANTUM) * QUANTUM
    block = min(BLOCK, padded)
    return -(-padded // block) * block, block


def splash_attention(
    q_BTNH: jax.Array, k_BTGH: jax.Array, v_BTGH: jax.Array, spec: MaskSpec, interpret: bool | None = None
) -> jax.Array:
    """`interpret`: emulate the kernel (the CPU) or lower it with Mosaic (a TPU); None: from this
    process's backend. The caller passes the mode of the devices the program is compiled for."""
    B, T, N, H = q_BTNH.shape
    G = k_BTGH.shape[2]
    if interpret is None:
        interpret = interpret_mode("splash", jax.default_backend())
    padded, block = padded_length(T)
    q_BTNH, k_BTGH, v_BTGH, segment_ids_BT = pad_rows(padded, q_BTNH, k_BTGH, v_BTGH, spec.segment_ids_BT)
    kernel = _kernel(padded, N // G, spec.window, block, interpret)
    q_BGRTH = (q_BTNH * jnp.asarray(H**-0.5, q_BTNH.dtype)).reshape(B, padded, G, N // G, H).transpose(0, 2, 3, 1, 4)
    k_BGTH, v_BGTH = (x.transpose(0, 2, 1, 3) for x in (k_BTGH, v_BTGH))

    def one_example(q_GRTH: jax.Array, k_GTH: jax.Array, v_GTH: jax.Array, segment_ids_T: jax.Array | None):
        segments = None if segment_ids_T is None else splash.SegmentIds(q=segment_ids_T, kv=segment_ids_T)
        return jax.vmap(lambda q, k, v: kernel(q, k, v, segment_ids=segments))(q_GRTH, k_GTH, v_GTH)

    out_BGRTH = jax.vmap(one_example)(q_BGRTH, k_BGTH, v_BGTH, segment_ids_BT)
    return out_BGRTH.transpose(0, 3, 1, 2, 4).reshape(B, padded, N, H)[:, :T]
