"""`fbt-import HF_DIR OUT`: a Hugging Face model directory becomes an fbt run directory.

OUT then holds config.json (the run config: the model derived from the Hugging Face config, the
source config itself in `hf_config`, the tokenizer when the directory has one), a checkpoint of
the parameters at step 0 under checkpoints/, and tokenizer/ with the tokenizer files. Every
`--checkpoint` and `--config.init_from` takes it like a trained run.

Everything is checked from config.json and the safetensors headers before a weight is read.
Weights are then read tensor by tensor, each straight into its sharded place on the mesh: each
process reads from the files only the blocks its own devices hold (`TensorMap.read_block`), so
host memory holds at most this process's share of the model plus one tensor block.

The fusion (W_U, W_G) is not in a Hugging Face model. `--fusion-init=readout` (the default)
starts it where the pretrained stack already makes sense of it: W_U maps each token's readout
row to its embedding row (least squares; the identity for tied embeddings), scaled so that
W_U h has the embeddings' RMS, and W_G = 0, so that σ(W_G e) = ½ everywhere (W_U carries the
factor 2). A feedback pass then reads the embedding of the token pass 1 predicted instead of the
token itself. `random` draws the fusion as for training from scratch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from fbt_jax import distributed, paths, sharding
from fbt_jax.checkpoint import model_signature
from fbt_jax.config import default_config
from fbt_jax.errors import ArgumentParser, ConfigError, reported
from fbt_jax.interop import hf_files, tensors
from fbt_jax.interop.hf_config import Refused, model_config_from_hf, standard_fields
from fbt_jax.layers import Fusion
from fbt_jax.model import ModelConfig, abstract_model

FUSION_INITS = ("readout", "random")
SIDECAR_CONFIG = "fbt_config.json"
SIDECAR_WEIGHTS = "fbt_fusion.safetensors"
CHUNK_BYTES = 16 * 2**20


def readout_fusion(
    embedding_VD: jax.Array, readout_VD: jax.Array, final_scale_D: jax.Array, kind: str
) -> tuple[jax.Array, jax.Array]:
    """(W_U, W_G) laid out (in, out) as `Fusion` holds them, for `--fusion-init=readout`."""
    D = embedding_VD.shape[1]
    e_VD, r_VD = embedding_VD.astype(jnp.float32), readout_VD.astype(jnp.float32)
    gram_DD = r_VD.T @ r_VD
    ridge = 1e-6 * jnp.trace(gram_DD) / D  # keeps a rank-deficient readout solvable
    state_DD = jnp.linalg.solve(gram_DD + ridge * jnp.eye(D), r_VD.T @ e_VD)  # r_v · W ≈ e_v
    rms_h = jnp.sqrt(jnp.mean(final_scale_D.astype(jnp.float32) ** 2))  # h = final-normed: RMS ≈ that of its scale
    rms_e = jnp.sqrt(jnp.mean(e_VD**2))
    gain = 2.0 if kind == "glu" else 0.0  # glu: σ(0) = ½; add: u = e + W_U h, so W_U = 0 gives e back
    state_DD = state_DD * (gain * rms_e / (rms_h * jnp.sqrt(jnp.mean(state_DD**2)) * math.sqrt(D)))
    return state_DD.astype(embedding_VD.dtype), jnp.zeros((D, D), embedding_VD.dtype)


def run_config(
    model: ModelConfig, source: dict[str, Any], out: str, seq_len: int, tokenizer: str
) -> ml_collections.ConfigDict:
    """The run config an imported model is recorded with: the model, its tokenizer and context."""
    config = default_config()
    config.workdir = out
    config.model = ml_collections.ConfigDict(dataclasses.asdict(model))
    config.data.source = "text"
    config.data.seq_len = seq_len or min(int(source.get("max_position_embeddings") or 2048), 2048)
    if tokenizer:
        config.data.tokenizer = tokenizer
    config.hf_config = json.dumps(source, sort_keys=True)
    return config


def import_model(
    hf_dir: str,
    out: str,
    fusion_init: str = "readout",
    seq_len: int = 0,
    scan_layers: bool = False,
    mesh_cfg: ml_collections.ConfigDict | None = None,
    seed: int = 0,
    log: Any = print,
) -> ml_collections.ConfigDict:
    """Import `hf_dir` into the run directory `out`; returns the run's config."""
    if fusion_init not in FUSION_INITS:
        raise ConfigError(f"--fusion-init={fusion_init!r} is unknown; use one of {FUSION_INITS}")
    hf_dir, out = paths.resolve(hf_dir, "HF_DIR"), paths.resolve(out, "OUT")
    src = hf_files.HFDirectory(hf_dir)
    cfg = model_config_from_hf(src.config, hf_dir)
    sidecar = _read_sidecar(src, cfg)
    if sidecar:
        cfg = ModelConfig(**{**sidecar["model"], "scan_layers": scan_layers})
    else:
        cfg = dataclasses.replace(cfg, scan_layers=scan_layers)
    optional = ("lm_head.weight",) if cfg.tie_embeddings else ()  # some tied checkpoints also store the copy
    src.check(tensors.hf_shapes(cfg), optional)
    target = epath.Path(out)
    if target.exists() and any(target.iterdir()):
        raise ConfigError(f"OUT={out} exists and is not empty; give a new directory (nothing was written)")
    tokenizer_files = src.tokenizer_files()
    tokenizer_dir = str(target / "tokenizer") if tokenizer_files else ""
    config = run_config(cfg, src.config, out, seq_len, tokenizer_dir)
    if mesh_cfg is not None:
        config.mesh = mesh_cfg
    mesh = sharding.make_mesh(config.mesh)
    graphdef, abstract_params = nnx.split(abstract_model(cfg), nnx.Param)
    shardings = sharding.param_shardings(abstract_params, mesh, sharding.parse_rules(config.sharding.rules))
    dtypes = {path: var.get_value().dtype for path, var in nnx.to_flat_state(abstract_params)}
    params = _read_params(src, cfg, shardings, dtypes, sidecar, fusion_init, seed)
    log(f"read {len(tensors.hf_shapes(cfg))} tensors from {hf_dir}")
    _write_run(target, config, params, src, tokenizer_files)
    log(
        f"wrote {out}: {sum(math.prod(x.shape) for x in jax.tree.leaves(params)):,} parameters, fusion: {'from ' + SIDECAR_WEIGHTS if sidecar else fusion_init}"
    )
    return config


def _read_sidecar(src: hf_files.HFDirectory, cfg: ModelConfig) -> dict[str, Any] | None:
    """The fbt config of a directory fbt-export wrote, checked against its config.json."""
    if not src.has(SIDECAR_CONFIG):
        return None
    try:
        with open(os.path.join(src.path, SIDECAR_CONFIG), encoding="utf-8") as f:
            sidecar = json.load(f)
        fields = {k: v for k, v in sidecar["model"].items() if k in ModelConfig.__dataclass_fields__}
        ours = ModelConfig(**fields)
        ours.check()
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise Refused(
            f"{src.path}/{SIDECAR_CONFIG} is not an fbt export's config ({err}); remove it or re-export"
        ) from None
    if standard_fields(ours) != standard_fields(cfg):
        raise Refused(f"{src.path}: {SIDECAR_CONFIG} describes another model than config.json; remove one of them")
    if not src.has(SIDECAR_WEIGHTS):
        raise Refused(f"{src.path}: {SIDECAR_CONFIG} without {SIDECAR_WEIGHTS}; copy the whole exported directory")
    return {**sidecar, "model": dataclasses.asdict(ours)}


def _read_params(
    src: hf_files.HFDirectory,
    cfg: ModelConfig,
    shardings: Any,
    dtypes: dict[tuple, Any],
    sidecar: dict | None,
    fusion_init: str,
    seed: int,
) -> nnx.State:
    """Every parameter placed with its sharding, each device's block read from the files by the
    process that holds it, in the model's parameter dtype; the fusion from the fbt files or made."""
    by_path = {m.path: m for m in tensors.tensor_maps(cfg)}
    side = None
    if sidecar:
        side = hf_files.Sidecar(os.path.join(src.path, SIDECAR_WEIGHTS))
        if sidecar.get("final_norm_folded"):  # the norm as trained, before the logit scale was folded in
            by_path[("final_norm", "scale")] = tensors.TensorMap(
                ("final_norm", "scale"), (tensors.FINAL_NORM_NAME,), (cfg.embed_dim,), (cfg.embed_dim,), (0,)
            )
    flat = []
    for path, var in nnx.to_flat_state(shardings):
        spec, dtype = var.get_value(), dtypes[path]  # the parameter's NamedSharding and dtype
        if path in by_path:
            m = by_path[path]
            getter = side.get_slice if side is not None and m.hf_names[0].startswith("fbt.") else src.get_slice
            array = jax.make_array_from_callback(
                m.shape, spec, lambda idx, m=m, g=getter, t=dtype: m.read_block(g, idx).astype(t, copy=False)
            )
        elif side is not None:
            name = tensors.FUSION_NAMES[path]
            array = jax.make_array_from_callback(
                tuple(side.get_slice(name).get_shape()),
                spec,
                lambda idx, n=name, t=dtype: side.get_slice(n)[idx].astype(t, copy=False),
            )
        else:
            array = None  # the fusion, made below from the imported tensors
        flat.append((path, var.replace(array) if array is not None else var))
    state = nnx.from_flat_state(flat)
    fusion = state["fusion"]
    if side is None:
        state_sharding = fusion["state_proj_DD"].get_value()
        if fusion_init == "readout":
            readout = state["readout_VD"] if "readout_VD" in state else state["embedding_VD"]
            # Computed replicated, so that every mesh gets the same bits as one device.
            whole = jax.sharding.NamedSharding(state_sharding.mesh, jax.sharding.PartitionSpec())

            def replicated(*arrays: jax.Array) -> tuple[jax.Array, jax.Array]:
                return readout_fusion(*(jax.lax.with_sharding_constraint(a, whole) for a in arrays), cfg.fusion)

            made = jax.jit(replicated, out_shardings=(state_sharding,) * 2)(
                state["embedding_VD"].get_value(), readout.get_value(), state["final_norm"]["scale"].get_value()
            )
            values = {"state_proj_DD": made[0], "gate_proj_DD": made[1]}
        else:
            pdt = jnp.dtype(cfg.param_dtype)
            fresh = nnx.state(Fusion(cfg.embed_dim, cfg.fusion, pdt, cfg.compute_dtype, nnx.Rngs(params=seed)))
            values = {k: jax.device_put(v.get_value(), fusion[k].get_value()) for k, v in fresh.items()}
        for key in list(fusion.keys()):
            fusion[key] = fusion[key].replace(values[key])
    return state


def _write_run(
    target: epath.Path,
    config: ml_collections.ConfigDict,
    params: nnx.State,
    src: hf_files.HFDirectory,
    tokenizer_files: list[str],
) -> None:
    meta = {"step": 0, "model": model_signature(config), "config": json.loads(config.to_json_best_effort())}
    # Uncompressed: zstd finds little to take out of trained weights, and its buffers held half
    # the model again in host memory while saving (benchmarks/interop_memory.py).
    handler = ocp.PyTreeCheckpointHandler(use_compression=False)
    # Stored in chunks of at most CHUNK_BYTES, so that reading a large tensor back (an export, a
    # restore onto one host) never holds a second copy of it whole.
    chunked = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), params)
    options = ocp.CheckpointManagerOptions(create=True)
    manager = ocp.CheckpointManager(
        target / "checkpoints", options=options, item_handlers={"state": handler, "meta": ocp.JsonCheckpointHandler()}
    )
    try:
        manager.save(
            0,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave({"params": params}, save_args={"params": chunked}),
                meta=ocp.args.JsonSave(meta),
            ),
        )
        manager.wait_until_finished()
    finally:
        manager.close()
    if jax.process_index() != 0:
        return
    (target / "config.json").write_text(config.to_json_best_effort(indent=2))
    if tokenizer_files:
        (target / "tokenizer").mkdir(parents=True, exist_ok=True)
        for name in tokenizer_files:
            (target / "tokenizer" / name).write_bytes(epath.Path(src.path, name).read_bytes())


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="fbt-import", description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", help="a local Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("out", help="the fbt run directory to create (local or gs://)")
    parser.add_argument("--fusion-init", default="readout", help="readout (default) | random")
    parser.add_argument(
        "--seq-len", type=int, default=0, help="data.seq_len of the run (default: the model's context, at most 2048)"
    )
    parser.add_argument(
        "--scan-layers", action="store_true", help="stack the layers (model.scan_layers, for deep models)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --fusion-init=random")
    parser.add_argument("--fsdp", type=int, default=1, help="mesh.fsdp: parameters sharded over this many devices")
    parser.add_argument("--tensor", type=int, default=1, help="mesh.tensor")
    parser.add_argument("--coordinator-address", default="", help="host:port of process 0 (multi-process imports)")
    parser.add_argument("--num-processes", type=int, default=0)
    parser.add_argument("--process-id", type=int, default=-1)
    with reported("fbt-import"):
        args = parser.parse_args(argv)
        hf_files.return_freed_memory()
        config = default_config()
        config.distributed.coordinator_address = args.coordinator_address
        config.distributed.num_processes = args.num_processes
        config.distributed.process_id = args.process_id
        distributed.initialize(config.distributed)
        config.mesh.fsdp, config.mesh.tensor = args.fsdp, args.tensor
        out = paths.resolve(args.out, "OUT")
        paths.check_output_dir(out, "OUT")
        hf_dir = paths.resolve(args.hf_dir, "HF_DIR")
        import_model(hf_dir, out, args.fusion_init, args.seq_len, args.scan_layers, config.mesh, args.seed)
