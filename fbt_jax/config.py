"""The config schema: every field, with its default.

Config files in `configs/` start from `default_config()` and override what differs; every field
is documented in docs/config.md. `validation.py` checks a config before anything is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from fbt_jax import paths
from fbt_jax.data.mixture import parse_mixture
from fbt_jax.errors import ConfigError
from fbt_jax.model import ModelConfig
from fbt_jax.schedule import DEFAULT_SCHEDULE
from fbt_jax.sharding import DEFAULT_RULES


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
    # Chat data read from files (docs/post-training.md): text | chat | prompt-completion, the record fields,
    # a chat template file ("" = the tokenizer's own), multi-turn rule split | joint, over-long rule drop | truncate
    c.data.format = "text"
    c.data.fields = ""
    c.data.chat_template = ""
    c.data.turns = "split"
    c.data.overlong = "drop"
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
    # Persistent XLA compilation cache, so that a restart does not compile again: "auto" is
    # $JAX_COMPILATION_CACHE_DIR if set, else <workdir>/compilation_cache for a gs:// workdir (shared
    # by the run's hosts), else the user cache directory (shared by every run on this machine); "" = off.
    c.train.compilation_cache_dir = "auto"
    c.train.profile_steps = ""  # "START:END": a jax.profiler trace of steps START..END in <workdir>/profile
    c.train.profile_python = False  # also trace Python function calls (jax's Python tracer) in that window

    # Metric sinks besides metrics.jsonl and TensorBoard (process 0 only).
    c.metrics = ml_collections.ConfigDict()
    c.metrics.wandb = False  # log to Weights & Biases (pip install 'fbt-jax[wandb]'); WANDB_MODE=offline works
    c.metrics.wandb_project = "fbt-jax"
    c.metrics.wandb_entity = ""  # "" = wandb's default entity
    c.metrics.wandb_name = ""  # "" = the workdir's last component

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
    c.dry_run_topology = ""  # compile for this TPU slice or GPU node with its compiler: v5e:8x8, v5p:4x4x4, h100:8
    c.dry_run_num_slices = 1  # TPU slices of dry_run_topology (multi-slice; the mesh's dcn_* must span them)

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
    # lm-evaluation-harness tasks in each decoding mode during training (train/harness_hook.py);
    # off while harness_tasks is empty.
    c.eval.harness_tasks = ""  # the harness's task names, comma-separated
    c.eval.harness_modes = "standard,soft,fused"
    c.eval.harness_every_steps = 0  # 0: at the last step only
    c.eval.harness_include = ""  # a directory of task YAMLs (the harness's include path)
    c.eval.harness_limit = 0  # first N documents per task (0: all)
    c.eval.harness_num_fewshot = -1  # -1: each task's own
    c.eval.harness_batch_size = 32
    # Locked: a misspelt field in a config file (c.train.step = 5) is an error, not a new field.
    c.lock()
    return c


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


def resolve_config_paths(config: Any) -> None:
    """Resolve every path field of a run config in place (see `paths.resolve`): relative paths mean
    from where the command was started."""
    for field, url_ok in paths.CONFIG_PATH_FIELDS:
        section, _, name = field.rpartition(".")
        owner = config[section] if section else config
        value = paths.resolve(owner[name], f"--config.{field}")
        if paths.is_url(value) and not url_ok:
            raise ConfigError(f"--config.{field}={value!r} must be a local directory (a cache on each host)")
        owner[name] = value
    config.data.path = paths.resolve_inputs(config.data.path, "--config.data.path")
    if config.data.get("mixture"):
        parts = parse_mixture(config.data.mixture, "--config.data.mixture")
        config.data.mixture = ",".join(
            f"{name}={paths.resolve(path, '--config.data.mixture')}:{weight}" for name, path, weight in parts
        )
    cache = str(config.train.compilation_cache_dir)
    if cache not in ("auto", ""):  # "auto" and "" (off) are not paths
        config.train.compilation_cache_dir = paths.resolve(cache, "--config.train.compilation_cache_dir")
    tokenizer = config.data.tokenizer
    if tokenizer and tokenizer != "byte":
        config.data.tokenizer = paths.resolve(tokenizer, "--config.data.tokenizer")
