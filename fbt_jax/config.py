"""The config schema (every field, with its default) and its validation.

Config files in `configs/` start from `default_config()` and override what differs; every field
is documented in docs/config.md. `validate_config` runs before anything is built or compiled and
raises `ConfigError` with one line naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import ml_collections

from fbt_jax import paths
from fbt_jax.data.pipeline import validate_data
from fbt_jax.errors import ConfigError
from fbt_jax.hardware import chip_hbm_gib
from fbt_jax.model import ModelConfig
from fbt_jax.schedule import DEFAULT_SCHEDULE, PassSchedule
from fbt_jax.sharding import BATCH_AXIS, DEFAULT_RULES, MESH_AXES, mesh_shape, parse_rules


def default_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.workdir = "runs/default"
    c.seed = 0

    c.data = ml_collections.ConfigDict()
    c.data.source = "task"  # task | text | tfds | mixture
    c.data.seq_len = 32
    # source = task: synthetic tasks generated from the example index
    c.data.task = "word_problem"  # word_problem | modular_sum | delayed_recall
    c.data.group = "S5"
    c.data.modulus = 2
    c.data.delay = 4
    c.data.task_vocab_size = 16
    # source = text: globs of text files, or a directory written by fbt-prepare
    c.data.path = ""
    c.data.tokenizer = "byte"  # byte | a SentencePiece .model | a tokenizer.json | a save_pretrained directory
    c.data.text_key = "text"  # the JSON field / Parquet column holding a document's text
    c.data.validation_fraction = 0.01
    # source = mixture: prepared datasets with weights, "[name=]path:weight,..."
    c.data.mixture = ""
    # source = tfds: a prepared TFDS dataset, read as ArrayRecord without TensorFlow
    c.data.tfds_name = ""
    c.data.tfds_data_dir = ""
    c.data.tfds_text_key = "text"
    c.data.tfds_train_split = "train"
    c.data.tfds_validation_split = "validation"
    c.data.cache_dir = ""  # where text/TFDS sources are prepared on first use ("" = <workdir>/data_cache)
    # loading
    c.data.shuffle = True
    c.data.num_workers = 0  # >0: worker processes build batches ahead of the step
    c.data.prefetch = 2

    # The model's fields and defaults are defined once, by ModelConfig (fbt_jax/model.py).
    c.model = ml_collections.ConfigDict(dataclasses.asdict(ModelConfig()))

    c.passes = ml_collections.ConfigDict()
    c.passes.schedule = DEFAULT_SCHEDULE
    c.passes.noise_std = 0.02
    c.passes.stop_gradient = False
    c.passes.loss_weights = ()
    c.passes.prefix_mixin_prob = 0.5
    c.passes.fuse_from_min = 1
    c.passes.fuse_from_max = c.data.get_ref("seq_len") // 2

    c.train = ml_collections.ConfigDict()
    c.train.steps = 1000
    c.train.batch_size = 32
    c.train.log_every = 10
    c.train.peak_flops_per_device = 0.0  # for MFU; 0: the device's known peak, or measured on a CPU
    c.train.microbatches = 1  # >1: gradient accumulation over this many parts of each global batch
    c.train.stop_at_step = 0  # >0: stop (with a checkpoint) after this step; the schedule still spans train.steps

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 100
    c.optimizer.min_learning_rate_ratio = 0.1
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.95
    c.optimizer.eps = 1e-8
    c.optimizer.weight_decay = 0.1
    c.optimizer.grad_clip_norm = 1.0

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = -1  # -1: fill the devices left over by the other axes
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.mesh.dcn_data = 1  # across-slice (DCN) factors, for multi-slice TPU jobs
    c.mesh.dcn_fsdp = 1
    c.mesh.dcn_tensor = 1

    c.sharding = ml_collections.ConfigDict()
    c.sharding.rules = DEFAULT_RULES

    c.distributed = ml_collections.ConfigDict()
    c.distributed.mode = "auto"  # auto | always | never
    c.distributed.coordinator_address = ""  # host:port of process 0, for explicit (e.g. local) launches
    c.distributed.num_processes = 0
    c.distributed.process_id = -1

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.every_steps = 1000  # 0 turns checkpointing (and resuming) off
    c.checkpoint.max_to_keep = 3
    c.checkpoint.keep_every = 0  # also keep every N-th step's checkpoint for good (0: none)
    c.checkpoint.async_save = True
    c.checkpoint.dir = ""  # "" = <workdir>/checkpoints; local or gs://
    c.checkpoint.restart_from_scratch = False  # start at step 0 even if checkpoints exist (they are kept aside)
    c.checkpoint.allow_resume_changes = False  # resume although the data, schedule, seed or batch changed
    c.init_from = ""  # a run (workdir or checkpoint dir) to take initial parameters from
    c.fork_from = ""  # a trunk run whose whole train state this run continues (sweeps)
    c.hf_config = ""  # the Hugging Face config.json an imported model came with (JSON text; fbt-export starts from it)

    c.dry_run = False
    c.dry_run_devices = 0  # >0: simulate this many CPU devices for the dry run (a pod-sized mesh)
    c.dry_run_hbm_gib = 0.0  # >0: the dry run says whether each K fits this much memory per device
    c.dry_run_chip = ""  # or a known chip whose memory that is (v5e, v5p, v6e, v4, A100, H100, H200, B200)

    c.eval = ml_collections.ConfigDict()
    c.eval.num_passes = (1, 2, 3)
    c.eval.fuse_from = 1
    c.eval.batch_size = 64
    c.eval.num_batches = 4
    c.eval.every_steps = 0
    # Contraction monitor (fbt_jax/contraction.py): the per-pass change of this many passes beyond
    # the largest K trained, at every eval and every contraction_every_steps on one held-out batch.
    c.eval.contraction_passes = 4  # 0: off
    c.eval.contraction_every_steps = 500  # 0: only at evals
    # Locked: a misspelt field in a config file (c.train.step = 5) is an error, not a new field.
    c.lock()
    return c


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


def validate_config(config: ml_collections.ConfigDict, num_devices: int | None = None) -> PassSchedule:
    """Check every field before any expensive work; returns the parsed pass schedule.

    With `num_devices` None the device-dependent checks (mesh sizes, batch divisibility) are
    skipped: the command line runs them once the devices are known.
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

    data_vocab, what = validate_data(config)
    _require(
        m.vocab_size >= data_vocab,
        f"model.vocab_size={m.vocab_size} is smaller than the data's vocabulary ({data_vocab} tokens for "
        f"{what}); set --config.model.vocab_size={data_vocab} or larger",
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
    paths.check_config_dirs(config)
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


def config_from_dict(record: dict[str, Any]) -> ml_collections.ConfigDict:
    """A full config from a (JSON) record of one: a checkpoint's, or a sweep job's; defaults for
    fields the record lacks (fields added since it was written), and fields it has that no longer
    exist are ignored."""
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
