"""The Pallas-Triton flash attention kernel (`jax.experimental.pallas.ops.gpu.attention.mha`) with
segment ids for packed rows; on the CPU it runs in interpret mode (the tests).

The kernel wants q, k, v with the same number of heads, so grouped kv heads are repeated (query
head n reads kv head n // R). It tiles the sequence in blocks, so rows are padded at the end to a
multiple of the block; causality keeps every real query from seeing the padding.

jax 0.11.2 to 0.12.0.1 deprecate this module (a warning on import), and 0.12.1 removed it
(spec.py's `unsupported` refuses this kernel there, before anything compiles), in favour of
`tokamax.dot_product_attention`, which cannot replace it yet (tokamax 0.0.17; issue #59,
docs/performance.md): its public call takes no segment ids (packed rows only as a materialised T×T
mask), its `triton` kernel (the one for any GPU) is itself Pallas-Triton, and neither that kernel's
backward nor its Mosaic GPU kernels (Hopper/Blackwell) run on the CPU. The import silences that one
warning.
Compiled for a GPU (not interpreted), jax also warns that the Pallas Triton backend is deprecated:
that warning comes from jit's lowering, after this function has run, and is not filtered here.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import jax
import jax.numpy as jnp

from fbt_jax.attention.spec import MaskSpec, interpret_mode, pad_rows

# The kernel's own defaults (forward 128×128, backward 32-blocks); a sequence shorter than a block
# uses one block of its (power-of-two padded) length. Not yet tuned on a GPU: gpu_check's rows
# `auto:none@FWD/BWD` measure other sizes (docs/performance.md). Read at trace time.
FORWARD_BLOCK = 128
BACKWARD_BLOCK = 32


def block_sizes(seq_len: int, forward: int = FORWARD_BLOCK, backward: int = BACKWARD_BLOCK) -> tuple[int, int, int]:
    """(padded length, forward block, backward block) for a row of `seq_len` positions."""
    quantum = min(forward, max(backward, 1 << (seq_len - 1).bit_length()))
    padded = -(-seq_len // quantum) * quantum
    return padded, min(forward, padded), min(backward, padded)


def triton_attention_module() -> ModuleType:
    """`jax.experimental.pallas.ops.gpu.attention`, imported where first used (only this path needs
    it) without the DeprecationWarning its import raises: the module is jax's own and still works;
    the replacement it names does not yet carry what we use it for (the module docstring)."""
    with warnings.catch_warnings():
        # This one message only: any other warning of the import (or of jax) still reaches the caller.
        warnings.filterwarnings(
            "ignore",
            message=r"jax\.experimental\.pallas\.ops\.gpu\.attention is deprecated",
            category=DeprecationWarning,
        )
        from jax.experimental.pallas.ops.gpu import attention

    return attention


def pallas_gpu_attention(
    q_BTNH: jax.Array,
    k_BTGH: jax.Array,
    v_BTGH: jax.Array,
    spec: MaskSpec,
    forward_block: int | None = None,
    backward_block: int | None = None,
    interpret: bool | None = None,
) -> jax.Array:
    """`interpret`: emulate the kernel (the CPU) or lower it with Triton (a GPU); None: from this
    process's backend. The caller passes the mode of the devices the program is compiled for."""
    triton_attention = triton_attention_module()
    if spec.window:
        raise ValueError("pallas_gpu_attention: no sliding window (resolve() refuses it)")
    B, T, N, H = q_BTNH.shape
    R = N // k_BTGH.shape[2]
    k_BTNH, v_BTNH = (jnp.repeat(x, R, axis=2) if R > 1 else x for x in (k_BTGH, v_BTGH))
    padded, fwd, bwd = block_sizes(T, forward_block or FORWARD_BLOCK, backward_block or BACKWARD_BLOCK)
    q_BTNH, k_BTNH, v_BTNH, segment_ids_BT = pad_rows(padded, q_BTNH, k_BTNH, v_BTNH, spec.segment_ids_BT)
    blocks = triton_attention.BlockSizes(
        block_q=fwd, block_k=fwd, block_q_dkv=bwd, block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd
    )
    out_BTNH = triton_attention.mha(
        q_BTNH,
        k_BTNH,
        v_BTNH,
        segment_ids_BT,
        sm_scale=H**-0.5,
        causal=True,
        block_sizes=blocks,
        interpret=interpret_mode("pallas_gpu", jax.default_backend()) if interpret is None else interpret,
    )
    return out_BTNH[:, :T]
