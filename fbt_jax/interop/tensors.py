"""Every parameter's Hugging Face name and layout, and the slices of a file that one device needs.

A Hugging Face tensor becomes ours by splitting its head axis and transposing: q_proj.weight
(N·H, D) is read as (N, H, D) and laid out (D, N, H) = q_DNH. `TensorMap` records exactly that
(`split` shape, `perm`), so that the same record converts a whole tensor for export and reads just
the block of the file that one device holds for import (`read_block`): a device holding heads
n0…n1 of q_DNH reads rows n0·H…n1·H of q_proj.weight, nothing else. With scanned layers the
layers' tensors are stacked on a leading axis, one file tensor per layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from fbt_jax.model import ModelConfig

Path = tuple[Any, ...]  # a parameter's path in the model state, e.g. ("blocks", 0, "attn", "q_DNH")


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One of our parameters and its Hugging Face tensor(s): ours = hf.reshape(split).transpose(perm)."""

    path: Path
    hf_names: tuple[str, ...]  # one name, or one per layer when `stacked`
    hf_shape: tuple[int, ...]
    split: tuple[int, ...]
    perm: tuple[int, ...]
    stacked: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        per_layer = tuple(self.split[a] for a in self.perm)
        return (len(self.hf_names), *per_layer) if self.stacked else per_layer

    def to_fbt(self, hf: np.ndarray) -> np.ndarray:
        return hf.reshape(self.split).transpose(self.perm)

    def to_hf(self, ours: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(ours.transpose(np.argsort(self.perm)).reshape(self.hf_shape))

    def read_block(self, get_slice: Callable[[str], Any], index: tuple[slice, ...]) -> np.ndarray:
        """Our tensor's block `index` (what one device holds), reading from each file tensor only the
        rows and columns that block needs; `get_slice(name)` is a safetensors slice object."""
        index = tuple(slice(*s.indices(n)) for s, n in zip(index, self.shape))
        if not self.stacked:
            return self._read_layer(get_slice(self.hf_names[0]), index)
        layers = range(*index[0].indices(len(self.hf_names)))
        return np.stack([self._read_layer(get_slice(self.hf_names[i]), index[1:]) for i in layers])

    def _read_layer(self, tensor: Any, index: tuple[slice, ...]) -> np.ndarray:
        split_index: list[slice] = [slice(None)] * len(self.split)
        for ours, axis in enumerate(self.perm):
            split_index[axis] = index[ours]
        # Walk the file's axes; an axis split in two (heads × head dim) is read over whole heads.
        file_index, local, axis = [], [], 0
        for size in self.hf_shape:
            if self.split[axis] == size:
                file_index.append(slice(split_index[axis].start, split_index[axis].stop))
                local.append(slice(None))
                axis += 1
                continue
            outer, inner = split_index[axis], split_index[axis + 1]
            width = self.split[axis + 1]
            assert self.split[axis] * width == size, (self.path, self.hf_shape, self.split)
            file_index.append(slice(outer.start * width, outer.stop * width))
            local += [slice(None), inner]
            axis += 2
        block = np.asarray(tensor[tuple(file_index)])
        # Axes read as selected have the selection's length; a head-dim axis was read whole.
        read_shape = [
            s.stop - s.start if keep == slice(None) else size for s, keep, size in zip(split_index, local, self.split)
        ]
        return block.reshape(read_shape)[tuple(local)].transpose(self.perm)


def tensor_maps(cfg: ModelConfig) -> list[TensorMap]:
    """Every parameter of the standard model (the fusion is not a Hugging Face tensor), in file order."""
    D, F, V, L = cfg.embed_dim, cfg.mlp_dim, cfg.vocab_size, cfg.num_layers
    N, G, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    maps = [TensorMap(("embedding_VD",), ("model.embed_tokens.weight",), (V, D), (V, D), (0, 1))]
    per_layer = [
        (("attn_norm", "scale"), "input_layernorm.weight", (D,), (D,), (0,)),
        (("attn", "q_DNH"), "self_attn.q_proj.weight", (N * H, D), (N, H, D), (2, 0, 1)),
        (("attn", "k_DGH"), "self_attn.k_proj.weight", (G * H, D), (G, H, D), (2, 0, 1)),
        (("attn", "v_DGH"), "self_attn.v_proj.weight", (G * H, D), (G, H, D), (2, 0, 1)),
        (("attn", "o_NHD"), "self_attn.o_proj.weight", (D, N * H), (D, N, H), (1, 2, 0)),
        (("mlp_norm", "scale"), "post_attention_layernorm.weight", (D,), (D,), (0,)),
        (("mlp", "gate_DF"), "mlp.gate_proj.weight", (F, D), (F, D), (1, 0)),
        (("mlp", "up_DF"), "mlp.up_proj.weight", (F, D), (F, D), (1, 0)),
        (("mlp", "down_FD"), "mlp.down_proj.weight", (D, F), (D, F), (1, 0)),
    ]
    if cfg.qkv_bias:
        per_layer += [
            (("attn", "q_bias_NH"), "self_attn.q_proj.bias", (N * H,), (N, H), (0, 1)),
            (("attn", "k_bias_GH"), "self_attn.k_proj.bias", (G * H,), (G, H), (0, 1)),
            (("attn", "v_bias_GH"), "self_attn.v_proj.bias", (G * H,), (G, H), (0, 1)),
        ]
    for sub, name, hf_shape, split, perm in per_layer:
        names = tuple(f"model.layers.{i}.{name}" for i in range(L))
        if cfg.scan_layers:
            maps.append(TensorMap(("blocks", *sub), names, hf_shape, split, perm, stacked=True))
        else:
            maps += [TensorMap(("blocks", i, *sub), (names[i],), hf_shape, split, perm) for i in range(L)]
    maps.append(TensorMap(("final_norm", "scale"), ("model.norm.weight",), (D,), (D,), (0,)))
    if not cfg.tie_embeddings:
        maps.append(TensorMap(("readout_VD",), ("lm_head.weight",), (V, D), (V, D), (0, 1)))
    return maps


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name the model needs, with its shape."""
    return {name: m.hf_shape for m in tensor_maps(cfg) for name in m.hf_names}


FUSION_NAMES = {
    ("fusion", "state_proj_DD"): "fbt.fusion.state_proj",
    ("fusion", "gate_proj_DD"): "fbt.fusion.gate_proj",
}
# The final norm as trained, kept beside an export whose model.norm.weight carries a folded logit scale.
FINAL_NORM_NAME = "fbt.final_norm.weight"
