"""cuDNN's fused flash attention through `jax.nn.dot_product_attention(implementation="cudnn")`:
causal (cuDNN skips the masked half), grouped kv heads natively, a sliding window as cuDNN's
left window. Rows that are not packed only: the public API has one length per row, not the
per-document boundaries of packed rows (docs/performance.md says why the private packed layout
is not used).

`implementation` is a parameter so that the CPU tests can run the same call through XLA's
implementation of the same arguments (cuDNN itself needs a GPU).
"""

from __future__ import annotations

import jax

from fbt_jax.attention.spec import MaskSpec


def cudnn_attention(
    q_BTNH: jax.Array, k_BTGH: jax.Array, v_BTGH: jax.Array, spec: MaskSpec, implementation: str = "cudnn"
) -> jax.Array:
    if spec.packed:
        raise ValueError("cudnn_attention: rows with segment ids are not supported (resolve() refuses them)")
    # t − s < window  ⇔  s ≥ t − (window − 1): a left window of window − 1 keys before the query.
    local_window = (spec.window - 1, 0) if spec.window else None
    return jax.nn.dot_product_attention(
        q_BTNH,
        k_BTGH,
        v_BTGH,
        scale=q_BTNH.shape[-1] ** -0.5,
        is_causal=True,
        local_window_size=local_window,
        implementation=implementation,
    )
