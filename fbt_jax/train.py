"""Training loop and the `fbt-train` command.

The step is a pure function `train_step(state, batch) -> (state, metrics)`, specialised per
pass count K (a static int) and compiled ahead of time for every K the schedule can draw, with
explicit shardings and the old state donated. The Python loop only picks K for the step (a pure
function of (seed, step)), feeds the batch and logs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx, struct

from fbt_jax import sharding
from fbt_jax.config import validate_config
from fbt_jax.data import WordProblem, make_task
from fbt_jax.errors import ConfigError
from fbt_jax.feedback import PassOptions, draw_fuse_from, kpass_forward, kpass_loss, token_nll
from fbt_jax.metrics import MetricsWriter
from fbt_jax.model import ModelConfig, build_model, count_params
from fbt_jax.schedule import PassSchedule


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
    seed: int


def make_optimizer(config: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation, optax.Schedule]:
    o = config.optimizer
    lr_schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.learning_rate,
        warmup_steps=o.warmup_steps,
        decay_steps=config.train.steps,
        end_value=o.learning_rate * o.min_learning_rate_ratio,
    )

    def decay_mask(params: nnx.State) -> Any:
        # Decay matrices only. The fusion matrices are exempt: they get no gradient while K = 1
        # (most of the run), and decoupled decay would shrink them towards 0 before feedback starts.
        def is_decayed(path: tuple, leaf: Any) -> bool:
            return leaf.ndim >= 2 and "fusion" not in {str(getattr(k, "key", k)) for k in path}

        return jax.tree_util.tree_map_with_path(is_decayed, params)

    chain = [optax.clip_by_global_norm(o.grad_clip_norm)] if o.grad_clip_norm > 0 else []
    chain.append(optax.adamw(lr_schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask))
    return optax.chain(*chain), lr_schedule


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
        seed=int(config.seed),
    )


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    lr_schedule: optax.Schedule,
    settings: StepSettings,
    num_passes: int,
) -> tuple[TrainState, dict[str, jax.Array]]:
    # Per-step randomness (prefix mix-in, noise) is keyed by (seed, step) only, like K.
    step_rng = jax.random.fold_in(jax.random.PRNGKey(settings.seed), state.step)
    fuse_rng, noise_rng = jax.random.split(step_rng)
    fuse_from_B = draw_fuse_from(
        fuse_rng, batch["inputs"].shape[0], settings.prefix_mixin_prob, settings.fuse_from_min, settings.fuse_from_max
    )

    def loss_fn(params: nnx.State) -> tuple[jax.Array, dict[str, jax.Array]]:
        model = nnx.merge(graphdef, params)
        return kpass_loss(model, batch, fuse_from_B, num_passes, settings.pass_options, noise_rng)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
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


def eval_step(
    params: nnx.State,
    batch: dict[str, jax.Array],
    *,
    graphdef: nnx.GraphDef,
    num_passes: int,
    fuse_from: int,
) -> dict[str, jax.Array]:
    """Summed NLL, correct tokens and weight for each pass 1..num_passes (no noise).

    Without noise, pass k of a K-pass forward equals the last pass of a k-pass forward, so one
    program with the largest K evaluates every smaller K too.
    """
    model = nnx.merge(graphdef, params)
    fuse_from_B = jnp.full((batch["inputs"].shape[0],), fuse_from, jnp.int32)
    states = kpass_forward(model, batch["inputs"], fuse_from_B, num_passes)
    out = {}
    for k, h_BTD in enumerate(states, start=1):
        logits_BTV = model.logits(h_BTD)
        nll, weight = token_nll(logits_BTV, batch["targets"], batch["weights"])
        correct_BT = (jnp.argmax(logits_BTV, -1) == batch["targets"]) * batch["weights"]
        out[f"nll_{k}"], out[f"correct_{k}"], out[f"weight_{k}"] = nll, jnp.sum(correct_BT), weight
    return out


class Trainer:
    """Holds the compiled programs and runs the loop (thin: all math is in the pure steps)."""

    def __init__(self, config: ml_collections.ConfigDict, log: Any = print):
        self.config = config
        self.log = log
        self.mesh = sharding.make_mesh()
        self.schedule: PassSchedule = validate_config(config, num_devices=self.mesh.size)
        self.task: WordProblem = make_task(config)
        self.model_cfg = ModelConfig.from_config(config.model)
        self.tx, self.lr_schedule = make_optimizer(config)
        self.graphdef, self.state = self._init_state()
        self.train_programs: dict[int, Any] = {}
        self.eval_program: Any = None

    def _init_state(self) -> tuple[nnx.GraphDef, TrainState]:
        model = build_model(self.model_cfg, self.config.seed)
        graphdef, params = nnx.split(model, nnx.Param)
        state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params))
        return graphdef, jax.device_put(state, sharding.replicated(self.mesh))

    def _local_batch(self, split: str, step: int, batch_size: int) -> dict[str, Any]:
        indices = np.arange(step * batch_size, (step + 1) * batch_size)[sharding.process_rows(batch_size)]
        return sharding.global_batch(self.task.examples(split, indices), self.mesh, batch_size)

    def compile(self) -> dict[str, float]:
        """Compile the train program of every K the schedule can draw, and the eval program."""
        times = {}
        state_sh = sharding.replicated(self.mesh)
        batch_sh = sharding.batch_sharding(self.mesh)
        settings = step_settings(self.config)
        batch = self._local_batch("train", 0, self.config.train.batch_size)
        for k in self.schedule.pass_counts:
            fn = functools.partial(
                train_step,
                graphdef=self.graphdef,
                tx=self.tx,
                lr_schedule=self.lr_schedule,
                settings=settings,
                num_passes=k,
            )
            jitted = jax.jit(
                fn, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, state_sh), donate_argnums=0
            )
            start = time.perf_counter()
            self.train_programs[k] = jitted.lower(self.state, batch).compile()
            times[f"train_K{k}"] = time.perf_counter() - start
            self.log(f"compiled train step K={k} in {times[f'train_K{k}']:.1f}s")
        if self.config.eval.num_batches > 0:
            e = self.config.eval
            fn = functools.partial(
                eval_step, graphdef=self.graphdef, num_passes=max(e.num_passes), fuse_from=e.fuse_from
            )
            jitted = jax.jit(fn, in_shardings=(state_sh, batch_sh), out_shardings=state_sh)
            start = time.perf_counter()
            self.eval_program = jitted.lower(
                self.state.params, self._local_batch("validation", 0, e.batch_size)
            ).compile()
            times["eval"] = time.perf_counter() - start
            self.log(f"compiled eval (K up to {max(e.num_passes)}) in {times['eval']:.1f}s")
        return times

    def evaluate(self) -> dict[str, float]:
        """Held-out loss and token accuracy for each K in eval.num_passes."""
        e = self.config.eval
        totals: dict[str, float] = {}
        for i in range(e.num_batches):
            out = jax.device_get(self.eval_program(self.state.params, self._local_batch("validation", i, e.batch_size)))
            for key, value in out.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        results = {}
        for k in sorted(set(e.num_passes)):
            results[f"loss_K{k}"] = totals[f"nll_{k}"] / max(totals[f"weight_{k}"], 1e-8)
            results[f"accuracy_K{k}"] = totals[f"correct_{k}"] / max(totals[f"weight_{k}"], 1e-8)
        return results

    def train(self, progress: bool = True) -> dict[str, Any]:
        cfg = self.config
        workdir = cfg.workdir
        os.makedirs(workdir, exist_ok=True)
        _set_aside_previous_outputs(workdir, self.log)
        if jax.process_index() == 0:
            with open(os.path.join(workdir, "config.json"), "w", encoding="utf-8") as f:
                f.write(cfg.to_json_best_effort(indent=2))
        self.log(
            f"model: {count_params(nnx.merge(self.graphdef, self.state.params)):,} parameters; devices: {self.mesh.size}"
        )
        self.log(self.schedule.describe(cfg.train.steps))
        compile_times = self.compile()
        writer = MetricsWriter(workdir)
        steps, batch_size, seq_len = cfg.train.steps, cfg.train.batch_size, cfg.data.seq_len
        bar = _progress_bar(steps, enabled=progress and jax.process_index() == 0)
        start_time = interval_start = time.perf_counter()
        interval_steps = 0
        eval_results: dict[str, float] = {}
        try:
            for step in range(steps):
                k = self.schedule.num_passes(step)
                self.state, metrics = self.train_programs[k](self.state, self._local_batch("train", step, batch_size))
                interval_steps += 1
                bar.update(1)
                last = step + 1 == steps
                if (step + 1) % cfg.train.log_every == 0 or last:
                    metrics = {key: float(v) for key, v in jax.device_get(metrics).items()}
                    now = time.perf_counter()
                    tokens_per_second = interval_steps * batch_size * seq_len / (now - interval_start)
                    interval_start, interval_steps = now, 0
                    writer.write(step + 1, {"num_passes": k, **metrics, "tokens_per_second": tokens_per_second})
                    bar.set_postfix(loss=f"{metrics['loss']:.3f}", K=k, tok_s=f"{tokens_per_second:,.0f}")
                    if not np.isfinite(metrics["loss"]):
                        raise FloatingPointError(
                            f"loss is {metrics['loss']} at step {step + 1} (K={k}); the metrics so far are in "
                            f"{writer.paths['train']}. Lower optimizer.learning_rate or set optimizer.grad_clip_norm"
                        )
                if self.eval_program is not None and (
                    last or (cfg.eval.every_steps and (step + 1) % cfg.eval.every_steps == 0)
                ):
                    eval_results = self.evaluate()
                    writer.write(step + 1, eval_results, stream="eval")
        finally:
            bar.close()
            writer.close()
        elapsed = time.perf_counter() - start_time
        summary = {
            "steps": steps,
            "train_seconds": elapsed,
            "compile_seconds": compile_times,
            "eval": eval_results,
            "realised_mixture": self.schedule.realised_mixture(0, steps),
            "outputs": {
                "workdir": workdir,
                "metrics": writer.paths["train"],
                "eval": writer.paths["eval"],
                "tensorboard": writer.tensorboard_dir,
                "config": os.path.join(workdir, "config.json"),
            },
        }
        if jax.process_index() == 0:
            with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
        return summary


def _set_aside_previous_outputs(workdir: str, log: Any) -> None:
    """A new run never appends to (or deletes) an earlier run's logs: move them aside."""
    if jax.process_index() != 0:
        return
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for name in ("metrics.jsonl", "eval.jsonl", "summary.json", "tensorboard"):
        path = os.path.join(workdir, name)
        if os.path.exists(path):
            os.rename(path, os.path.join(workdir, f"previous-{stamp}-{name}"))
            log(f"kept earlier run's {name} as previous-{stamp}-{name}")


def _progress_bar(total: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, disable=not enabled, unit="step", dynamic_ncols=True, file=sys.stderr)


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"trained {summary['steps']} steps in {summary['train_seconds']:.1f}s"]
    if summary["eval"]:
        ks = sorted(int(key.split("K")[1]) for key in summary["eval"] if key.startswith("loss_"))
        lines.append("held-out eval (fully fused from position 1):")
        lines += [
            f"  K={k}: loss {summary['eval'][f'loss_K{k}']:.4f}  accuracy {summary['eval'][f'accuracy_K{k}']:.3f}"
            for k in ks
        ]
    out = summary["outputs"]
    lines.append(f"outputs in {out['workdir']}:")
    lines += [f"  {name:<12}{out[name]}" for name in ("metrics", "eval", "tensorboard", "config")]
    lines.append(f"  view with: tensorboard --logdir {out['tensorboard']}")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from absl import flags, logging

    del argv
    if not flags.FLAGS["verbosity"].present:
        # absl logs at INFO by default, which prints backend probing noise ("Unable to initialize
        # backend 'tpu'") on machines without one; --verbosity=0 brings it back.
        logging.set_verbosity(logging.WARNING)
    config = flags.FLAGS.config
    try:
        trainer = Trainer(config)
    except ConfigError as err:
        print(f"fbt-train: config error: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        summary = trainer.train()
    except FloatingPointError as err:
        print(f"fbt-train: training diverged: {err}", file=sys.stderr)
        sys.exit(3)
    if jax.process_index() == 0:
        print(format_summary(summary))


def cli() -> None:
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Path to a config file in configs/, e.g. configs/tiny.py.")
    flags.mark_flags_as_required(["config"])
    app.run(main)


if __name__ == "__main__":
    cli()
