"""The pure step functions: `train_step(state, batch, constants)` and `eval_step(params, batch)`
for a static pass count K, and the optimizer they update with. No I/O, no Python state: `programs.py` compiles
them ahead of time, once per K, with explicit shardings.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx, struct

from fbt_jax.contraction import pass_change_sums
from fbt_jax.feedback import PassOptions, data_fuse, draw_fuse_from, kpass_forward, kpass_loss
from fbt_jax.layers import default_positions
from fbt_jax.losses import readout_stats
from fbt_jax.train.learning_rate import learning_rate, schedule_constants, schedule_of


@struct.dataclass
class TrainState:
    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """Everything static the step needs besides K (closed over, hashed into the compile)."""

    pass_options: PassOptions
    prefix_mixin_prob: float
    fuse_from_min: int
    fuse_from_max: int
    microbatches: int = 1


def step_settings(config: ml_collections.ConfigDict) -> StepSettings:
    p = config.passes
    return StepSettings(
        pass_options=PassOptions(
            noise_std=float(p.noise_std),
            stop_gradient=bool(p.stop_gradient),
            loss_weights=tuple(float(w) for w in p.loss_weights),
        ),
        prefix_mixin_prob=float(p.prefix_mixin_prob),
        fuse_from_min=int(p.fuse_from_min),
        fuse_from_max=int(p.fuse_from_max),
        microbatches=int(config.train.microbatches),
    )


def step_constants(config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
    """The train step's run constants, arguments of the compiled step rather than numbers baked into
    it: the learning-rate schedule's (learning_rate.schedule_constants) and the seed that keys the
    per-step randomness. Runs that differ only in their length, schedule or seed (a sweep's seeds)
    share their compiled programs."""
    return {**schedule_constants(config), "seed": np.int32(config.seed)}


def make_optimizer(config: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """The run's optimizer with its learning-rate schedule's constants fixed, and that schedule:
    for the state's layout and for use outside the compiled step (which builds its own from the
    constants it is given: `optimizer_with`)."""
    lr_schedule = schedule_of(config)
    return optimizer_with(config, lr_schedule), lr_schedule


def optimizer_with(config: ml_collections.ConfigDict, lr_schedule: optax.Schedule) -> optax.GradientTransformation:
    """AdamW with `config`'s settings at `lr_schedule`, after global-norm clipping."""
    o = config.optimizer

    def decay_mask(params: nnx.State) -> Any:
        # Decay matrices only. The fusion matrices are exempt: they get no gradient while K = 1
        # (most of the run), and decoupled decay would shrink them towards 0 before feedback starts.
        def is_decayed(path: tuple, leaf: Any) -> bool:
            return leaf.ndim >= 2 and "fusion" not in {str(getattr(k, "key", k)) for k in path}

        return jax.tree_util.tree_map_with_path(is_decayed, params)

    chain = [optax.clip_by_global_norm(o.grad_clip_norm)] if o.grad_clip_norm > 0 else []
    chain.append(optax.adamw(lr_schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask))
    return optax.chain(*chain)


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    constants: dict[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    make_tx: Callable[[optax.Schedule], optax.GradientTransformation],
    settings: StepSettings,
    num_passes: int,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step with K = `num_passes`, at the learning rate that `constants`
    (`step_constants`: data, not part of the program) give `state.step`."""
    lr_schedule = functools.partial(learning_rate, constants=constants)
    tx = make_tx(lr_schedule)
    # Per-step randomness (prefix mix-in, noise) is keyed by (seed, step) only, like K.
    step_rng = jax.random.fold_in(jax.random.PRNGKey(constants["seed"]), state.step)
    fuse_rng, noise_rng = jax.random.split(step_rng)
    fuse_from_B = draw_fuse_from(
        fuse_rng, batch["inputs"].shape[0], settings.prefix_mixin_prob, settings.fuse_from_min, settings.fuse_from_max
    )
    # Chat data fuses its replies and reads its prompts plainly, token by token (docs/post-training.md):
    # the mask is data, so the program is the same whatever the data says.
    fuse = fuse_from_B if "fuse" not in batch else data_fuse(batch["fuse"], fuse_from_B, _positions(batch))

    def loss_fn(params: nnx.State, part: dict[str, jax.Array], weight_total: jax.Array | None) -> tuple:
        model = nnx.merge(graphdef, params)
        examples = {k: v for k, v in part.items() if k not in ("fuse_from", "fuse")}  # with "rows": their place
        options = settings.pass_options
        return kpass_loss(model, examples, part["fuse_from"], num_passes, options, noise_rng, weight_total=weight_total)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    rows_B = jnp.arange(batch["inputs"].shape[0], dtype=jnp.int32)
    whole = {**batch, "fuse_from": fuse, "rows": rows_B}
    if settings.microbatches == 1:
        (loss, metrics), grads = grad_fn(state.params, whole, None)
    else:
        (loss, metrics), grads = accumulate(grad_fn, state.params, whole, settings.microbatches)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        **metrics,
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": lr_schedule(state.step),
        "mean_fuse_from": jnp.mean(fuse_from_B.astype(jnp.float32)),
    }
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def _positions(batch: dict[str, jax.Array]) -> jax.Array:
    return batch["positions"] if "positions" in batch else default_positions(batch["inputs"].shape)


def accumulate(grad_fn: Any, params: nnx.State, whole: dict[str, jax.Array], microbatches: int) -> tuple:
    """`grad_fn` summed over microbatches, one at a time (gradient accumulation).

    Microbatch m holds rows m, m + M, m + 2M, … of the global batch: with the batch split across
    devices by rows, every device then holds its share of every microbatch (no resharding). Each
    microbatch's loss is normalised by the whole batch's token weight, so the sums equal the
    full-batch loss and gradient (to fp32 rounding), whatever M.
    """
    B, M = whole["inputs"].shape[0], microbatches
    parts = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(B // M, M, *x.shape[1:]), 0, 1), whole)
    weight_total = jnp.sum(whole["weights"].astype(jnp.float32))

    def add(total: tuple, part: dict[str, jax.Array]) -> tuple[tuple, None]:
        (loss, metrics), grads = grad_fn(params, part, weight_total)
        return jax.tree.map(jnp.add, total, ((loss, metrics), grads)), None

    first = jax.tree.map(lambda x: x[0], parts)
    init = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: grad_fn(params, first, weight_total)))
    total, _ = jax.lax.scan(add, init, parts)
    return total


def _held_out_passes(
    model: Any, batch: dict[str, jax.Array], fuse_from: int, num_passes: int
) -> tuple[list[jax.Array], jax.Array, jax.Array]:
    """States of passes 1..num_passes (no noise), each row fused from `fuse_from`, and the
    positions and fuse-from indices the contraction sums need."""
    fuse_from_B = jnp.full((batch["inputs"].shape[0],), fuse_from, jnp.int32)
    positions_BT = _positions(batch)
    # Chat rows are fused where their data says (the contraction sums still count from `fuse_from`).
    fuse = fuse_from_B if "fuse" not in batch else data_fuse(batch["fuse"], fuse_from_B, positions_BT)
    states = kpass_forward(
        model, batch["inputs"], fuse, num_passes, positions_BT=positions_BT, segment_ids_BT=batch.get("segment_ids")
    )
    return states, fuse_from_B, positions_BT


def eval_step(
    params: nnx.State,
    batch: dict[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    num_passes: int,
    fuse_from: int,
    monitored: tuple[int, int] | None = None,
) -> dict[str, jax.Array]:
    """Summed NLL, correct tokens and weight for each pass 1..num_passes (no noise), and for the
    `monitored` (first, last) passes the contraction monitor's sums (`contraction.py`).

    Without noise, pass k of a K-pass forward equals the last pass of a k-pass forward, so one
    program with the largest K evaluates every smaller K too.
    """
    model = nnx.merge(graphdef, params)
    deepest = max(num_passes, monitored[1]) if monitored else num_passes
    states, fuse_from_B, positions_BT = _held_out_passes(model, batch, fuse_from, deepest)
    out = {}
    for k, h_BTD in enumerate(states[:num_passes], start=1):
        out |= {
            f"{name}_{k}": value
            for name, value in readout_stats(model, h_BTD, batch["targets"], batch["weights"]).items()
        }
    if monitored:
        out |= pass_change_sums(states, *monitored, fuse_from_B, positions_BT)
    return out


def contraction_step(
    params: nnx.State,
    batch: dict[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    fuse_from: int,
    monitored: tuple[int, int],
) -> dict[str, jax.Array]:
    """Only the contraction monitor's sums on one held-out batch: the forward passes without any
    readout (cheap enough to run every few hundred steps)."""
    model = nnx.merge(graphdef, params)
    states, fuse_from_B, positions_BT = _held_out_passes(model, batch, fuse_from, monitored[1])
    return pass_change_sums(states, *monitored, fuse_from_B, positions_BT)


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating-point leaf of `tree` is finite (one device boolean)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)
