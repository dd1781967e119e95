"""Model FLOPs, counted explicitly from the shapes (matmuls only, 2 FLOPs per multiply-add).

Counted per token and per pass: the q/k/v/o projections, attention scores and the weighted sum
of values, the SwiGLU MLP, the tied readout (every pass computes its logits for its loss) and, in
feedback passes, the fusion matmuls. Attention is counted as computed here: the full T×T score
matrix is formed and masked, so 2·T·N·H for QKᵀ plus 2·T·N·H for PV per layer (a causal kernel
that skips the masked half would do half of that: `causal_half=True` counts it so, as MaxText
reports MFU). Norms, rotary, softmax and the embedding gather
are not matmuls and are left out. A training step costs 3× the forward (backward = 2× forward).

MFU is these model FLOPs per second over the devices' peak (`hardware.py`).
"""

from __future__ import annotations

from fbt_jax.model import ModelConfig


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal_half: bool = False) -> dict[str, float]:
    """Forward matmul FLOPs per token of one plain pass, by part, plus the fusion's cost."""
    D, F, V, H = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size, cfg.head_size
    N, K, L = cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
    return {
        "attention_projections": L * 2 * D * H * (2 * N + 2 * K),
        "attention_scores_values": L * 2 * 2 * seq_len * N * H // (2 if causal_half else 1),
        "mlp": L * 3 * 2 * D * F,
        "readout": 2 * D * V,
        "fusion": (2 if cfg.fusion == "glu" else 1) * 2 * D * D,  # only in feedback passes
    }


def forward_flops(cfg: ModelConfig, seq_len: int, num_passes: int, causal_half: bool = False) -> float:
    """Forward FLOPs per token of a K-pass forward (pass 1 plain, K−1 feedback passes)."""
    parts = forward_flops_per_token(cfg, seq_len, causal_half)
    one_pass = sum(v for k, v in parts.items() if k != "fusion")
    return num_passes * one_pass + (num_passes - 1) * parts["fusion"]


def train_step_flops(
    cfg: ModelConfig, batch_size: int, seq_len: int, num_passes: int, causal_half: bool = False
) -> float:
    """FLOPs of one K-pass training step: forward and backward over the whole batch."""
    return 3.0 * batch_size * seq_len * forward_flops(cfg, seq_len, num_passes, causal_half)


def feedback_overhead_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Extra forward cost of one latent-feedback decode step relative to a standard one."""
    parts = forward_flops_per_token(cfg, seq_len)
    return parts["fusion"] / sum(v for k, v in parts.items() if k != "fusion")
