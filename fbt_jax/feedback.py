"""Latent feedback: the K-pass objective (docs/method.md §5), prefix mix-in (§7) and its ground truth (§4).

Sequential semantics (what inference does). With fuse-from index p ≥ 1 per example:
    u_t = e_t                      for t < p
    u_t = fuse(e_t, h_{t-1})       for t ≥ p, with h = F(u) itself computed from fused inputs.
`sequential_feedback` computes this recurrence position by position.

The K-pass objective approximates it with K parallel passes over the whole sequence: pass 1 is
an ordinary forward pass, pass k fuses pass k−1's states shifted right by one. By induction
pass k is exact at every position t < p + k − 1 (the exactness property the tests check).

Where a row is fused is `fuse`: per example a fuse-from position p (B,) within each packed document,
or per token a mask (B, T), for chat data whose replies are fused and prompts read plainly
(docs/post-training.md). With a mask, pass k is exact at a position when every fused input up to it in
its document is among the first k − 1 of its run of fused inputs: in a document with one reply (chat
data's default), at the reply's first k − 1 tokens, as with p.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fbt_jax.layers import default_positions
from fbt_jax.losses import mean_loss, readout_nll
from fbt_jax.model import FBTransformer


def shift_right(h_BTD: jax.Array) -> jax.Array:
    """Position t receives h_{t-1}; position 0 receives zeros (it is never fused since p ≥ 1)."""
    return jnp.pad(h_BTD, ((0, 0), (1, 0), (0, 0)))[:, :-1]


def fused_positions(fuse: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """(B, T) bool, where inputs are fused: position ≥ p for fuse-from indices p (B,), or a mask (B, T).

    Using the (per-document) position rather than the index makes packed sequences safe: a
    document's first token has position 0 < p and never reads the previous document's state
    (a mask must leave every document's first token unfused itself: chat data does).
    """
    return fuse.astype(bool) if fuse.ndim == 2 else positions_BT >= fuse[:, None]


def data_fuse(fuse_BT: jax.Array, fuse_from_B: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """(B, T) bool: where a batch's data says (chat rows: 1 fused, 0 read plainly), else (-1: a pretraining
    row in a mixture with chat data) from the row's drawn fuse-from, as for pretraining data alone."""
    return jnp.where(fuse_BT < 0, positions_BT >= fuse_from_B[:, None], fuse_BT > 0)


def feedback_inputs(
    model: FBTransformer,
    e_BTD: jax.Array,
    h_prev_BTD: jax.Array,
    fuse: jax.Array,
    positions_BT: jax.Array,
) -> jax.Array:
    """U for one feedback pass: fuse(e_t, h_{t-1}) where `fuse` says (`fused_positions`), the plain e_t elsewhere."""
    fused_BTD = model.fusion(e_BTD, shift_right(h_prev_BTD))
    is_fused_BT1 = fused_positions(fuse, positions_BT)[..., None]
    return jnp.where(is_fused_BT1, fused_BTD, e_BTD.astype(fused_BTD.dtype))


@dataclasses.dataclass(frozen=True)
class PassOptions:
    """How the K passes are run in training (static; from `config.passes`)."""

    noise_std: float = 0.0  # jitter N(0, σ²) on the carried state (docs/method.md §7)
    stop_gradient: bool = False  # cut the gradient from pass k into pass k−1's states
    loss_weights: tuple[float, ...] = ()  # w_k per pass; () means all ones

    def pass_weights(self, num_passes: int) -> jax.Array:
        if self.loss_weights and len(self.loss_weights) < num_passes:
            raise ValueError(f"passes.loss_weights has {len(self.loss_weights)} entries, fewer than K={num_passes}")
        w = self.loss_weights[:num_passes] if self.loss_weights else (1.0,) * num_passes
        w = jnp.asarray(w, jnp.float32)
        return w / jnp.sum(w)


def feedback_pass(
    model: FBTransformer,
    e_BTD: jax.Array,
    h_prev_BTD: jax.Array,
    fuse: jax.Array,
    positions_BT: jax.Array,
    segment_ids_BT: jax.Array | None = None,
) -> jax.Array:
    """One more pass: H' = F(fuse(E, shift(H))), fused where `fuse` says."""
    return model.stack(feedback_inputs(model, e_BTD, h_prev_BTD, fuse, positions_BT), positions_BT, segment_ids_BT)


def last_pass_inputs(
    model: FBTransformer,
    e_BTD: jax.Array,
    fuse: jax.Array,
    num_passes: int,
    positions_BT: jax.Array,
    segment_ids_BT: jax.Array | None = None,
    options: PassOptions = PassOptions(),
    noise_rng: jax.Array | None = None,
    row_ids_B: jax.Array | None = None,
) -> tuple[list[jax.Array], jax.Array]:
    """The K-pass loop up to the last pass: ([H¹, …, Hᴷ⁻¹], Uᴷ), the inputs of pass K.

    The one place passes are chained. Training and evaluation run the last pass with `model.stack`
    (`kpass_forward`); fused-prefill decoding runs it through the KV cache; probes block by block.
    `num_passes` is a static Python int: the passes are an unrolled loop, so each K is its own
    compiled program (XLA then schedules each pass's matmuls like any other layer).
    """
    if num_passes < 1:
        raise ValueError(f"num_passes={num_passes}: every forward runs at least one pass")
    if options.noise_std > 0.0 and noise_rng is None:
        raise ValueError("noise_std > 0 needs a noise_rng (noise is for training; pass noise_std=0 to evaluate)")
    states, u_BTD = [], e_BTD
    for k in range(1, num_passes):
        h_BTD = model.stack(u_BTD, positions_BT, segment_ids_BT)
        states.append(h_BTD)
        carried_BTD = jax.lax.stop_gradient(h_BTD) if options.stop_gradient else h_BTD
        if options.noise_std > 0.0:
            noise_BTD = pass_noise(noise_rng, k, row_ids_B, carried_BTD.shape)
            carried_BTD = carried_BTD + (options.noise_std * noise_BTD).astype(carried_BTD.dtype)
        u_BTD = feedback_inputs(model, e_BTD, carried_BTD, fuse, positions_BT)
    return states, u_BTD


def pass_noise(noise_rng: jax.Array, k: int, row_ids_B: jax.Array | None, shape_BTD: tuple[int, ...]) -> jax.Array:
    """N(0, 1) noise for pass k, drawn per example from a key of (noise_rng, k, its row in the
    global batch): the same whichever microbatch the row is computed in (`train.microbatches`)."""
    B, T, D = shape_BTD
    rows_B = jnp.arange(B) if row_ids_B is None else row_ids_B
    pass_key = jax.random.fold_in(noise_rng, k)
    return jax.vmap(lambda row: jax.random.normal(jax.random.fold_in(pass_key, row), (T, D), jnp.float32))(rows_B)


def kpass_forward(
    model: FBTransformer,
    tokens_BT: jax.Array,
    fuse: jax.Array,
    num_passes: int,
    options: PassOptions = PassOptions(),
    noise_rng: jax.Array | None = None,
    positions_BT: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
    row_ids_B: jax.Array | None = None,
) -> list[jax.Array]:
    """Top states of each of the K passes, [H¹, …, Hᴷ] (docs/method.md §5)."""
    if positions_BT is None:
        positions_BT = default_positions(tokens_BT.shape)
    e_BTD = model.embed(tokens_BT)
    states, u_BTD = last_pass_inputs(
        model, e_BTD, fuse, num_passes, positions_BT, segment_ids_BT, options, noise_rng, row_ids_B
    )
    return [*states, model.stack(u_BTD, positions_BT, segment_ids_BT)]


def kpass_loss(
    model: FBTransformer,
    batch: dict[str, jax.Array],
    fuse: jax.Array,
    num_passes: int,
    options: PassOptions = PassOptions(),
    noise_rng: jax.Array | None = None,
    *,
    weight_total: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The K-pass objective: Σ_k w_k · NTP(Hᵏ) / Σ_k w_k, with per-pass losses as metrics.

    `batch` holds `inputs`, `targets`, `weights` (B, T) and optionally `positions`/`segment_ids`.
    Gradients of later passes flow into earlier passes' states unless `options.stop_gradient`.
    For a microbatch, `batch["rows"]` are its rows in the global batch and `weight_total` the
    global batch's summed weight: the microbatches' losses (and gradients) add up to the batch's.
    """
    states = kpass_forward(
        model,
        batch["inputs"],
        fuse,
        num_passes,
        options,
        noise_rng,
        batch.get("positions"),
        batch.get("segment_ids"),
        batch.get("rows"),
    )

    def pass_loss(h_BTD: jax.Array) -> jax.Array:
        nll, weight = readout_nll(model, h_BTD, batch["targets"], batch["weights"])
        return mean_loss(nll, weight) if weight_total is None else nll / jnp.maximum(weight_total, 1e-8)

    pass_losses = jnp.stack([pass_loss(h) for h in states])
    loss = jnp.sum(options.pass_weights(num_passes) * pass_losses)
    metrics = {f"loss_pass_{k + 1}": pass_losses[k] for k in range(num_passes)}
    return loss, metrics


def draw_fuse_from(rng: jax.Array, batch_size: int, mixin_prob: float, low: int, high: int) -> jax.Array:
    """Prefix mix-in (docs/method.md §7): per example, p ~ U{low..high} with probability `mixin_prob`,
    else p = 1 (fully fused), so training sees "plain prompt, then fused" as inference does."""
    coin_rng, p_rng = jax.random.split(rng)
    random_p_B = jax.random.randint(p_rng, (batch_size,), low, high + 1, dtype=jnp.int32)
    use_random_B = jax.random.uniform(coin_rng, (batch_size,)) < mixin_prob
    return jnp.where(use_random_B, random_p_B, 1).astype(jnp.int32)


def sequential_feedback(
    model: FBTransformer,
    tokens_BT: jax.Array,
    fuse: jax.Array,
    positions_BT: jax.Array | None = None,
    segment_ids_BT: jax.Array | None = None,
) -> jax.Array:
    """Ground truth (docs/method.md §4): the latent-feedback recurrence, one position at a time.

    Position t's input needs h_{t-1}, computed from fused inputs itself. Since F is causal,
    h_{t-1} depends only on u_0..u_{t-1}, so step t re-runs F over the buffer of inputs decided
    so far and writes u_t. Deliberately simple (T full forward passes, no KV cache) so that it
    can serve as an independent reference for the K-pass objective and for cached decoding.
    Returns the top states h (B, T, D) of the recurrence.
    """
    if positions_BT is None:
        positions_BT = default_positions(tokens_BT.shape)
    e_BTD = model.embed(tokens_BT)
    u0_BTD = e_BTD.astype(model.fusion.compute_dtype)
    fused_BT = fused_positions(fuse, positions_BT)

    def decide_input(t: jax.Array, u_BTD: jax.Array) -> jax.Array:
        h_BTD = model.stack(u_BTD, positions_BT, segment_ids_BT)
        e_t = jax.lax.dynamic_index_in_dim(e_BTD, t, axis=1)  # (B, 1, D)
        h_prev = jax.lax.dynamic_index_in_dim(h_BTD, t - 1, axis=1)
        fused_t = model.fusion(e_t, h_prev)
        fused_t_B1 = jax.lax.dynamic_index_in_dim(fused_BT, t, axis=1)  # (B, 1)
        u_t = jnp.where(fused_t_B1[..., None], fused_t, e_t.astype(fused_t.dtype))
        return jax.lax.dynamic_update_index_in_dim(u_BTD, u_t, t, axis=1)

    u_BTD = jax.lax.fori_loop(1, tokens_BT.shape[1], decide_input, u0_BTD)
    return model.stack(u_BTD, positions_BT, segment_ids_BT)
