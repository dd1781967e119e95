"""What defines an attention mask, which implementation computes it, and what each one supports.

Attention never receives a materialised mask (except in the reference path, which builds it
here): a call carries a `MaskSpec` (positions, segment ids, sliding window; always causal), and
each kernel turns that into what it accepts (segment ids for the Pallas kernels, a causal or
local mask object for Splash, cuDNN's causal mask type and window length).

`model.attention_impl`:
    xla / einsum   the reference: explicit einsums with the mask (every backend; decode's cached steps)
    dot_product    jax.nn.dot_product_attention with the mask (XLA's attention; kept for saved runs)
    cudnn          cuDNN's fused flash attention (GPU, bf16, rows not packed)
    pallas_gpu     the Pallas-Triton flash kernel with segment ids (GPU; the CPU in interpret mode;
                   jax ≤ 0.12.0.1: jax 0.12.1 removed it)
    splash         the Pallas TPU Splash kernel with segment ids (TPU; the CPU in interpret mode)
    auto           the fastest correct one for the backend and the call (`resolve`)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from fbt_jax.errors import ConfigError

# The Pallas-Triton flash attention `pallas_gpu` calls is jax's own op, which jax 0.12.1 removed
# with the rest of its Triton ops (0.11.2 to 0.12.0.1 have it).
TRITON_ATTENTION = "jax.experimental.pallas.ops.gpu.attention"
REFERENCE = ("xla", "einsum")  # two names of one implementation ("einsum": what saved runs say)
KERNELS = ("cudnn", "pallas_gpu", "splash")
IMPLS = ("auto", *REFERENCE, "dot_product", *KERNELS)


@struct.dataclass
class MaskSpec:
    """Causal attention where query t sees key s iff s ≤ t, both share a segment (when segment ids
    are given: packed rows) and t − s < window (when window > 0). Positions restart at 0 in every
    segment and rise by one along the row, so index order and position order agree within a segment
    (what the kernels' index-based causal masks rely on)."""

    positions_BT: jax.Array
    segment_ids_BT: jax.Array | None = None
    window: int = struct.field(pytree_node=False, default=0)

    @property
    def packed(self) -> bool:
        return self.segment_ids_BT is not None


def reference_mask(spec: MaskSpec) -> jax.Array:
    """The materialised (B, 1, T, T) boolean mask, for the reference paths only."""
    positions_BT = spec.positions_BT
    T = positions_BT.shape[1]
    mask_BTT = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (positions_BT.shape[0], T, T))
    if spec.segment_ids_BT is not None:
        mask_BTT = mask_BTT & (spec.segment_ids_BT[:, :, None] == spec.segment_ids_BT[:, None, :])
    if spec.window:
        mask_BTT = mask_BTT & (positions_BT[:, :, None] - positions_BT[:, None, :] < spec.window)
    return mask_BTT[:, None]


def pad_rows(
    length: int, q_BTNH: jax.Array, k_BTGH: jax.Array, v_BTGH: jax.Array, segment_ids_BT: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """q, k, v and segment ids padded at the end of each row to `length` (a kernel's block
    multiple): causality keeps every real query from seeing the padding, which is its own segment."""
    extra = length - q_BTNH.shape[1]
    if not extra:
        return q_BTNH, k_BTGH, v_BTGH, segment_ids_BT
    q_BTNH, k_BTGH, v_BTGH = (jnp.pad(x, ((0, 0), (0, extra), (0, 0), (0, 0))) for x in (q_BTNH, k_BTGH, v_BTGH))
    if segment_ids_BT is not None:
        segment_ids_BT = jnp.pad(segment_ids_BT, ((0, 0), (0, extra)), constant_values=-1)
    return q_BTNH, k_BTGH, v_BTGH, segment_ids_BT


@functools.cache
def triton_attention_missing() -> bool:
    """Whether the installed jax lacks the Pallas-Triton attention op (jax ≥ 0.12.1). Looked up
    without importing it: its import warns that it is deprecated."""
    return importlib.util.find_spec(TRITON_ATTENTION) is None


@dataclasses.dataclass(frozen=True)
class Call:
    """The static facts of one attention call that decide which implementations can serve it."""

    platform: str  # jax.default_backend(): cpu | gpu | tpu
    dtype: str  # compute dtype of q, k, v
    packed: bool
    window: int
    head_dim: int


def unsupported(impl: str, call: Call) -> str | None:
    """Why `impl` cannot compute `call` (a phrase), or None when it can."""
    if impl in (*REFERENCE, "dot_product"):
        return None
    if impl == "cudnn":
        if call.platform != "gpu":
            return f"cuDNN runs on GPUs only (this backend is {call.platform})"
        if call.dtype not in ("bfloat16", "float16"):
            return f"cuDNN's flash attention computes in bf16/fp16, not {call.dtype}"
        if call.packed:
            return "cuDNN is not used for packed rows (see docs/performance.md)"
        if call.head_dim % 8 or call.head_dim > 256:
            return f"cuDNN needs a head dim that is a multiple of 8 and at most 256, not {call.head_dim}"
        return None
    if impl == "pallas_gpu":
        if call.platform not in ("gpu", "cpu"):
            return f"the Pallas-Triton kernel runs on GPUs (and on the CPU in interpret mode), not {call.platform}"
        if call.window:
            return "the Pallas-Triton kernel has no sliding window"
        if triton_attention_missing():
            return (
                f"jax {jax.__version__} no longer has the Pallas-Triton kernel ({TRITON_ATTENTION}, "
                "removed in jax 0.12.1; 0.11.2 to 0.12.0.1 have it)"
            )
        return None
    if impl == "splash":
        if call.platform not in ("tpu", "cpu"):
            return f"Splash runs on TPUs (and on the CPU in interpret mode), not {call.platform}"
        return None
    raise ConfigError(f"model.attention_impl={impl!r} is unknown; use one of {IMPLS}")


def serving(call: Call) -> list[str]:
    """The implementations that can compute `call`, fastest first for its platform."""
    preference = {"gpu": ("cudnn", "pallas_gpu"), "tpu": ("splash",)}.get(call.platform, ())
    return [impl for impl in (*preference, "xla", "dot_product") if unsupported(impl, call) is None]


def resolve(impl: str, call: Call) -> str:
    """The implementation that computes `call`: `impl` itself, or for `auto` the fastest correct one
    (cuDNN, then Pallas-Triton on GPU; Splash on TPU; the reference elsewhere). ConfigError naming
    one that can when `impl` cannot."""
    if impl == "auto":
        return serving(call)[0]
    why = unsupported(impl, call)
    if why is not None:
        able = ", ".join(i for i in serving(call))
        rows = "packed rows" if call.packed else "rows"
        window = f", sliding window {call.window}" if call.window else ""
        raise ConfigError(
            f"model.attention_impl={impl}: {why}; for {call.dtype} {rows}{window} on {call.platform} use one of: "
            f"{able} (or auto)"
        )
    return "xla" if impl == "einsum" else impl


def here(impl: str, dtype: str, window: int, head_dim: int) -> str:
    """`impl` where this process's backend runs it natively, else `auto`: a trained run's choice was
    made for where it trained (cuDNN or Pallas-Triton on a GPU), and decoding it elsewhere must
    neither fail on that nor run a kernel in interpret mode."""
    backend = jax.default_backend()
    if impl == "auto" or {"cudnn": "gpu", "pallas_gpu": "gpu", "splash": "tpu"}.get(impl, backend) != backend:
        return "auto"
    return impl if unsupported(impl, Call(backend, dtype, False, window, head_dim)) is None else "auto"


def call_of(q_BTNH: Any, spec: MaskSpec, platform: str | None = None) -> Call:
    """The `Call` of attention over `q_BTNH` under `spec` on this process's default backend."""
    return Call(
        platform or jax.default_backend(), jnp.dtype(q_BTNH.dtype).name, spec.packed, spec.window, q_BTNH.shape[-1]
    )


def interpret_mode(impl: str, platform: str) -> bool:
    """Whether the Pallas kernel `impl` runs in interpret mode on `platform` (cpu | gpu | tpu): its
    grid run as a loop of small XLA ops, block by block; correct, but many times slower than the
    reference. Where a kernel compiles natively it is not interpreted (where it is refused, moot)."""
    if impl == "pallas_gpu":
        return platform == "cpu"
    if impl == "splash":
        return platform != "tpu"
    return False


def interpret_warning(impl: str, platform: str) -> str | None:
    """The start-up line saying that `model.attention_impl=impl` runs in interpret mode on
    `platform`, why that is slow and what to use instead; None when it runs natively."""
    if not interpret_mode(impl, platform):
        return None
    kernel = {"pallas_gpu": "GPU kernel (Pallas-Triton)", "splash": "TPU kernel (Splash)"}[impl]
    return (
        f"warning: model.attention_impl={impl} runs the {kernel} in Pallas interpret mode on {platform}, its grid "
        f"a loop of small XLA ops: correct, but many times slower than xla; on {platform} use "
        "--config.model.attention_impl=xla (or auto)"
    )


def describe(impl: str, platform: str, dtype: str, packed: bool, window: int, head_dim: int) -> str:
    """The start-up line: "attention: pallas_gpu (packed rows: segment ids)"."""
    chosen = resolve(impl, Call(platform, dtype, packed, window, head_dim))
    how = {
        "xla": "XLA einsums over the mask",
        "dot_product": "jax.nn.dot_product_attention over the mask",
        "cudnn": "cuDNN flash, causal",
        "pallas_gpu": "segment ids" if packed else "causal",
        "splash": "segment ids" if packed else "causal",
    }[chosen]
    rows = "packed rows" if packed else "rows not packed"
    window_note = f", sliding window {window}" if window else ""
    requested = "" if impl == chosen else f" (model.attention_impl={impl})"
    return f"attention: {chosen}{requested} ({rows}: {how}{window_note})"
