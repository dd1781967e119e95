"""Config validation: `validate_config` runs before anything is built or compiled and raises
`ConfigError` with one line naming the field and the fix. The schema is `config.py`.
"""

from __future__ import annotations

import math
import os

import ml_collections

from fbt_jax import paths
from fbt_jax.data.plan import DataPlan, plan_data
from fbt_jax.errors import ConfigError
from fbt_jax.hardware import chip_hbm_gib
from fbt_jax.metrics import check_metrics_config
from fbt_jax.model import ModelConfig
from fbt_jax.run_services import parse_profile_steps
from fbt_jax.schedule import PassSchedule
from fbt_jax.sharding import BATCH_AXIS, MESH_AXES, mesh_shape, parse_rules


def _leaves(config: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in config.items():
        if isinstance(value, ml_collections.ConfigDict):
            out += _leaves(value, f"{prefix}{key}.")
        elif isinstance(value, (tuple, list)):
            out += [(f"{prefix}{key}[{i}]", v) for i, v in enumerate(value)]
        else:
            out.append((f"{prefix}{key}", value))
    return out


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _fixed_mesh_size(mesh: ml_collections.ConfigDict) -> int:
    """A device count the mesh fits, for checks before the devices are known (-1 taken as 1)."""
    size = 1
    for a in MESH_AXES:
        size *= max(int(mesh[a]), 1) * max(int(mesh[f"dcn_{a}"]), 1)
    return size


def validate_config(
    config: ml_collections.ConfigDict, num_devices: int | None = None, data: DataPlan | None = None
) -> PassSchedule:
    """Check every field before any expensive work; returns the parsed pass schedule.

    With `num_devices` None the device-dependent checks (mesh sizes, batch divisibility) are
    skipped: the command line runs them once the devices are known. `data` is the run's data plan
    where the caller resolved it already (`plan_data`).
    """
    _require(bool(config.workdir), "workdir is empty; set --config.workdir=<directory for outputs>")
    for field, value in _leaves(config):
        _require(
            not isinstance(value, float) or math.isfinite(value),
            f"{field}={value} is not a finite number; give a finite value",
        )
    _require(
        isinstance(config.seed, int) and 0 <= config.seed < 2**31,
        f"seed={config.seed!r} must be an integer in [0, 2**31)",
    )
    m, d, p, t, o, e = config.model, config.data, config.passes, config.train, config.optimizer, config.eval

    ModelConfig.from_config(m).check()

    data = data or plan_data(config)
    d.tokenizer = data.tokenizer_spec  # the run's record names the tokenizer its data was prepared with
    _require(
        m.vocab_size >= data.vocab_size,
        f"model.vocab_size={m.vocab_size} is smaller than the data's vocabulary ({data.vocab_size} tokens for "
        f"{data.vocab_origin}); set --config.model.vocab_size={data.vocab_size} or larger",
    )
    _require(d.num_workers >= 0 and d.prefetch >= 0, "data.num_workers and data.prefetch must be >= 0")

    _require(isinstance(t.steps, int) and t.steps >= 1, f"train.steps={t.steps!r} must be a positive integer")
    _require(
        isinstance(t.batch_size, int) and t.batch_size >= 1,
        f"train.batch_size={t.batch_size!r} must be a positive integer",
    )
    _require(
        isinstance(t.stop_at_step, int) and 0 <= t.stop_at_step <= t.steps,
        f"train.stop_at_step={t.stop_at_step!r} must be in [0, train.steps={t.steps}]; 0 runs to train.steps",
    )
    _require(
        not t.stop_at_step or config.checkpoint.every_steps > 0,
        f"train.stop_at_step={t.stop_at_step} stops a run to continue it later, which needs checkpoints; "
        "set checkpoint.every_steps > 0",
    )
    rules = parse_rules(config.sharding.rules)
    ici, dcn = mesh_shape(config.mesh, num_devices if num_devices is not None else _fixed_mesh_size(config.mesh))
    axis_size = {a: i * d for a, i, d in zip(MESH_AXES, ici, dcn)}
    dp = 1
    for a in rules.get(BATCH_AXIS, ()):
        dp *= axis_size[a]
    batch_axes = "+".join(rules.get(BATCH_AXIS, ())) or "none"
    _require(
        t.batch_size % dp == 0,
        f"train.batch_size={t.batch_size} is not divisible by the data-parallel size {dp} (mesh axes {batch_axes}); "
        f"use a multiple of {dp}",
    )
    _require(
        isinstance(t.microbatches, int) and t.microbatches >= 1,
        f"train.microbatches={t.microbatches!r} must be a positive integer (1: no gradient accumulation)",
    )
    _require(
        t.batch_size % (t.microbatches * dp) == 0,
        f"train.batch_size={t.batch_size} does not split into train.microbatches={t.microbatches} parts of a "
        f"multiple of the data-parallel size {dp}; use a batch size divisible by {t.microbatches * dp}",
    )
    _require(t.log_every >= 1, f"train.log_every={t.log_every} must be at least 1")
    _require(
        t.peak_flops_per_device >= 0,
        f"train.peak_flops_per_device={t.peak_flops_per_device} is negative; give FLOP/s, or 0 for the known peak",
    )

    schedule = PassSchedule.parse(p.schedule, t.steps, config.seed)
    _require(p.noise_std >= 0, f"passes.noise_std={p.noise_std} is negative; use 0 to turn jitter off")
    _require(0.0 <= p.prefix_mixin_prob <= 1.0, f"passes.prefix_mixin_prob={p.prefix_mixin_prob} must be in [0, 1]")
    last = d.seq_len - 1
    _require(
        1 <= p.fuse_from_min <= p.fuse_from_max <= last,
        f"fuse-from range passes.fuse_from_min..fuse_from_max = {p.fuse_from_min}..{p.fuse_from_max} is outside the "
        f"sequence; it must satisfy 1 <= min <= max <= data.seq_len-1 = {last}",
    )
    max_k = max(schedule.pass_counts)  # loss weights matter in training only
    if p.loss_weights:
        weights = tuple(float(w) for w in p.loss_weights)
        _require(
            len(weights) >= max_k,
            f"passes.loss_weights has {len(weights)} entries but up to K={max_k} passes run; give one weight per pass up to {max_k}",
        )
        _require(
            all(w >= 0 for w in weights), f"passes.loss_weights={weights} has a negative weight; weights must be >= 0"
        )
        _require(
            all(sum(weights[:k]) > 0 for k in range(1, max_k + 1)),
            f"passes.loss_weights={weights} gives zero total weight for some K; make the first weight positive",
        )

    _require(o.learning_rate > 0, f"optimizer.learning_rate={o.learning_rate} must be positive")
    _require(
        0 <= o.warmup_steps < t.steps,
        f"optimizer.warmup_steps={o.warmup_steps} must be in [0, train.steps={t.steps}); shorten the warmup",
    )
    _require(
        0.0 <= o.min_learning_rate_ratio <= 1.0,
        f"optimizer.min_learning_rate_ratio={o.min_learning_rate_ratio} must be in [0, 1]",
    )
    _require(
        o.grad_clip_norm >= 0, f"optimizer.grad_clip_norm={o.grad_clip_norm} is negative; use 0 to turn clipping off"
    )
    _require(o.weight_decay >= 0, f"optimizer.weight_decay={o.weight_decay} is negative")
    for name in ("b1", "b2"):
        _require(0.0 <= o[name] < 1.0, f"optimizer.{name}={o[name]} must be in [0, 1)")
    _require(o.eps > 0, f"optimizer.eps={o.eps} must be positive")

    _require(len(e.num_passes) >= 1, "eval.num_passes is empty; list the pass counts to evaluate, e.g. (1, 2, 3)")
    _require(
        all(isinstance(k, int) and k >= 1 for k in e.num_passes),
        f"eval.num_passes={tuple(e.num_passes)} must list integers K >= 1, e.g. (1, 2, 3)",
    )
    _require(
        1 <= e.fuse_from <= last, f"eval.fuse_from={e.fuse_from} is outside the sequence; use 1..data.seq_len-1={last}"
    )
    _require(e.num_batches >= 0, f"eval.num_batches={e.num_batches} is negative; use 0 to skip evaluation")
    _require(
        e.batch_size >= 1 and e.batch_size % dp == 0,
        f"eval.batch_size={e.batch_size} must be a positive multiple of the data-parallel size {dp}",
    )
    k = config.checkpoint
    _require(k.every_steps >= 0, f"checkpoint.every_steps={k.every_steps} is negative; use 0 to turn checkpoints off")
    _require(k.max_to_keep >= 1, f"checkpoint.max_to_keep={k.max_to_keep} must be at least 1")
    _require(k.keep_every >= 0, f"checkpoint.keep_every={k.keep_every} is negative; use 0 for none")
    _require(
        config.distributed.mode in ("auto", "always", "never"),
        f"distributed.mode={config.distributed.mode!r} is unknown; use auto, always or never",
    )
    _require(
        config.dry_run_hbm_gib >= 0, f"dry_run_hbm_gib={config.dry_run_hbm_gib} is negative; use 0 for no fit check"
    )
    if config.dry_run_chip:
        chip_hbm_gib(config.dry_run_chip)  # an unknown chip is a ConfigError naming the known ones
    _require(
        config.dry_run_num_slices >= 1 and (config.dry_run_topology or config.dry_run_num_slices == 1),
        f"dry_run_num_slices={config.dry_run_num_slices}: slices of a dry_run_topology, at least 1 "
        "(e.g. --config.dry_run_topology=v5e:8x8 --config.dry_run_num_slices=2 --config.mesh.dcn_data=2)",
    )
    _require(e.every_steps >= 0, f"eval.every_steps={e.every_steps} is negative; use 0 for a final eval only")
    _require(
        e.contraction_passes == 0 or e.contraction_passes >= 2,
        f"eval.contraction_passes={e.contraction_passes}: a contraction rate needs at least 2 passes; use 0 to turn it off",
    )
    monitored_last = max_k + e.contraction_passes
    _require(
        e.contraction_passes == 0 or monitored_last <= config.data.seq_len - e.fuse_from + 1,
        f"eval.contraction_passes={e.contraction_passes}: passes {max_k + 1}..{monitored_last} go beyond "
        f"data.seq_len - eval.fuse_from + 1 = {config.data.seq_len - e.fuse_from + 1}, where the states are exact and "
        "stop changing; use fewer passes or longer sequences",
    )
    _require(
        e.contraction_every_steps >= 0,
        f"eval.contraction_every_steps={e.contraction_every_steps} is negative; use 0 to monitor at evals only",
    )
    if e.harness_tasks.strip():  # lm-evaluation-harness during training: its fields, one line each
        from fbt_jax.evals.harness_tasks import settings_from_config

        settings_from_config(config)
    paths.check_config_dirs(config)
    if str(t.compilation_cache_dir) not in ("auto", ""):
        paths.check_dir_path(str(t.compilation_cache_dir), "--config.train.compilation_cache_dir")
    parse_profile_steps(t.profile_steps, t.steps)
    check_metrics_config(config)  # metrics.wandb without wandb installed
    _require(
        not (config.init_from and config.fork_from),
        "init_from and fork_from are both set; init_from starts a new run from parameters only, fork_from "
        "continues a trunk's whole train state: keep one",
    )
    for field in ("init_from", "fork_from"):
        path = config[field]
        if path and not paths.is_url(path) and not config.dry_run:
            # Checked here, before the train state is built, not only when it is loaded into it.
            _require(
                os.path.isdir(path),
                f"--config.{field}={path!r} is not a directory; give a run's workdir or its checkpoints "
                "directory, or '' to start from scratch",
            )
    return schedule


def validation_readers(eval_config: ml_collections.ConfigDict) -> str:
    """What in a training run reads the validation split, each with the setting that turns it off."""
    e, readers = eval_config, []
    if e.num_batches > 0:
        readers.append(f"the held-out eval (eval.num_batches={e.num_batches}; 0 turns it off)")
    if e.contraction_passes and e.contraction_every_steps:
        readers.append(f"the contraction monitor (eval.contraction_passes={e.contraction_passes}; 0 turns it off)")
    return " and ".join(readers)
