"""Reading a trained run, read-only: its model (for fbt-decode, fbt-eval), its parameters only
(for `init_from`) or its whole train state (for `fork_from`), from the newest of its checkpoints
that restores.

A run is given by its workdir or its checkpoint directory, local or `gs://`. These are another
run's files: nothing here moves, renames or writes a checkpoint, whatever fails to restore.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import warnings
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from fbt_jax import init_from, workdir
from fbt_jax.attention.spec import here as attention_here
from fbt_jax.checkpoint import check_compatible, state_layout
from fbt_jax.config import config_from_dict
from fbt_jax.errors import CheckpointError, ConfigError, describe
from fbt_jax.model import ModelConfig, abstract_model
from fbt_jax.schedule import PassSchedule


def load_model(path: str, log: Any = print, flag: str = "--checkpoint") -> tuple[Any, ml_collections.ConfigDict]:
    """The model of a run (its workdir or checkpoint directory) with its newest parameters that
    restore, built from the config recorded in that checkpoint; for decoding and evaluation."""
    return load_model_at(path, log, flag)[:2]


def load_model_at(
    path: str, log: Any = print, flag: str = "--checkpoint"
) -> tuple[Any, ml_collections.ConfigDict, int]:
    """`load_model`, with the step of the checkpoint it read."""
    one_device = jax.sharding.make_single_device_sharding(jax.local_devices()[0])

    def restore(manager: ocp.CheckpointManager, step: int) -> tuple[Any, ml_collections.ConfigDict]:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        config = config_from_dict(meta["config"])
        cfg = ModelConfig.from_config(config.model)
        impl = attention_here(cfg.attention_impl, cfg.compute_dtype, cfg.sliding_window, cfg.head_size)
        model = abstract_model(dataclasses.replace(cfg, attention_impl=impl))
        graphdef, abstract = nnx.split(model, nnx.Param)
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), abstract)
        params = _restore_params(manager, step, abstract)
        return nnx.merge(graphdef, params), config, step

    return _newest_that_restores(path, flag, restore, log, "loaded")


def read_run_config(path: str, flag: str = "--checkpoint") -> tuple[ml_collections.ConfigDict, int]:
    """(config, step) recorded in a run's newest checkpoint whose record reads, without its arrays:
    what a command checks its inputs against before it reads the parameters."""

    def restore(manager: ocp.CheckpointManager, step: int) -> tuple[ml_collections.ConfigDict, int]:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        return config_from_dict(meta["config"]), step

    return _newest_that_restores(path, flag, restore, lambda line: None, "read")


def load_host_params(path: str, log: Any = print, flag: str = "--checkpoint") -> tuple[dict[tuple, np.ndarray], Any]:
    """The newest parameters of a run that restore, as host (numpy) arrays by parameter path, with
    the run's config: what an export reads, without a device copy of the model beside them."""

    def restore(manager: ocp.CheckpointManager, step: int) -> tuple[dict[tuple, np.ndarray], Any]:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        config = config_from_dict(meta["config"])
        abstract = nnx.split(abstract_model(ModelConfig.from_config(config.model)), nnx.Param)[1]
        on_host = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract)
        args = ocp.args.PyTreeRestore(item={"params": abstract}, restore_args={"params": on_host}, partial_restore=True)
        params = manager.restore(step, args=ocp.args.Composite(state=args))["state"]["params"]
        flat = {p: v.get_value() for p, v in nnx.to_flat_state(params)}
        del params
        gc.collect()  # the restored tree's cycles held every array: the caller frees them one by one
        return flat, config

    return _newest_that_restores(path, flag, restore, log, "loaded")


def load_params(path: str, abstract_params: Any, config: ml_collections.ConfigDict, log: Any = print) -> Any:
    """Parameters only (no optimizer state, no step) of the newest checkpoint under `path` (a run's
    workdir or its checkpoint directory) that restores, for `init_from`: the same network, with the
    changes `init_from.changes` allows (rotary settings, sliding window, new tokens' rows)."""

    def restore(manager: ocp.CheckpointManager, step: int) -> Any:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        changes = init_from.changes(meta.get("model", {}), config, f"{manager.directory}/{step}")
        for line in changes.changed:
            log(f"init_from: changed {line}")
        if not changes.new_tokens:
            return _restore_params(manager, step, abstract_params)

        # The token tables at the saved size, on the host (each process reads them whole), the rest
        # straight onto this run's shardings; the tables are extended, then placed.
        def saved_shape(path: tuple, leaf: Any) -> Any:
            if not init_from.is_vocab_table(path):
                return leaf
            return jax.ShapeDtypeStruct((changes.saved_vocab_size, *leaf.shape[1:]), leaf.dtype)

        abstract = jax.tree_util.tree_map_with_path(saved_shape, abstract_params)
        params = _restore_params(manager, step, abstract, on_host=init_from.is_vocab_table)

        def extended(path: tuple, value: Any, target: Any) -> Any:
            if not init_from.is_vocab_table(path):
                return value
            table = init_from.extend_rows(np.asarray(value), changes.vocab_size)
            return jax.make_array_from_callback(table.shape, target.sharding, lambda index: table[index])

        log(
            f"init_from: {changes.new_tokens} new token rows, each the mean of the {changes.saved_vocab_size} saved ones"
        )
        return jax.tree_util.tree_map_with_path(extended, params, abstract_params)

    return _newest_that_restores(path, "--config.init_from", restore, log, "initialised parameters from")


def load_state(path: str, abstract_state: Any, config: ml_collections.ConfigDict, log: Any = print) -> tuple[Any, int]:
    """The whole train state (parameters, optimizer state, step) of the newest checkpoint of a trunk
    run that restores, and its step, for `fork_from`: the fork continues exactly where the trunk
    stopped. The trunk's config must equal this run's but for fields that do not change training,
    and its pass schedule must draw the same K at every step before the fork (ConfigError)."""

    def restore(manager: ocp.CheckpointManager, step: int) -> tuple[Any, int]:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        where = f"{manager.directory}/{step}"
        fix = "a fork must be the trunk's config with another pass schedule; fork from a matching trunk"
        check_compatible(meta, config, where, state_layout(abstract_state), fix=fix)
        changed = workdir.fork_changes(meta["config"], config)
        if changed:
            raise ConfigError(f"--config.fork_from: the trunk {where} differs in {'; '.join(changed)}; {fix}")
        check_same_passes(meta["config"], config, step, where)
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        return manager.restore(step, args=args)["state"], step

    return _newest_that_restores(path, "--config.fork_from", restore, log, "forked from")


def check_same_passes(trunk: dict[str, Any], config: ml_collections.ConfigDict, fork_step: int, where: str) -> None:
    """ConfigError unless the trunk's schedule drew the K this run's draws at every step before
    `fork_step` (K is a function of (seed, step), so the two runs then trained identically)."""
    steps, seed = config.train.steps, config.seed
    ours = PassSchedule.parse(config.passes.schedule, steps, seed)
    theirs = PassSchedule.parse(trunk["passes"]["schedule"], steps, seed)
    for step in range(fork_step):
        if ours.num_passes(step) != theirs.num_passes(step):
            raise ConfigError(
                f"--config.fork_from: the trunk {where} ran K={theirs.num_passes(step)} at step {step}, where this "
                f"run's passes.schedule draws K={ours.num_passes(step)}; fork from a trunk that stopped before the "
                "schedules diverge"
            )


def _restore_params(
    manager: ocp.CheckpointManager, step: int, abstract_params: Any, on_host: Any = lambda path: False
) -> Any:
    """The parameters of checkpoint `step` onto `abstract_params`' shardings; those whose path
    `on_host` names as host (numpy) arrays instead."""
    item = {"params": abstract_params}
    # Restore arguments from the target's own shardings: the ones saved with the checkpoint name
    # devices of the job that wrote it (another process count cannot build them).
    restore_args = jax.tree_util.tree_map_with_path(
        lambda path, leaf: (
            ocp.RestoreArgs(restore_type=np.ndarray)
            if on_host(path)
            else ocp.checkpoint_utils.construct_restore_args(leaf)
        ),
        item,
    )
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    state = manager.restore(step, args=ocp.args.Composite(state=args))["state"]
    return state["params"]


def _newest_that_restores(path: str, flag: str, restore: Any, log: Any, done: str) -> Any:
    """`restore(manager, step)` for the newest step that restores, read-only (never moves a
    checkpoint: these are other runs' files). Newer ones that failed are reported."""
    directory = _run_checkpoints(path, flag)
    # Reading another run's checkpoints read-only makes orbax warn that it is read-only and that
    # the params-only restore reads shardings from the files: both expected here.
    logging.getLogger("absl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message="Sharding info not provided when restoring")
    try:
        manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False, read_only=True))
    except Exception as err:
        raise ConfigError(
            f"{flag}={path!r} cannot be read ({describe(err)}); check the path and its permissions"
        ) from None
    failures: list[tuple[int, Exception]] = []
    try:
        for step in sorted(manager.all_steps(), reverse=True):
            try:
                result = restore(manager, step)
            except ConfigError:
                raise  # another model: the user's to fix, whatever the other checkpoints hold
            except Exception as err:
                failures.append((step, err))
                continue
            for failed, err in failures:
                log(f"warning: skipped checkpoint {directory}/{failed}, which does not restore ({describe(err)})")
            log(f"{done} {directory}/{step}")
            return result
    finally:
        manager.close()
    if failures:
        step, err = failures[0]
        raise CheckpointError(
            f"{flag}={path!r}: none of its {len(failures)} checkpoint(s) restores (newest, step {step}: "
            f"{describe(err)}); nothing was changed. Check that it is a complete run of this fbt-jax version, "
            f"or point {flag} at another run"
        )
    raise ConfigError(f"{flag}={path!r} holds no checkpoint; train with --config.checkpoint.every_steps > 0 first")


def _run_checkpoints(path: str, flag: str) -> epath.Path:
    """The checkpoint directory of a run given by its workdir or by the directory itself."""
    root = epath.Path(path)
    try:
        directory = root / "checkpoints" if (root / "checkpoints").is_dir() else root
        exists = directory.is_dir()
    except Exception as err:
        raise ConfigError(
            f"{flag}={path!r} cannot be read ({describe(err)}); check the path and its permissions"
        ) from None
    if not exists:
        raise ConfigError(f"{flag}={path!r} is not a directory; give a run's workdir or its checkpoints directory")
    return directory
