"""`fbt-export RUN OUT`: any run (imported, upcycled, trained from scratch) as a Hugging Face directory.

OUT holds what transformers writes for the architecture (config.json, model.safetensors or
shards with model.safetensors.index.json, the tokenizer files), so that it loads as an ordinary
model for standard decoding anywhere; beside it fbt_config.json (the fbt model config) and
fbt_fusion.safetensors (W_U, W_G), which `fbt-import` reads back to restore the Full-Bandwidth
model bitwise. A run trained with `model.scale_logits` (a readout scaled by 1/√D, which no
Hugging Face architecture has) is exported with that factor folded into model.norm.weight (equal
logits up to rounding); the norm as trained is kept in fbt_fusion.safetensors.

A new OUT is written under a temporary name and renamed at the end: OUT never holds half an
export. An existing empty OUT is kept as it is (its mode, group and setgid bit: a group-shared
directory stays one): the export is written in a hidden directory inside it and its files then
move up, config.json last, so an OUT with a config.json holds the whole export; a failed export
leaves OUT empty. Tensors are converted one at a time and each source array is freed once
written, so host memory holds the model once plus one file's worth of converted tensors at most.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np

from fbt_jax import paths, permissions
from fbt_jax.data.tokenizers import HuggingFaceTokenizer, Tokenizer, load_tokenizer
from fbt_jax.errors import ArgumentParser, ConfigError, reported
from fbt_jax.interop import hf_files, tensors
from fbt_jax.interop.hf_config import hf_config_from_model
from fbt_jax.interop.importer import SIDECAR_CONFIG, SIDECAR_WEIGHTS
from fbt_jax.model import ModelConfig

SIDECAR_FORMAT = 1
STAGING = ".fbt-export-partial-"  # inside an existing OUT: the export before its files move up


def check_out(out: str) -> None:
    if paths.is_url(out):
        paths.check_reachable(out, "OUT", writable=True)
        from etils import epath

        if epath.Path(out).exists() and any(epath.Path(out).iterdir()):
            raise ConfigError(f"OUT={out} exists and is not empty; give a new directory (nothing was written)")
        return
    if os.path.isdir(out) and os.listdir(out) and all(name.startswith(STAGING) for name in os.listdir(out)):
        raise ConfigError(
            f"OUT={out} holds {', '.join(sorted(os.listdir(out)))}, left by an interrupted fbt-export; "
            "remove it and export again (nothing was written)"
        )
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
    tokenizer = _run_tokenizer(config)
    fresh = {**_token_ids(tokenizer), "max_position_embeddings": int(config.data.seq_len)}  # for a run never imported
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

    existing = os.path.isdir(out)  # and empty (checked above)
    # Staged inside an existing OUT, files take its group (setgid) and move up by a rename on its own filesystem.
    tmp = os.path.join(out, f"{STAGING}{os.getpid()}") if existing else f"{out.rstrip('/')}.partial-{os.getpid()}"
    os.makedirs(tmp)
    moved: list[str] = []
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
        files += [SIDECAR_CONFIG, SIDECAR_WEIGHTS, *_copy_tokenizer(config, tokenizer, tmp, log), "config.json"]
        # safetensors writes its files 0600: a model is handed to others. The directory keeps the mode mkdir gave
        # it (a setgid bit inherited from a group-shared parent included).
        for name in files:
            os.chmod(os.path.join(tmp, name), permissions.umask_mode())
        if existing:
            for name in files:  # config.json last: a directory with one holds the whole export
                os.rename(os.path.join(tmp, name), os.path.join(out, name))
                moved.append(name)
            os.rmdir(tmp)
        else:
            os.rename(tmp, out)
    except BaseException:
        for name in moved:  # OUT back to empty, as it was given
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out, name))
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


def _run_tokenizer(config: Any) -> Tokenizer | None:
    """The run's tokenizer; None for a built-in task's ids or the byte tokenizer (no Hugging Face file has them)."""
    if config.data.source == "task" or config.data.tokenizer in ("byte", ""):
        return None
    return load_tokenizer(config.data.tokenizer)


def _token_ids(tokenizer: Tokenizer | None) -> dict[str, int | None]:
    """bos/eos ids of the run's tokenizer, for a config.json written from scratch."""
    if tokenizer is None:
        return {"bos_token_id": None, "eos_token_id": None}
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}


def _copy_tokenizer(config: Any, tokenizer: Tokenizer | None, out: str, log: Any) -> list[str]:
    """The run's tokenizer files, as a Hugging Face directory holds them."""
    spec = config.data.tokenizer
    if tokenizer is None:
        log(
            "no tokenizer files: the run's tokens are a built-in task's ids"
            if config.data.source == "task"
            else "no tokenizer files: the run uses the byte tokenizer, which Hugging Face has no file for"
        )
        return []
    if os.path.isdir(spec):
        names = [f for f in hf_files.TOKENIZER_FILES if os.path.isfile(os.path.join(spec, f))]
        names = list(hf_files.copy_files(spec, names, out))
    else:  # named by what it was loaded as: a .json-less tokenizer.json is still one
        names = ["tokenizer.json" if isinstance(tokenizer, HuggingFaceTokenizer) else "tokenizer.model"]
        shutil.copyfile(spec, os.path.join(out, names[0]))
    if isinstance(tokenizer, HuggingFaceTokenizer) and "tokenizer_config.json" not in names:
        # A bare tokenizer.json names no end-of-text token, and transformers reads eos/bos from this file only:
        # without it the export loads with eos_token=None, which lm-eval's hf backend fails on (issue #43).
        config_file = os.path.join(out, "tokenizer_config.json")
        hf_files.write_json(config_file, hf_files.tokenizer_config(out, tokenizer.eos_id, tokenizer.bos_id))
        names.append("tokenizer_config.json")
    return names


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
