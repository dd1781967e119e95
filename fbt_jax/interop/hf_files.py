"""Hugging Face model directories on disk: read (safetensors only) and write (sharded with an index).

A model directory is data, never code: only `.safetensors` files and JSON are opened, pickled
weights (`pytorch_model.bin`, `.pt`, `.pth`, `.ckpt`) are refused without being read, and no
Python file in the directory is imported. Reading opens each file's header (names, shapes,
dtypes) for every check before any weight is read; weights are then read slice by slice through
memory maps, so a process reads only the blocks its devices hold.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from fbt_jax.interop.hf_config import Refused

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# safetensors dtype → what we load it as; all three convert to fp32 exactly.
LOADABLE = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16}
EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")
READ_BYTES = 16 * 2**20  # a tensor is read in pieces of at most this many bytes
# Tensors some checkpoints carry that the model derives: skipped on import.
DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


class HFDirectory:
    """A local Hugging Face model directory: its config and the headers of its weight files."""

    def __init__(self, path: str):
        self.path = path
        if "://" in path:
            raise Refused(f"{path}: fbt-import reads a local model directory; copy it from the bucket first")
        if not os.path.isdir(path):
            raise Refused(
                f"{path} is not a directory; give a local Hugging Face model directory (config.json + *.safetensors)"
            )
        if not os.path.isfile(os.path.join(path, CONFIG)):
            raise Refused(f"{path} has no config.json; give a Hugging Face model directory")
        try:
            with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
                self.config: dict[str, Any] = json.load(f)
        except (OSError, ValueError) as err:
            raise Refused(f"{path}/config.json is not readable JSON ({err}); fix or replace the file") from None
        self.files = self._weight_files()
        self.names: dict[str, str] = {}  # tensor name → file
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for file in self.files:
            try:
                with safe_open(os.path.join(path, file), framework="numpy") as handle:
                    for name in handle.keys():
                        piece = handle.get_slice(name)
                        self.names[name], self.shapes[name] = file, tuple(piece.get_shape())
                        self.dtypes[name] = piece.get_dtype()
            except Exception as err:
                raise Refused(f"{path}/{file} is not a readable safetensors file ({err}); re-download it") from None

    def _weight_files(self) -> list[str]:
        listing = os.listdir(self.path)
        if INDEX in listing:
            try:
                with open(os.path.join(self.path, INDEX), encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError) as err:
                raise Refused(f"{self.path}/{INDEX} is not a safetensors index ({err}); fix or replace it") from None
            files = sorted(set(weight_map.values()))
            for file in files:
                if os.path.basename(file) != file or not os.path.isfile(os.path.join(self.path, file)):
                    raise Refused(
                        f"{self.path}/{INDEX} names {file!r}, which is not in the directory; download that shard"
                    )
            return files
        if WEIGHTS in listing:
            return [WEIGHTS]
        pickled = sorted(f for f in listing if f.endswith(PICKLED_SUFFIXES))
        if pickled:
            raise Refused(
                f"{self.path} holds only pickled weights ({', '.join(pickled)}), which are never unpickled here; "
                "convert them to safetensors (e.g. transformers' save_pretrained(..., safe_serialization=True))"
            )
        raise Refused(f"{self.path} has no weights ({WEIGHTS} or {INDEX}); give a complete model directory")

    def check(self, expected: dict[str, tuple[int, ...]], optional: tuple[str, ...] = ()) -> None:
        """Refused naming the first missing, extra or misshapen tensor, or one of a dtype we do not load."""
        present = {n for n in self.names if not n.endswith(DERIVED_SUFFIXES)}
        for name, shape in expected.items():
            if name not in present:
                raise Refused(f"{self.path}: tensor {name} is missing; the checkpoint does not match its config.json")
            if self.shapes[name] != tuple(shape):
                raise Refused(
                    f"{self.path}: tensor {name} has shape {list(self.shapes[name])}, config.json implies {list(shape)}"
                )
            if self.dtypes[name] not in LOADABLE:
                raise Refused(
                    f"{self.path}: tensor {name} is {self.dtypes[name]}; fbt-import loads {', '.join(LOADABLE)} "
                    "(dequantize the checkpoint first)"
                )
        extra = sorted(present - set(expected) - set(optional))
        if extra:
            raise Refused(
                f"{self.path}: tensor {extra[0]} ({len(extra)} unexpected in all) is not part of this architecture; "
                "the checkpoint does not match its config.json"
            )

    def get_slice(self, name: str) -> Any:
        return _Slice(os.path.join(self.path, self.names[name]), name)

    def tokenizer_files(self) -> list[str]:
        return [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(self.path, f))]

    def has(self, file: str) -> bool:
        return os.path.isfile(os.path.join(self.path, file))


class Sidecar:
    """Tensors of one safetensors file by name (fbt_fusion.safetensors)."""

    def __init__(self, file: str):
        self.file = file

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self.file, name)


class _Slice:
    """A tensor's blocks, each read through a memory map opened for that read and closed after:
    pages of a file that stays mapped count as this process's memory until it exits."""

    def __init__(self, file: str, name: str):
        self.file, self.name = file, name

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        """The block `index` (basic slices), read in pieces of at most READ_BYTES, each through its
        own map: the file's pages are resident for one piece at a time, not for the whole tensor."""
        with safe_open(self.file, framework="numpy") as handle:
            piece = handle.get_slice(self.name)
            shape, dtype = piece.get_shape(), LOADABLE.get(piece.get_dtype())
        index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
        rows = range(*index[0].indices(shape[0])) if shape else range(0)
        row_bytes = math.prod(len(range(*s.indices(n))) for s, n in zip(index[1:], shape[1:])) * 4
        step = max(1, READ_BYTES // max(row_bytes, 1))
        if dtype is None or len(rows) <= step:
            with safe_open(self.file, framework="numpy") as handle:
                return handle.get_slice(self.name)[index]  # safetensors copies out of the map
        out = None
        for start in range(rows.start, rows.stop, step):
            stop = min(start + step, rows.stop)
            with safe_open(self.file, framework="numpy") as handle:
                part = handle.get_slice(self.name)[(slice(start, stop), *index[1:])]
            if out is None:
                out = np.empty((len(rows), *part.shape[1:]), part.dtype)
            out[start - rows.start : stop - rows.start] = part
        return out

    def get_shape(self) -> list[int]:
        with safe_open(self.file, framework="numpy") as handle:
            return handle.get_slice(self.name).get_shape()


def return_freed_memory() -> None:
    """Have glibc hand large freed buffers back to the system at once (nothing to do elsewhere).

    glibc raises its mmap threshold each time a large buffer is freed; buffers of up to 32 MiB
    then come from the heap and stay resident once freed. Converting a model tensor by tensor
    left a fifth of the model resident in dead buffers (benchmarks/interop_memory.py)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_mmap_threshold = -3  # mallopt's parameter number, from malloc.h
    libc.mallopt(m_mmap_threshold, 1 << 20)


def shard_plan(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into files of at most `max_shard_bytes` (a larger tensor alone), in order."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_weights(
    out_dir: str,
    shapes: dict[str, tuple[int, ...]],
    dtype: str,
    tensor: Callable[[str], np.ndarray],
    max_shard_bytes: int,
) -> list[str]:
    """Write the tensors named in `shapes` as transformers does: model.safetensors, or
    model-0000i-of-0000n.safetensors with model.safetensors.index.json; returns the files written.
    `tensor(name)` produces each one when its file is written, so only one file's tensors are ever held here."""
    itemsize = np.dtype(EXPORT_DTYPES[dtype]).itemsize
    sizes = {name: math.prod(shape) * itemsize for name, shape in shapes.items()}
    plan = shard_plan(sizes, max_shard_bytes)
    files = (
        [WEIGHTS] if len(plan) == 1 else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    )
    for file, names in zip(files, plan):
        arrays = {name: np.ascontiguousarray(tensor(name).astype(EXPORT_DTYPES[dtype], copy=False)) for name in names}
        save_file(arrays, os.path.join(out_dir, file), metadata={"format": "pt"})
        del arrays
    if len(files) > 1:
        index = {
            "metadata": {
                "total_parameters": sum(math.prod(s) for s in shapes.values()),
                "total_size": sum(sizes.values()),
            },
            "weight_map": dict(sorted((name, file) for file, names in zip(files, plan) for name in names)),
        }
        write_json(os.path.join(out_dir, INDEX), index)
        files.append(INDEX)  # a file written like the shards: it is moved and uploaded with them
    return files


def write_json(path: str, record: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True)
        f.write("\n")


def tokenizer_config(directory: str, eos_id: int, bos_id: int | None) -> dict[str, Any]:
    """tokenizer_config.json for the bare tokenizer.json in `directory`, naming the end-of-document (and
    beginning-of-document) tokens of ids `eos_id` (`bos_id`), which the file itself does not name."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    config: dict[str, Any] = {
        # The generic class encodes exactly as the file does; left unnamed, transformers would pick the
        # architecture's own class, whose defaults may add or rename special tokens.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": vocab.id_to_token(eos_id),
        # tokenizers' own decode, which fbt-jax uses, does not clean spaces before punctuation either.
        "clean_up_tokenization_spaces": False,
    }
    if bos_id is not None:
        config["bos_token"] = vocab.id_to_token(bos_id)
    return config


def copy_files(src_dir: str, names: list[str], out_dir: str) -> Iterator[str]:
    for name in names:
        shutil.copyfile(os.path.join(src_dir, name), os.path.join(out_dir, name))
        yield name


def parse_size(text: str) -> int:
    """'5GB', '500MB', '60KB' or a number of bytes (decimal units, as transformers reads them)."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    upper = text.strip().upper()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if upper.endswith(unit):
            return int(float(upper[: -len(unit)]) * factor)
    return int(upper)
