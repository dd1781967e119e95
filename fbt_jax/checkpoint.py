"""Checkpoints of a run: asynchronous orbax saves, exact resume, corrupted-checkpoint fallback.

A checkpoint holds the whole train state (parameters, optimizer state, step) and a JSON record of
the config and the model's shape. Nothing else is needed to resume exactly: the data position is
the step (data is step-indexed, docs/data.md) and every random draw is keyed by (seed, step).
Checkpoints are restored onto whatever mesh the current run has (orbax reshards on load).

Paths may be local or `gs://…` (orbax's path library, etils.epath, handles both). Reading another
run's checkpoints (decoding, evaluation, init_from) is `trained.py`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from fbt_jax import paths
from fbt_jax.errors import CheckpointError, ConfigError, describe
from fbt_jax.model import ModelConfig

# Fields of `model` that change how the model is computed, not its parameters: they may differ
# between a checkpoint and the run that restores it.
RUNTIME_ONLY_MODEL_FIELDS = ("remat", "loss_chunk_size", "attention_impl")


def model_signature(config: ml_collections.ConfigDict) -> dict[str, Any]:
    return {k: v for k, v in config.model.to_dict().items() if k not in RUNTIME_ONLY_MODEL_FIELDS}


def state_layout(state: Any) -> str:
    """A digest of the train state's tree structure, shapes and dtypes (model + optimizer)."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    text = ";".join(f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{x.dtype}" for p, x in leaves)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class Checkpointer:
    """Saves and restores a run's train state under one directory (local or gs://)."""

    def __init__(self, directory: str, cfg: ml_collections.ConfigDict, log: Any = print):
        self.directory = epath.Path(directory)
        self.log = log
        self.every_steps = int(cfg.every_steps)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=int(cfg.max_to_keep) or None,
            keep_period=int(cfg.keep_every) or None,
            enable_async_checkpointing=bool(cfg.async_save),
            enable_background_delete=True,  # retention deletes off the training thread
            create=True,
        )
        paths.check_output_dir(str(directory), "--config.checkpoint.dir")  # a file, or not writable: one line
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options)
        except (OSError, ValueError) as err:  # e.g. the path is a file, or not writable
            raise ConfigError(
                f"checkpoint directory {directory} cannot be used ({describe(err)}); "
                "choose a writable directory with --config.checkpoint.dir or --config.workdir"
            ) from None
        self.last_saved: int | None = None  # a step is saved once, even if asked again (preemption)

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0 and step != self.last_saved

    def save(self, step: int, state: Any, config: ml_collections.ConfigDict, force: bool = False) -> bool:
        """Start saving `state` at `step` (asynchronously); returns whether a save started.

        The caller guarantees that `state` is finite (a diverged state is never saved). A failed
        save (disk full, no permission, quota) raises CheckpointError; the checkpoints already
        written stay valid, because orbax makes a step visible only once it is complete.
        """
        if step == self.last_saved or (not force and not self.due(step)):
            return False
        meta = {
            "step": step,
            "model": model_signature(config),
            "state_layout": state_layout(state),
            "config": json.loads(config.to_json_best_effort()),
        }
        self.check_for_errors()  # a previous asynchronous save that failed
        try:
            saved = self.manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=force,
            )
        except Exception as err:  # any storage failure: reported as one line, the run stops
            # orbax finishes the previous asynchronous save first: its failure surfaces here.
            in_flight = self.last_saved is not None and self.last_saved not in self.steps()
            raise self._save_failed(self.last_saved if in_flight else step, err) from None
        if saved:
            self.last_saved = step
        return saved

    def wait(self) -> None:
        """Block until the save in flight has landed; CheckpointError if it failed."""
        try:
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        except Exception as err:
            raise self._save_failed(self.last_saved, err) from None

    def check_for_errors(self) -> None:
        """CheckpointError if an asynchronous save has failed since the last check (cheap)."""
        try:
            self.manager.check_for_errors()
        except Exception as err:
            raise self._save_failed(self.last_saved, err) from None

    def _save_failed(self, step: int | None, err: Exception) -> CheckpointError:
        valid = [s for s in self.steps() if s != step]
        kept = (
            f"the newest complete checkpoint, step {valid[-1]}, is intact" if valid else "no earlier checkpoint exists"
        )
        return CheckpointError(
            f"saving checkpoint {step} to {self.directory} failed ({describe(err)}); {kept}. "
            "Free space or fix permissions, then run the same command again to resume (details in fbt-train.log)"
        )

    def close(self) -> None:
        try:
            self.manager.close()
        except Exception as err:
            self.log(f"warning: closing the checkpoint manager failed ({describe(err)})")

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state: Any, config: ml_collections.ConfigDict) -> Restored | None:
        """The newest checkpoint that restores, or None if the directory holds none.

        A checkpoint is set aside as damaged only on evidence: an older checkpoint restored by the
        same code, on the same mesh, from the same storage. Then every newer one that failed is
        renamed `<step>.damaged-<time>` (never deleted), so retention cannot count it as valid.
        If none restores, the fault is in the code, the config or the environment (memory, a
        path, a permission), not in the checkpoints: CheckpointError, and nothing is touched.
        A checkpoint of another model or optimizer is a ConfigError, and nothing is touched.
        """
        failures: list[tuple[int, Exception]] = []
        for step in reversed(self.steps()):
            try:
                restored = self._restore_step(step, abstract_state, config)
            except ConfigError:
                raise
            except Exception as err:  # judged below, by whether an older one restores
                failures.append((step, err))
                continue
            for failed_step, err in failures:
                self._set_aside(failed_step, err, restored.step)
            return restored
        if failures:
            newest, err = failures[0]
            raise CheckpointError(
                f"none of the {len(failures)} checkpoint(s) in {self.directory} restores (newest, step {newest}: "
                f"{describe(err)}); nothing was changed. Fix the cause and run again, or start from scratch with "
                "--config.checkpoint.restart_from_scratch=True (the checkpoints are kept aside)"
            )
        return None

    def _restore_step(self, step: int, abstract_state: Any, config: ml_collections.ConfigDict) -> Restored:
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        check_compatible(meta, config, f"{self.directory}/{step}", state_layout(abstract_state))
        state = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
        )["state"]
        return Restored(state=state, step=step, meta=meta)

    def move_all_aside(self) -> str:
        """Rename the whole checkpoint directory (for an explicit restart from scratch)."""
        aside = epath.Path(f"{self.directory}.unrestored-{time.strftime('%Y%m%d-%H%M%S')}")
        self.close()
        if jax.process_index() == 0:
            self.directory.rename(aside)
        _sync("fbt-checkpoint-move-all-aside")
        return str(aside)

    def _set_aside(self, step: int, err: Exception, restored_step: int) -> None:
        aside = self.directory / f"{step}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(aside)
        _sync(f"fbt-checkpoint-set-aside-{step}")  # every process sees the same steps
        self.log(
            f"warning: checkpoint {self.directory}/{step} is damaged ({describe(err)}; step {restored_step} "
            f"restores with the same code); moved it to {aside}"
        )
        self.manager.reload()


@dataclasses.dataclass(frozen=True)
class Restored:
    state: Any
    step: int
    meta: dict[str, Any]


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def model_differences(
    saved_model: dict[str, Any], config: ml_collections.ConfigDict
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """(the checkpoint's model fields, the config's, the fields where they differ, sorted); runtime-only
    fields left out. Fields added to the model since the checkpoint was written take their defaults,
    which is what that checkpoint's model computed."""
    saved = {**dataclasses.asdict(ModelConfig()), **saved_model}
    saved = {k: v for k, v in saved.items() if k not in RUNTIME_ONLY_MODEL_FIELDS}
    current = model_signature(config)
    return saved, current, [k for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]


def check_compatible(
    meta: dict[str, Any],
    config: ml_collections.ConfigDict,
    where: str,
    layout: str | None = None,
    fix: str = "use a new workdir, or the original model settings to resume",
) -> None:
    """ConfigError unless the checkpoint's model (and, given `layout`, its whole train state
    including the optimizer's) matches the current config: such a checkpoint is not damaged."""
    saved, current, differ = model_differences(meta.get("model", {}), config)
    differences = [f"model.{k}: checkpoint {saved.get(k)!r}, config {current.get(k)!r}" for k in differ]
    if differences:
        raise ConfigError(f"the checkpoint {where} was written by a different model ({'; '.join(differences)}); {fix}")
    if layout is not None and meta.get("state_layout") not in (None, layout):
        saved_opt = meta.get("config", {}).get("optimizer", {})
        changed = [
            f"optimizer.{k}: checkpoint {saved_opt.get(k)!r}, config {v!r}"
            for k, v in config.optimizer.to_dict().items()
            if saved_opt.get(k) != v
        ]
        raise ConfigError(
            f"the checkpoint {where} holds a train state of another layout ({'; '.join(changed) or 'optimizer structure differs'}); "
            "resume with the original optimizer settings, or start a new run with --config.init_from to keep only the parameters"
        )
