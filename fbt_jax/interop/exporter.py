"""`fbt-export RUN OUT`: any run (imported, upcycled, trained from scratch) as a Hugging Face directory.

OUT holds what transformers writes for the architecture (config.json, model.safetensors or
shards with model.safetensors.index.json, the tokenizer files), so that it loads as an ordinary
model for standard decoding anywhere; beside it fbt_config.json (the fbt model config) and
fbt_fusion.safetensors (W_U, W_G), which `fbt-import` reads back to restore the Full-Bandwidth
model bitwise. A run trained with `model.scale_logits` (a readout scaled by 1/√D, which no
Hugging Face architecture has) is exported with that factor folded into model.norm.weight (equal
logits up to rounding); the norm as trained is kept in fbt_fusion.safetensors.

The directory is written under a temporary name and renamed at the end: OUT never holds half an
export. Tensors are converted one at a time and each source array is freed once written, so host
memory holds the model once plus one file's worth of converted tensors at most.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np

from fbt_jax import paths, permissions
from fbt_jax.errors import ArgumentParser, ConfigError, reported
from fbt_jax.interop import hf_files, tensors
from fbt_jax.interop.hf_config import hf_config_from_model
from fbt_jax.interop.importer import SIDECAR_CONFIG, SIDECAR_WEIGHTS
from fbt_jax.model import ModelConfig

SIDECAR_FORMAT = 1


def check_out(out: str) -> None:
    if paths.is_url(out):
        paths.check_reachable(out, "OUT", writable=True)
        from etils import epath

        if epath.Path(out).exists() and any(epath.Path(out).iterdir()):
            raise ConfigError(f"OUT={out} exists and is not empty; give a new directory (nothing was written)")
        return
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"OUT={out} exists and is not an empty directory; give a new directory (nothing was written)")
    paths.check_output_dir(out, "OUT")


def export_run(run: str, out: str, dtype: str = "", max_shard_size: str = "5GB", log: Any = print) -> list[str]:
    """Export the newest checkpoint of `run` that restores to `out`; returns the files written."""
    from fbt_jax.trained import load_host_params  # orbax and the run's config: only once the arguments are checked

    run, out = paths.resolve(run, "RUN"), paths.resolve(out, "OUT")
    check_out(out)
    max_shard_bytes = _shard_bytes(max_shard_size)
    if paths.is_url(out):  # written here first, then uploaded with config.json last
        staging = tempfile.mkdtemp(prefix="fbt-export-")
        try:
            files = export_run(run, os.path.join(staging, "model"), dtype, max_shard_size, log=log)
            for name in sorted(files, key=lambda name: name == "config.json"):
                _upload(os.path.join(staging, "model", name), f"{out.rstrip('/')}/{name}")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        log(f"uploaded {len(files)} files to {out}")
        return files
    if dtype and dtype not in hf_files.EXPORT_DTYPES:
        raise ConfigError(f"--dtype={dtype!r} is unknown; use one of {tuple(hf_files.EXPORT_DTYPES)}")
    flat, config = load_host_params(run, log=log, flag="RUN")
    cfg = ModelConfig.from_config(config.model)
    source = json.loads(config.hf_config) if config.get("hf_config") else None
    dtype = dtype or (source or {}).get("dtype") or (source or {}).get("torch_dtype") or "float32"
    if dtype not in hf_files.EXPORT_DTYPES:
        raise ConfigError(f"the run's Hugging Face config asks for dtype {dtype!r}; choose one with --dtype")
    fresh = {**_token_ids(config), "max_position_embeddings": int(config.data.seq_len)}  # for a run never imported
    hf_config = hf_config_from_model(cfg, source, dtype, fresh)  # ConfigError: no counterpart
    folded = cfg.scale_logits
    side = {name: np.asarray(flat.pop(path)) for path, name in tensors.FUSION_NAMES.items() if path in flat}
    if folded:  # fold 1/√D into the final norm: h·Eᵀ/√D = (h/√D)·Eᵀ
        side[tensors.FINAL_NORM_NAME] = np.asarray(flat[("final_norm", "scale")])
        flat[("final_norm", "scale")] = np.asarray(flat[("final_norm", "scale")], np.float32) * np.float32(
            cfg.embed_dim**-0.5
        )

    maps = tensors.tensor_maps(cfg)
    source_of = {name: (m, i) for m in maps for i, name in enumerate(m.hf_names)}
    remaining = {m.path: len(m.hf_names) for m in maps}

    def tensor(name: str) -> np.ndarray:
        m, layer = source_of[name]
        value = flat[m.path]
        converted = m.to_hf(value[layer] if m.stacked else value)
        remaining[m.path] -= 1
        if not remaining[m.path]:
            del flat[m.path]  # the last tensor taken from this parameter: free it once written
        return converted

    tmp = f"{out.rstrip('/')}.partial-{os.getpid()}"
    os.makedirs(tmp)
    try:
        files = hf_files.write_weights(tmp, tensors.hf_shapes(cfg), dtype, tensor, max_shard_bytes)
        hf_files.save_file(
            {k: v.astype(hf_files.EXPORT_DTYPES[dtype]) for k, v in side.items()},
            os.path.join(tmp, SIDECAR_WEIGHTS),
            metadata={"format": "fbt"},
        )
        sidecar = {
            "format": SIDECAR_FORMAT,
            "model": config.model.to_dict(),
            "final_norm_folded": folded,
            "tensors": sorted(side),
        }
        hf_files.write_json(os.path.join(tmp, SIDECAR_CONFIG), sidecar)
        hf_files.write_json(os.path.join(tmp, "config.json"), hf_config)
        files += ["config.json", SIDECAR_CONFIG, SIDECAR_WEIGHTS, *_copy_tokenizer(config, tmp, log)]
        permissions.give_umask_modes(tmp)  # safetensors writes its files 0600: a model is handed to others
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out}: {hf_config['architectures'][0]} in {dtype}, {len(files)} files")
    return files


def _upload(source: str, target: str) -> None:
    """One file to the bucket, in 16 MiB pieces (a shard is never whole in memory)."""
    from etils import epath

    with open(source, "rb") as src, epath.Path(target).open("wb") as dst:
        shutil.copyfileobj(src, dst, 16 * 2**20)


def _shard_bytes(text: str) -> int:
    try:
        size = hf_files.parse_size(text)
    except ValueError:
        size = 0
    if size <= 0:
        raise ConfigError(f"--max-shard-size={text!r} is not a size; write e.g. 5GB, 500MB or a number of bytes")
    return size


def _token_ids(config: Any) -> dict[str, int | None]:
    """bos/eos ids of the run's tokenizer, for a config.json written from scratch."""
    if config.data.source == "task" or config.data.tokenizer == "byte":
        return {"bos_token_id": None, "eos_token_id": None}
    from fbt_jax.data.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(config.data.tokenizer)
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}


def _copy_tokenizer(config: Any, out: str, log: Any) -> list[str]:
    """The run's tokenizer files, as a Hugging Face directory holds them."""
    spec = config.data.tokenizer
    if config.data.source == "task":
        log("no tokenizer files: the run's tokens are a built-in task's ids")
        return []
    if spec == "byte" or not spec:
        log("no tokenizer files: the run uses the byte tokenizer, which Hugging Face has no file for")
        return []
    if os.path.isdir(spec):
        names = [f for f in hf_files.TOKENIZER_FILES if os.path.isfile(os.path.join(spec, f))]
        return list(hf_files.copy_files(spec, names, out))
    name = "tokenizer.model" if spec.endswith(".model") else "tokenizer.json"
    shutil.copyfile(spec, os.path.join(out, name))
    return [name]


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="fbt-export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="a run's workdir or checkpoint directory (local or gs://)")
    parser.add_argument("out", help="the Hugging Face directory to create (new or empty; local or gs://)")
    parser.add_argument(
        "--dtype", default="", help="float32 | bfloat16 | float16 (default: the imported model's, else float32)"
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file before sharding (default 5GB)"
    )
    with reported("fbt-export"):
        args = parser.parse_args(argv)
        hf_files.return_freed_memory()
        jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")  # one host is enough
        export_run(paths.resolve(args.run, "RUN"), paths.resolve(args.out, "OUT"), args.dtype, args.max_shard_size)
