"""`Trainer`: one training run. It validates the config, opens the data, builds the compiled
programs (`programs.py`), restores or creates the train state, and runs the loop (`loop.py`) with
its hooks (`hooks.py`). Thin on purpose: the math is in the pure step functions (`step.py`).
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from fbt_jax import checkpoint, contraction, distributed, paths, run_services, sharding, trained, workdir
from fbt_jax.data.mixture import Mixture
from fbt_jax.data.pipeline import StepBatches, batch_iterator, make_source
from fbt_jax.data.plan import DataPlan, plan_data
from fbt_jax.errors import CheckpointError, ConfigError
from fbt_jax.flops import train_step_flops
from fbt_jax.hardware import peak_flops_per_device
from fbt_jax.metrics import MetricsWriter
from fbt_jax.model import count_params
from fbt_jax.schedule import PassSchedule
from fbt_jax.train import goodput, harness_hook, hooks
from fbt_jax.train.loop import run_steps
from fbt_jax.train.programs import TrainPrograms
from fbt_jax.train.step import TrainState, all_finite
from fbt_jax.validation import validate_config, validation_readers


class Trainer:
    """Holds a run's data sources, its compiled programs and its train state, and runs it."""

    def __init__(self, config: ml_collections.ConfigDict, log: Any = print, devices: list | None = None):
        self.config = config
        self.log = log if jax.process_index() == 0 else (lambda *_: None)
        devices = list(jax.devices() if devices is None else devices)
        self.data: DataPlan = plan_data(config)  # config.data resolved once; everything below takes the plan
        self.schedule: PassSchedule = validate_config(config, num_devices=len(devices), data=self.data)
        # The harness's tasks, their data and what it would refuse, before any data, compile or write.
        self.harness = harness_hook.check(config, self.data)
        self.sources = {"train": make_source(self.data, "train")}
        e = config.eval
        if e.num_batches > 0 or (e.contraction_passes and e.contraction_every_steps):  # eval or the monitor
            self.sources["validation"] = make_source(self.data, "validation", validation_readers(e))
        data_vocab = self.sources["train"].vocab_size
        if data_vocab > config.model.vocab_size:  # prepared data is known only now
            raise ConfigError(
                f"model.vocab_size={config.model.vocab_size} is smaller than the data's vocabulary "
                f"({data_vocab}); set --config.model.vocab_size={data_vocab} or larger"
            )
        cache_dir = run_services.compilation_cache_dir(config)
        run_services.use_compilation_cache(
            cache_dir, run_services.compilation_cache_flag(config)
        )  # before anything compiles
        train = self.sources["train"]
        self.programs = TrainPrograms(
            config, self.schedule, devices, train.packed, self.log, getattr(train, "chat", False)
        )
        self.state: TrainState | None = None
        self._monitor_batch: dict[str, jax.Array] | None = None  # the contraction monitor's fixed batch
        self.resumed = False  # whether the state came from this run's own checkpoint

    # Data: every process loads only the rows of each global batch that its devices hold.

    def step_batches(self, split: str, batch_size: int, source: Any = None) -> StepBatches:
        """step → this process's rows of that step's global batch of `split` (validation unshuffled),
        from `source` where given (one dataset of a mixture)."""
        shuffle = self.data.shuffle and split == "train"
        source = self.sources[split] if source is None else source
        return StepBatches(source, batch_size, tuple(self.process_rows(batch_size)), self.data.seed, shuffle)

    def to_global(self, local_rows: dict[str, np.ndarray], batch_size: int) -> dict[str, jax.Array]:
        return sharding.global_batch(local_rows, self.programs.batch_sharding, batch_size)

    def batch(self, split: str, step: int, batch_size: int) -> dict[str, jax.Array]:
        """The global batch for `step`."""
        return self.to_global(self.step_batches(split, batch_size)(step), batch_size)

    def process_rows(self, batch_size: int) -> list[int]:
        """Which rows of each global batch this process loads (for logs and tests)."""
        return sharding.process_rows(self.programs.batch_sharding, batch_size).tolist()

    # State.

    def init_state(self) -> None:
        self.state = self.programs.init_state()

    def restore_or_init(
        self, checkpointer: checkpoint.Checkpointer | None
    ) -> tuple[int, checkpoint.Checkpointer | None]:
        """Resume from the newest checkpoint that restores, else continue a trunk (fork_from), else
        initialise (optionally from init_from). Returns the step training starts at and the
        checkpointer to save with."""
        cfg = self.config
        if checkpointer is not None and cfg.checkpoint.restart_from_scratch and checkpointer.steps():
            aside = checkpointer.move_all_aside()
            self.log(f"restart_from_scratch: moved the earlier checkpoints to {aside}; starting at step 0")
            checkpointer = checkpoint.Checkpointer(str(checkpointer.directory), cfg.checkpoint, self.log)
        if checkpointer is not None:
            restored = checkpointer.restore_latest(self.programs.sharded_abstract_state(), cfg)
            if restored is not None:
                self._check_resume(restored, checkpointer)
                self.state, self.resumed = restored.state, True
                self.log(f"resuming from checkpoint {checkpointer.directory}/{restored.step} (step {restored.step})")
                return restored.step, checkpointer
        if cfg.fork_from:
            self.state, step = trained.load_state(cfg.fork_from, self.programs.sharded_abstract_state(), cfg, self.log)
            return step, checkpointer
        self.init_state()
        if cfg.init_from:
            params = trained.load_params(cfg.init_from, self.programs.sharded_abstract_state().params, cfg, self.log)
            self.state = self.state.replace(params=params)
        return 0, checkpointer

    def _check_resume(self, restored: checkpoint.Restored, checkpointer: checkpoint.Checkpointer) -> None:
        """Refuse a non-finite checkpoint, and config changes that alter the data or the objective."""
        where = f"{checkpointer.directory}/{restored.step}"
        if not bool(jax.jit(all_finite)(restored.state)):
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

    # Programs.

    def compile(self, pass_counts: tuple[int, ...] | None = None) -> dict[str, dict[str, float]]:
        return self.programs.compile(pass_counts)

    def evaluate(self, state: TrainState | None = None) -> dict[str, float]:
        """Held-out loss and token accuracy for each K in eval.num_passes; for a mixture, also per
        dataset (`loss_K1/web`), each dataset's validation split evaluated on its own."""
        e = self.config.eval
        params = (state or self.state).params
        validation = self.sources["validation"]
        parts = dict(zip(validation.names, validation.sources)) if isinstance(validation, Mixture) else {"": None}
        totals: dict[str, float] = {}
        results = {}
        for name, source in parts.items():
            batches = self.step_batches("validation", e.batch_size, source)
            part: dict[str, float] = {}
            for i in range(e.num_batches):
                out = jax.device_get(self.programs.eval(params, self.to_global(batches(i), e.batch_size)))
                for key, value in out.items():
                    part[key] = part.get(key, 0.0) + float(value)
                    totals[key] = totals.get(key, 0.0) + float(value)
            if name:
                results |= {f"{key}/{name}": value for key, value in _losses(part, e.num_passes).items()}
        results = _losses(totals, e.num_passes) | results
        if self.programs.monitored:
            results |= contraction.summarize(totals, *self.programs.monitored)
        return results

    def monitor_contraction(self, state: TrainState | None = None) -> dict[str, float]:
        """The contraction monitor on one fixed held-out batch (validation batch 0)."""
        e = self.config.eval
        if self._monitor_batch is None:
            self._monitor_batch = self.to_global(self.step_batches("validation", e.batch_size)(0), e.batch_size)
        totals = jax.device_get(self.programs.contraction((state or self.state).params, self._monitor_batch))
        return contraction.summarize({k: float(v) for k, v in totals.items()}, *self.programs.monitored)

    def peak_flops(self) -> tuple[float, str]:
        """Peak FLOP/s of one device for MFU, and where the figure comes from."""
        if self.config.train.peak_flops_per_device > 0:
            return float(self.config.train.peak_flops_per_device), "train.peak_flops_per_device"
        return peak_flops_per_device(self.programs.mesh.devices.flat[0])

    # The run.

    def train(self, progress: bool = True) -> dict[str, Any]:
        run_dir = workdir.RunDirectory(self.config.workdir)
        run_dir.lock()
        try:
            return self._train(run_dir, progress)
        finally:
            run_dir.unlock()

    def _train(self, run_dir: workdir.RunDirectory, progress: bool) -> dict[str, Any]:
        cfg = self.config
        # The run ends at train.stop_at_step when set (a sweep's trunk); its schedules (learning
        # rate, passes) still span train.steps, so a later run continues it exactly.
        steps, batch_size = cfg.train.stop_at_step or cfg.train.steps, cfg.train.batch_size
        checkpointer = None
        if cfg.checkpoint.every_steps > 0:
            directory = cfg.checkpoint.dir or join(cfg.workdir, "checkpoints")
            checkpointer = checkpoint.Checkpointer(directory, cfg.checkpoint, self.log)
        restore_start = time.perf_counter()
        start_step, checkpointer = self.restore_or_init(checkpointer)
        restore_seconds = time.perf_counter() - restore_start
        distributed.check_schedule_agreement(self.schedule, start_step, steps)
        if not self.resumed:  # a new run in this workdir (from scratch, init_from or a fork)
            run_dir.set_aside_previous_outputs(self.log)
        ledger = goodput.Ledger(run_dir.local, start_step)  # where this attempt's time goes
        ledger.add("restore", restore_seconds)
        run_dir.write_config(cfg, start_step)
        workdir.write_process_info(run_dir.local, self.process_rows(cfg.train.batch_size))
        mesh = self.programs.mesh
        self.log(
            f"model: {count_params(self.programs.abstract_state.params):,} parameters; mesh "
            + " × ".join(f"{a}={n}" for a, n in mesh.shape.items())
            + f" over {mesh.size} devices in {jax.process_count()} process(es)"
        )
        self.log(self.schedule.describe(steps))
        # Only the Ks this run still draws: a sweep's K = 1 trunk compiles one train program.
        compile_report = self.compile(tuple(sorted({self.schedule.num_passes(s) for s in range(start_step, steps)})))
        ledger.add("compile", sum(report["compile_seconds"] for report in compile_report.values()))
        writer = MetricsWriter.for_run(cfg, run_dir.local, start_step, self.log)
        saver = None
        if checkpointer is not None:  # also at the harness's steps: an evaluation that fails then costs nothing
            also_at = functools.partial(harness_hook.measures, self.harness) if self.harness else None
            saver = hooks.CheckpointSaver(checkpointer, cfg, run_dir, self.log, also_at)
        harness = None
        if self.harness is not None:  # acts after the saver, once the step's checkpoint has landed
            harness = harness_hook.HarnessEvaluator(cfg, self.harness, self.programs.graphdef, writer, saver,
                                                    lambda: bool(saver and preemption.requested), self.log)  # fmt: skip
        feedback_from = self.schedule.first_feedback_step(steps)  # until then the monitor warns of nothing
        monitor = None
        if self.programs.contraction is not None:
            monitor = hooks.ContractionMonitor(
                self.monitor_contraction, cfg.eval.contraction_every_steps, self.log, feedback_from
            )
        # The logger also writes at every step that saves (after its finiteness check) or is measured.
        also_at = [saver.saves] if saver else []
        also_at += [monitor.measures] if monitor else []
        logger = hooks.MetricsLogger(
            writer,
            cfg.train.log_every,
            steps,
            start_step,
            progress,
            saved_steps=saver.checkpointer.steps if saver else list,
            also_at=lambda end: any(due(end) for due in also_at),
        )
        peak_per_device, peak_source = self.peak_flops()
        self.log(f"MFU against {peak_source} × {self.programs.mesh.size} device(s)")
        model_cfg, seq_len = self.programs.model_cfg, self.data.seq_len
        throughput = hooks.Throughput(
            lambda k: train_step_flops(model_cfg, batch_size, seq_len, k),
            batch_size * seq_len,
            peak_per_device * self.programs.mesh.size,
            when=logger.wants,
        )
        # Hooks that add to a step's record (throughput, the monitor) come before the logger writes it.
        timed_monitor = goodput.Timed(monitor, ledger, "eval") if monitor else None
        timed_saver = goodput.Timed(saver, ledger, "checkpoint") if saver else None
        # The ledger is written before a save syncs the logs to a bucket, so the bucket's copy knows
        # how far this attempt ran (the steps a resume on another host recomputes).
        ledger_writer = goodput.LedgerWriter(ledger, logger.wants, saver.saves if saver else lambda end: False)
        run_hooks: list[hooks.Hook] = [
            h for h in (throughput, timed_monitor, logger, ledger_writer, timed_saver) if h is not None
        ]
        evaluator = None
        if self.programs.eval is not None:
            evaluator = hooks.Evaluator(self.evaluate, writer, cfg.eval.every_steps, self.log, feedback_from)
            run_hooks.append(goodput.Timed(evaluator, ledger, "eval"))
        if harness:
            run_hooks.append(goodput.Timed(harness, ledger, "eval"))
        profiler = hooks.Profiler.for_run(cfg.train, run_dir.path("profile"), start_step, self.log, saver)
        run_hooks += [profiler] if profiler else []  # after the saver: its save lands before the trace stops
        d = self.data
        local_batches = batch_iterator(self.step_batches("train", batch_size), start_step, d.num_workers, d.prefetch)
        global_batches = ledger.batches(self.to_global(rows, batch_size) for rows in local_batches)
        preemption = hooks.PreemptionWatcher(checkpointer)
        ledger.start_loop()
        start_time = time.perf_counter()
        failed = True
        try:
            if harness and self.resumed:  # an evaluation that failed or was stopped, done before any step
                with ledger.timing("eval"):
                    harness.catch_up(self.state, start_step, steps, writer.paths["eval"])
            self.state = run_steps(
                self.state,
                self.programs.train,
                self.schedule,
                global_batches,
                start_step,
                steps,
                batch_size * d.seq_len,
                run_hooks,
                preemption.should_stop,
            )
            if start_step >= steps and not self.resumed and saver:
                # A fork of a trunk that already ends here (its schedule drew the same K to the
                # last step): the run still gets its own checkpoint, for decoding and evaluation.
                saver.checkpointer.save(start_step, self.state, cfg, force=True)
            if start_step >= steps and evaluator:
                evaluator.results = self.evaluate()  # resumed a finished run: report its eval again
            failed = False
        finally:
            preemption.close()
            for hook in run_hooks:
                hooks.finish(lambda hook=hook: hook.close(failed), failed, self.log)
            ledger.close_loop()
            ledger.write(force=True)
            time_summary = ledger.summary()
            writer.write_summary(goodput.flat(time_summary))
            hooks.finish(lambda: writer.close(failed), failed, self.log)
            if hasattr(local_batches, "close"):
                local_batches.close()  # stops prefetch threads / worker processes
            hooks.finish(run_dir.sync, failed, self.log)
        summary = {
            "steps": steps,
            "start_step": start_step,
            "train_seconds": time.perf_counter() - start_time,
            "compile": compile_report,
            "goodput": time_summary,
            "eval": evaluator.results if evaluator else {},
            "realised_mixture": self.schedule.realised_mixture(0, steps),
            "outputs": {
                "workdir": cfg.workdir,
                "metrics": join(cfg.workdir, "metrics.jsonl"),
                "eval": join(cfg.workdir, "eval.jsonl"),
                "tensorboard": join(cfg.workdir, "tensorboard"),
                "config": join(cfg.workdir, "config.json"),
                "checkpoints": str(checkpointer.directory) if checkpointer is not None else "",
            },
        }
        if jax.process_index() == 0:
            with open(run_dir.path("summary.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=2)
            run_dir.sync()
        return summary


def _losses(totals: dict[str, float], num_passes: Any) -> dict[str, float]:
    results = {}
    for k in sorted(set(num_passes)):
        results[f"loss_K{k}"] = totals[f"nll_{k}"] / max(totals[f"weight_{k}"], 1e-8)
        results[f"accuracy_K{k}"] = totals[f"correct_{k}"] / max(totals[f"weight_{k}"], 1e-8)
    return results


def join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if paths.is_url(base) else os.path.join(base, name)
