"""Checkpoints: asynchronous orbax saves, exact resume, corrupted-checkpoint fallback, init_from.

A checkpoint holds the whole train state (parameters, optimizer state, step) and a JSON record of
the config and the model's shape. Nothing else is needed to resume exactly: the data position is
the step (data is step-indexed, docs/data.md) and every random draw is keyed by (seed, step).
Checkpoints are restored onto whatever mesh the current run has (orbax reshards on load).

Paths may be local or `gs://…` (orbax's path library, etils.epath, handles both).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from fbt_jax.errors import ConfigError

# Fields of `model` that change the parameters' structure or meaning; the rest (remat) may differ.
RUNTIME_ONLY_MODEL_FIELDS = ("remat",)
# Exceptions orbax and its storage raise for a damaged or partial checkpoint (seen: ValueError with
# NOT_FOUND/OUT_OF_RANGE/DATA_LOSS, FileNotFoundError, KeyError, a misleading pytree error).
DAMAGE = (ValueError, FileNotFoundError, KeyError, OSError, TypeError)


def model_signature(config: ml_collections.ConfigDict) -> dict[str, Any]:
    return {k: v for k, v in config.model.to_dict().items() if k not in RUNTIME_ONLY_MODEL_FIELDS}


def state_layout(state: Any) -> str:
    """A digest of the train state's tree structure, shapes and dtypes (model + optimizer)."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    text = ";".join(f"{jax.tree_util.keystr(p)}:{tuple(x.shape)}:{x.dtype}" for p, x in leaves)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


class Checkpointer:
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
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self.last_saved: int | None = None  # a step is saved once, even if asked again (preemption)

    def save(self, step: int, state: Any, config: ml_collections.ConfigDict, force: bool = False) -> bool:
        """Start saving `state` at `step` (asynchronously); returns whether a save started."""
        if step == self.last_saved or (not force and (not self.every_steps or step % self.every_steps)):
            return False
        meta = {
            "step": step,
            "model": model_signature(config),
            "state_layout": state_layout(state),
            "config": json.loads(config.to_json_best_effort()),
        }
        saved = self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=force
        )
        if saved:
            self.last_saved = step
        return saved

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def restore_latest(self, abstract_state: Any, config: ml_collections.ConfigDict) -> tuple[Any, int] | None:
        """The newest checkpoint that restores cleanly, or None if there is none.

        A damaged checkpoint is reported and moved aside (renamed `<step>.damaged-<time>`, never
        deleted) so that retention cannot count it as a valid one; the previous one is tried next.
        A checkpoint from an incompatible model is an error, and nothing is touched.
        """
        for step in reversed(self.steps()):
            try:
                meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            except DAMAGE as err:
                self._set_aside(step, err)
                continue
            check_compatible(meta, config, f"{self.directory}/{step}", state_layout(abstract_state))
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                    ),
                )
            except DAMAGE as err:
                self._set_aside(step, err)
                continue
            return restored["state"], step
        return None

    def _set_aside(self, step: int, err: Exception) -> None:
        reason = " ".join(f"{type(err).__name__}: {err}".split())[:200]
        aside = self.directory / f"{step}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(aside)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"fbt-checkpoint-set-aside-{step}")  # all see the same steps
        self.log(
            f"warning: checkpoint {self.directory}/{step} is damaged ({reason}); moved it to {aside}, trying the previous one"
        )
        self.manager.reload()


def check_compatible(
    meta: dict[str, Any], config: ml_collections.ConfigDict, where: str, layout: str | None = None
) -> None:
    """ConfigError unless the checkpoint's model (and, given `layout`, its whole train state
    including the optimizer's) matches the current config: such a checkpoint is not damaged."""
    saved, current = meta.get("model", {}), model_signature(config)
    differences = [
        f"model.{k}: checkpoint {saved.get(k)!r}, config {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
    ]
    if differences:
        raise ConfigError(
            f"the checkpoint {where} was written by a different model ({'; '.join(differences)}); use a new workdir, "
            "or the original model settings to resume"
        )
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


def load_model(path: str, log: Any = print) -> tuple[Any, ml_collections.ConfigDict]:
    """The model of a run (its workdir or checkpoint directory) with its newest valid parameters,
    built from the config recorded in the checkpoint; for decoding and evaluation."""
    from flax import nnx

    from fbt_jax.model import ModelConfig, abstract_model

    directory = _run_checkpoints(path, "--checkpoint")
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False, read_only=True))
    try:
        steps = sorted(manager.all_steps(), reverse=True)
        for step in steps:
            try:
                meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                break
            except DAMAGE:
                continue
        else:
            raise ConfigError(f"--checkpoint={path!r} holds no checkpoint; train with checkpoint.every_steps > 0 first")
    finally:
        manager.close()
    config = _config_from_record(meta["config"])
    model = abstract_model(ModelConfig.from_config(config.model))
    graphdef, abstract = nnx.split(model, nnx.Param)
    one_device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), abstract)
    params = load_params(str(directory), abstract, config, log)
    return nnx.merge(graphdef, params), config


def _run_checkpoints(path: str, flag: str) -> epath.Path:
    """The checkpoint directory of a run given by its workdir or by the directory itself."""
    root = epath.Path(path)
    directory = root / "checkpoints" if (root / "checkpoints").exists() else root
    if not directory.exists():
        raise ConfigError(f"{flag}={path!r} does not exist; give a run's workdir or its checkpoints directory")
    return directory


def _config_from_record(record: dict[str, Any]) -> ml_collections.ConfigDict:
    """A full config from the JSON a checkpoint recorded (defaults for fields added since)."""
    from fbt_jax.config import default_config

    config = default_config()

    def apply(section: ml_collections.ConfigDict, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if key not in section:
                continue
            if isinstance(section[key], ml_collections.ConfigDict):
                apply(section[key], value)
            else:
                section[key] = tuple(value) if isinstance(section[key], tuple) else value

    apply(config, record)
    return config


def load_params(path: str, abstract_params: Any, config: ml_collections.ConfigDict, log: Any = print) -> Any:
    """Parameters only (no optimizer state, no step) of the newest valid checkpoint under `path`
    (a run's workdir or its checkpoint directory), for `init_from`."""
    directory = _run_checkpoints(path, "init_from")
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False, read_only=True))
    try:
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
                check_compatible(meta, config, f"{directory}/{step}")
                state = manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.PyTreeRestore(item={"params": abstract_params}, partial_restore=True)
                    ),
                )["state"]
            except ConfigError:
                raise  # an incompatible model is the user's to fix, not a damaged checkpoint
            except DAMAGE as err:
                log(f"warning: skipping damaged checkpoint {directory}/{step} ({type(err).__name__})")
                continue
            log(f"initialised parameters from {directory}/{step}")
            return state["params"]
    finally:
        manager.close()
    raise ConfigError(f"init_from={path!r} holds no valid checkpoint; point it at a run that saved one")
