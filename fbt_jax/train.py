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
import signal
import socket
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx, struct

from fbt_jax import checkpoint, distributed, paths, sharding, workdir
from fbt_jax.config import validate_config
from fbt_jax.data.pipeline import StepBatches, batch_iterator, make_source
from fbt_jax.errors import CheckpointError, ConfigError, Preempted, divert_library_noise, reported
from fbt_jax.feedback import PassOptions, draw_fuse_from, kpass_forward, kpass_loss, token_nll
from fbt_jax.metrics import MetricsWriter
from fbt_jax.model import ModelConfig, abstract_model, build_model, count_params
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
    states = kpass_forward(
        model,
        batch["inputs"],
        fuse_from_B,
        num_passes,
        positions_BT=batch.get("positions"),
        segment_ids_BT=batch.get("segment_ids"),
    )
    out = {}
    for k, h_BTD in enumerate(states, start=1):
        logits_BTV = model.logits(h_BTD)
        nll, weight = token_nll(logits_BTV, batch["targets"], batch["weights"])
        correct_BT = (jnp.argmax(logits_BTV, -1) == batch["targets"]) * batch["weights"]
        out[f"nll_{k}"], out[f"correct_{k}"], out[f"weight_{k}"] = nll, jnp.sum(correct_BT), weight
    return out


class Trainer:
    """Holds the mesh, the shardings and the compiled programs, and runs the loop.

    Thin on purpose: the math lives in the pure `train_step` / `eval_step`. Parameters and
    optimizer state are created directly sharded by a jitted init (never whole on one device), and
    every program is compiled ahead of time from abstract shapes, so `dry_run` needs no weights.
    """

    def __init__(self, config: ml_collections.ConfigDict, log: Any = print, devices: list | None = None):
        self.config = config
        self.log = log if jax.process_index() == 0 else (lambda *_: None)
        devices = list(jax.devices() if devices is None else devices)
        self.schedule: PassSchedule = validate_config(config, num_devices=len(devices))
        self.rules = sharding.parse_rules(config.sharding.rules)
        self.mesh = sharding.make_mesh(config.mesh, devices)
        self.batch_sharding = sharding.batch_sharding(self.mesh, self.rules)
        self.sources = {"train": make_source(config, "train")}
        if config.eval.num_batches > 0:
            self.sources["validation"] = make_source(config, "validation")
        if self.sources["train"].vocab_size > config.model.vocab_size:  # prepared data is known only now
            raise ConfigError(
                f"model.vocab_size={config.model.vocab_size} is smaller than the data's vocabulary "
                f"({self.sources['train'].vocab_size}); set --config.model.vocab_size={self.sources['train'].vocab_size} or larger"
            )
        self.model_cfg = ModelConfig.from_config(config.model)
        self.tx, self.lr_schedule = make_optimizer(config)
        self.layout = sharding.activation_layout(self.mesh, self.rules)
        model = abstract_model(self.model_cfg, self.layout)
        self.graphdef = nnx.split(model, nnx.Param)[0]
        self.abstract_state = jax.eval_shape(self._init_state)
        self.state_shardings = self._state_shardings()
        self.state: TrainState | None = None
        self.train_programs: dict[int, Any] = {}
        self.eval_program: Any = None

    def _init_state(self) -> TrainState:
        model = build_model(self.model_cfg, self.config.seed, self.layout)
        params = nnx.state(model, nnx.Param)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.tx.init(params))

    def _state_shardings(self) -> TrainState:
        params = sharding.param_shardings(self.abstract_state.params, self.mesh, self.rules)
        replicated = sharding.replicated(self.mesh)
        opt_state = optax.tree_map_params(
            self.tx,
            lambda _, param_sharding: param_sharding,
            self.abstract_state.opt_state,
            params,
            transform_non_params=lambda _: replicated,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
        return TrainState(step=replicated, params=params, opt_state=opt_state)

    def init_state(self) -> None:
        """Allocate the train state, each device creating only its own shards."""
        self.state = jax.jit(self._init_state, out_shardings=self.state_shardings)()

    def sharded_abstract_state(self) -> TrainState:
        """The train state's shapes and dtypes with the shardings this run places it with
        (what a checkpoint restores onto, and what programs are compiled for)."""
        return _with_shardings(self.abstract_state, self.state_shardings)

    def _abstract_batch(self, batch_size: int) -> dict[str, jax.ShapeDtypeStruct]:
        shape = (batch_size, self.config.data.seq_len)
        dtypes = {"inputs": jnp.int32, "targets": jnp.int32, "weights": jnp.float32}
        if self.sources["train"].packed:
            dtypes |= {"segment_ids": jnp.int32, "positions": jnp.int32}
        return {k: jax.ShapeDtypeStruct(shape, dt, sharding=self.batch_sharding) for k, dt in dtypes.items()}

    def step_batches(self, split: str, batch_size: int) -> StepBatches:
        """step → this process's rows of that step's global batch of `split` (validation unshuffled)."""
        rows = tuple(sharding.process_rows(self.batch_sharding, batch_size).tolist())
        shuffle = self.config.data.shuffle and split == "train"
        return StepBatches(self.sources[split], batch_size, rows, self.config.seed, shuffle)

    def to_global(self, local_rows: dict[str, np.ndarray], batch_size: int) -> dict[str, jax.Array]:
        return sharding.global_batch(local_rows, self.batch_sharding, batch_size)

    def batch(self, split: str, step: int, batch_size: int) -> dict[str, jax.Array]:
        """The global batch for `step`; this process loads only the rows its devices hold."""
        return self.to_global(self.step_batches(split, batch_size)(step), batch_size)

    def process_rows(self, batch_size: int) -> list[int]:
        """Which rows of each global batch this process loads (for logs and tests)."""
        return sharding.process_rows(self.batch_sharding, batch_size).tolist()

    def compile(self) -> dict[str, dict[str, float]]:
        """Compile the train program of every K the schedule can draw, and the eval program.

        Returns per program its compile time and, where the backend reports it, the per-device
        memory of the compiled program.
        """
        report: dict[str, dict[str, float]] = {}
        abstract_state = self.sharded_abstract_state()
        replicated = sharding.replicated(self.mesh)
        settings = step_settings(self.config)
        for k in self.schedule.pass_counts:
            step_fn = functools.partial(
                train_step,
                graphdef=self.graphdef,
                tx=self.tx,
                lr_schedule=self.lr_schedule,
                settings=settings,
                num_passes=k,
            )
            jitted = jax.jit(
                step_fn,
                in_shardings=(self.state_shardings, self.batch_sharding),
                out_shardings=(self.state_shardings, replicated),
                donate_argnums=0,
            )
            self.train_programs[k], report[f"train_K{k}"] = _compile(
                jitted, abstract_state, self._abstract_batch(self.config.train.batch_size)
            )
            self.log(f"compiled train step K={k}: {_describe(report[f'train_K{k}'])}")
        e = self.config.eval
        if e.num_batches > 0:
            eval_fn = functools.partial(
                eval_step, graphdef=self.graphdef, num_passes=max(e.num_passes), fuse_from=e.fuse_from
            )
            jitted = jax.jit(
                eval_fn, in_shardings=(self.state_shardings.params, self.batch_sharding), out_shardings=replicated
            )
            self.eval_program, report["eval"] = _compile(
                jitted, abstract_state.params, self._abstract_batch(e.batch_size)
            )
            self.log(f"compiled eval (K up to {max(e.num_passes)}): {_describe(report['eval'])}")
        return report

    def evaluate(self) -> dict[str, float]:
        """Held-out loss and token accuracy for each K in eval.num_passes."""
        e = self.config.eval
        totals: dict[str, float] = {}
        batches = self.step_batches("validation", e.batch_size)
        for i in range(e.num_batches):
            batch = self.to_global(batches(i), e.batch_size)
            out = jax.device_get(self.eval_program(self.state.params, batch))
            for key, value in out.items():
                totals[key] = totals.get(key, 0.0) + float(value)
        results = {}
        for k in sorted(set(e.num_passes)):
            results[f"loss_K{k}"] = totals[f"nll_{k}"] / max(totals[f"weight_{k}"], 1e-8)
            results[f"accuracy_K{k}"] = totals[f"correct_{k}"] / max(totals[f"weight_{k}"], 1e-8)
        return results

    def restore_or_init(
        self, checkpointer: checkpoint.Checkpointer | None
    ) -> tuple[int, checkpoint.Checkpointer | None]:
        """Resume from the newest checkpoint that restores, else initialise (optionally from
        init_from). Returns the step training starts at and the checkpointer to save with."""
        cfg = self.config
        if checkpointer is not None and cfg.checkpoint.restart_from_scratch and checkpointer.steps():
            aside = checkpointer.move_all_aside()
            self.log(f"restart_from_scratch: moved the earlier checkpoints to {aside}; starting at step 0")
            checkpointer = checkpoint.Checkpointer(str(checkpointer.directory), cfg.checkpoint, self.log)
        if checkpointer is not None:
            restored = checkpointer.restore_latest(self.sharded_abstract_state(), cfg)
            if restored is not None:
                self._check_resume(restored, checkpointer)
                self.state = restored.state
                self.log(f"resuming from checkpoint {checkpointer.directory}/{restored.step} (step {restored.step})")
                return restored.step, checkpointer
        self.init_state()
        if cfg.init_from:
            params = checkpoint.load_params(cfg.init_from, self.sharded_abstract_state().params, cfg, self.log)
            self.state = self.state.replace(params=params)
        return 0, checkpointer

    def _check_resume(self, restored: checkpoint.Restored, checkpointer: checkpoint.Checkpointer) -> None:
        """Refuse a non-finite checkpoint, and config changes that alter the data or the objective."""
        where = f"{checkpointer.directory}/{restored.step}"
        if not bool(jax.jit(_all_finite)(restored.state)):
            raise CheckpointError(
                f"checkpoint {where} holds non-finite values (written by a run that diverged); resume from an "
                "earlier one by moving this one aside, or start over with --config.checkpoint.restart_from_scratch=True"
            )
        free, guarded = workdir.resume_changes(restored.meta.get("config", {}), self.config)
        for line in free:
            self.log(f"resume: changed {line}")
        if guarded and not self.config.checkpoint.allow_resume_changes:
            for line in guarded:
                self.log(f"resume: changed {line}")
            raise ConfigError(
                f"resuming {where} with a changed {'; '.join(guarded)}: this changes the data order, the objective or "
                "the schedule mid-run; use the original values, or pass --config.checkpoint.allow_resume_changes=True"
            )
        for line in guarded:
            self.log(f"resume: changed {line} (allowed by checkpoint.allow_resume_changes)")

    def train(self, progress: bool = True) -> dict[str, Any]:
        cfg = self.config
        run_dir = workdir.RunDirectory(cfg.workdir)
        run_dir.lock()
        try:
            return self._train(run_dir, progress)
        finally:
            run_dir.unlock()

    def _train(self, run_dir: workdir.RunDirectory, progress: bool) -> dict[str, Any]:
        cfg = self.config
        steps, batch_size, seq_len = cfg.train.steps, cfg.train.batch_size, cfg.data.seq_len
        checkpointer = None
        if cfg.checkpoint.every_steps > 0:
            directory = cfg.checkpoint.dir or _join(cfg.workdir, "checkpoints")
            checkpointer = checkpoint.Checkpointer(directory, cfg.checkpoint, self.log)
        start_step, checkpointer = self.restore_or_init(checkpointer)
        distributed.check_schedule_agreement(self.schedule, start_step, steps)
        if start_step == 0:
            run_dir.set_aside_previous_outputs(self.log)
        run_dir.write_config(cfg, start_step)
        _write_process_info(self, run_dir.local)
        self.log(
            f"model: {count_params(self.abstract_state.params):,} parameters; mesh "
            + " × ".join(f"{a}={n}" for a, n in self.mesh.shape.items())
            + f" over {self.mesh.size} devices in {jax.process_count()} process(es)"
        )
        self.log(self.schedule.describe(steps))
        compile_report = self.compile()
        writer = MetricsWriter(run_dir.local, resume_step=start_step)
        bar = _progress_bar(steps, enabled=progress and jax.process_index() == 0, initial=start_step)
        start_time = interval_start = time.perf_counter()
        eval_results: dict[str, float] = {}
        previous_k = None
        pending: list[tuple[int, dict[str, jax.Array]]] = []  # (K, device metrics) since the last log
        shown = ""
        d = cfg.data
        batches = batch_iterator(self.step_batches("train", batch_size), start_step, d.num_workers, d.prefetch)
        preemption = PreemptionWatcher()
        failed = True
        try:
            for step in range(start_step, steps):
                k = self.schedule.num_passes(step)
                if k != previous_k:
                    distributed.check_step_agreement(step, k)
                    previous_k = k
                batch = self.to_global(next(batches), batch_size)
                self.state, metrics = self.train_programs[k](self.state, batch)
                pending.append((k, metrics))
                bar.update(1)
                bar.set_postfix_str(f"K={k}{shown}", refresh=False)
                last = step + 1 == steps
                stopping = preemption.should_stop(step + 1, checkpointer)
                saving = checkpointer is not None and (checkpointer.due(step + 1) or last or stopping)
                # A save is preceded by a log line: its finiteness check guards what is saved.
                if (step + 1) % cfg.train.log_every == 0 or last or stopping or saving:
                    record = interval_metrics(jax.device_get(pending))  # one transfer per interval
                    now = time.perf_counter()
                    record["tokens_per_second"] = len(pending) * batch_size * seq_len / (now - interval_start)
                    pending = []
                    writer.write(step + 1, record)
                    shown = f", loss={record['loss']:.3f}, tok/s={record['tokens_per_second']:,.0f}"
                    if not (np.isfinite(record["loss"]) and np.isfinite(record["grad_norm"])):
                        saved = checkpointer.steps() if checkpointer is not None else []
                        raise FloatingPointError(
                            f"loss {record['loss']}, gradient norm {record['grad_norm']} at step {step + 1} (K={k}); "
                            f"nothing after step {saved[-1] if saved else 0} was saved. Lower optimizer.learning_rate "
                            f"or set optimizer.grad_clip_norm, and rerun with --config.checkpoint.allow_resume_changes=True "
                            f"(metrics in {writer.paths['train']})"
                        )
                    if checkpointer is not None:
                        checkpointer.check_for_errors()
                    interval_start = time.perf_counter()
                if saving:
                    checkpointer.save(step + 1, self.state, cfg, force=True)
                    run_dir.sync()
                if stopping:
                    checkpointer.wait()
                    raise Preempted(
                        f"stopped at step {step + 1} on request; saved {checkpointer.directory}/{step + 1}; "
                        "run the same command again to resume"
                    )
                if self.eval_program is not None and (
                    last or (cfg.eval.every_steps and (step + 1) % cfg.eval.every_steps == 0)
                ):
                    eval_start = time.perf_counter()
                    eval_results = self.evaluate()
                    writer.write(step + 1, eval_results, stream="eval")
                    interval_start += time.perf_counter() - eval_start  # tokens/s counts training only
            if start_step >= steps and self.eval_program is not None:
                eval_results = self.evaluate()  # resumed a finished run: report its eval again
            failed = False
        finally:
            preemption.close()
            bar.close()
            writer.close()
            if hasattr(batches, "close"):
                batches.close()  # stops prefetch threads / worker processes
            if checkpointer is not None:
                _finish(checkpointer.wait, failed, self.log)  # a save in flight must land before exit
                checkpointer.close()
            _finish(run_dir.sync, failed, self.log)
        summary = {
            "steps": steps,
            "start_step": start_step,
            "train_seconds": time.perf_counter() - start_time,
            "compile": compile_report,
            "eval": eval_results,
            "realised_mixture": self.schedule.realised_mixture(0, steps),
            "outputs": {
                "workdir": cfg.workdir,
                "metrics": _join(cfg.workdir, "metrics.jsonl"),
                "eval": _join(cfg.workdir, "eval.jsonl"),
                "tensorboard": _join(cfg.workdir, "tensorboard"),
                "config": _join(cfg.workdir, "config.json"),
                "checkpoints": str(checkpointer.directory) if checkpointer is not None else "",
            },
        }
        if jax.process_index() == 0:
            with open(run_dir.path("summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
            run_dir.sync()
        return summary


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if paths.is_url(base) else os.path.join(base, name)


def _all_finite(tree: Any) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.array(True)


def _finish(cleanup: Any, failed: bool, log: Any) -> None:
    """Run a clean-up step; while another error is on its way out, report its failure instead of
    letting it replace that error."""
    try:
        cleanup()
    except Exception as err:
        if not failed:
            raise
        log(f"warning: {' '.join(str(err).split())}")


class PreemptionWatcher:
    """Turns SIGTERM or SIGINT (single process) or JAX's preemption sync point (multi-host: every
    process stops at the same step) into a request to save and stop after the current step.

    A second SIGINT interrupts at once (KeyboardInterrupt), for when the save is not wanted.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}
        # With several processes JAX's preemption notifier owns SIGTERM (and makes every process
        # stop at the same step); a Python handler here would swallow it.
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            print("\nstopping after this step and saving a checkpoint (Ctrl-C again to stop at once)", file=sys.stderr)

    def should_stop(self, step: int, checkpointer: Any) -> bool:
        if checkpointer is None:
            return False
        if jax.process_count() > 1:
            return checkpointer.manager.reached_preemption(step)
        return self.requested

    def close(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def interval_metrics(pending: list[tuple[int, dict[str, Any]]]) -> dict[str, float]:
    """One metrics line for a logging interval of (K, metrics) per step.

    Values are means over the interval's steps; a per-pass loss `loss_pass_k` averages the steps
    that ran at least k passes. `num_passes` and `learning_rate` are those of the last step, and
    `mean_num_passes` is the interval's mean K.
    """
    out: dict[str, float] = {}
    for key in sorted({key for _, metrics in pending for key in metrics}):
        values = [float(metrics[key]) for _, metrics in pending if key in metrics]
        out[key] = values[-1] if key == "learning_rate" else float(np.mean(values))
    out["num_passes"] = pending[-1][0]
    out["mean_num_passes"] = float(np.mean([k for k, _ in pending]))
    return out


def _with_shardings(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _compile(jitted: Any, *abstract_args: Any) -> tuple[Any, dict[str, float]]:
    start = time.perf_counter()
    compiled = jitted.lower(*abstract_args).compile()
    report = {"compile_seconds": time.perf_counter() - start}
    memory = compiled.memory_analysis()
    if memory is not None:
        report["device_bytes"] = float(
            memory.argument_size_in_bytes
            + memory.output_size_in_bytes
            - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes
        )
        report["temp_bytes"] = float(memory.temp_size_in_bytes)
    return compiled, report


def _describe(report: dict[str, float]) -> str:
    text = f"compiled in {report['compile_seconds']:.1f}s"
    if "device_bytes" in report:
        text += f", per-device memory {report['device_bytes'] / 2**20:,.1f} MiB (temporaries {report['temp_bytes'] / 2**20:,.1f} MiB)"
    return text


def _write_process_info(trainer: Trainer, workdir: str) -> None:
    """Each process records where it runs and which rows of every batch it loads."""
    directory = os.path.join(workdir, "processes")
    os.makedirs(directory, exist_ok=True)
    info = {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "hostname": socket.gethostname(),
        "local_devices": [str(d) for d in jax.local_devices()],
        "train_rows": trainer.process_rows(trainer.config.train.batch_size),
    }
    with open(os.path.join(directory, f"process_{jax.process_index()}.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=2)


def _progress_bar(total: int, enabled: bool, initial: int = 0) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, file=sys.stderr)


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
    with reported("fbt-train"):
        paths.resolve_config_paths(config)  # relative paths mean: from where the command was started
        validate_config(config)  # everything that does not depend on the devices, before any set-up
        if config.dry_run:
            from fbt_jax.dry_run import dry_run

            print(dry_run(config))
            return
        paths.check_config_urls(config)
        divert_library_noise(os.path.join(workdir.local_dir(config.workdir), "fbt-train.log"))
        distributed.initialize(config.distributed)
        summary = Trainer(config).train()
    if jax.process_index() == 0:
        print(format_summary(summary))


def _fail(message: str, code: int) -> None:
    print(f"fbt-train: {message}", file=sys.stderr)
    sys.exit(code)


def cli() -> None:
    from absl import app, flags
    from ml_collections import config_flags

    config_flags.DEFINE_config_file("config", None, "Path to a config file in configs/, e.g. configs/tiny.py.")
    flags.mark_flags_as_required(["config"])

    def parse_flags(argv: list[str]) -> list[str]:
        # Flag and config-file problems (a misspelt field, a missing file, a value of the wrong
        # type) surface here as assorted exceptions with multi-line messages: report one line.
        try:
            rest = flags.FLAGS(argv)
            flags.FLAGS.config.keys()  # the config file loads lazily: surface its errors here
            return rest
        except (flags.Error, AttributeError, KeyError, OSError, TypeError, ValueError) as err:
            text = str(err).encode().decode("unicode_escape", errors="replace")
            if isinstance(err, (AttributeError, KeyError)):
                _fail(f"unknown config field {' '.join(text.replace(chr(39), '').split())}", 2)
            _fail(f"bad flags: {' '.join(text.split())}", 2)

    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    cli()
