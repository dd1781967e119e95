"""Device mesh, logical-axis rules and the shardings of the train state and batches.

The mesh has axes `data`, `fsdp` and `tensor`. Each size is a within-slice (ICI) size times an
across-slice (DCN) size; one ICI size may be -1 ("fill the rest"). Parameters carry logical axis
names (model.py); `sharding.rules` maps each logical name to zero or more mesh axes, e.g.

    "batch=data+fsdp, embed=fsdp, mlp=tensor, heads=tensor, kv_heads=tensor, vocab=tensor, fusion=tensor"

Names not listed are replicated. The default is the Megatron layout: a matmul's contracted dim sits
on the same mesh axis in the weight as in the activation (on this CPU build of XLA another layout
gave silently wrong gradients; tests compare every supported mesh with a single device).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fbt_jax.errors import ConfigError
from fbt_jax.layers import PARAM_AXES

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXIS = "batch"  # logical name of the batch dim of data and activations
LOGICAL_AXES = (*PARAM_AXES, BATCH_AXIS)
DEFAULT_RULES = "batch=data+fsdp, embed=fsdp, mlp=tensor, heads=tensor, kv_heads=tensor, vocab=tensor, fusion=tensor"

Rules = dict[str, tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class ActivationLayout:
    activations: NamedSharding  # (B, T, D) at block boundaries: batch-split, features replicated
    embedding_table: NamedSharding  # the (V, D) table as used by the token lookup
    # Where an attention kernel's shard_map splits its inputs: rows over the batch axes, heads
    # over the heads' axes (each device attends its own rows and heads).
    heads_BTNH: NamedSharding
    kv_heads_BTGH: NamedSharding
    rows_BT: NamedSharding


def mesh_shape(mesh_cfg: ml_collections.ConfigDict, num_devices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ICI sizes, DCN sizes) per mesh axis, with -1 resolved; ConfigError if they cannot fit."""
    ici = [int(mesh_cfg[a]) for a in MESH_AXES]
    dcn = [int(mesh_cfg[f"dcn_{a}"]) for a in MESH_AXES]
    if any(d < 1 for d in dcn):
        raise ConfigError(f"mesh.dcn_* sizes {dict(zip(MESH_AXES, dcn))} must be >= 1 (1 = not split across slices)")
    if any(s == 0 or s < -1 for s in ici):
        raise ConfigError(f"mesh sizes {dict(zip(MESH_AXES, ici))} must be positive or -1 (fill the rest)")
    if ici.count(-1) > 1:
        raise ConfigError(
            f"mesh sizes {dict(zip(MESH_AXES, ici))} have more than one -1; only one axis can fill the rest"
        )
    slices = math.prod(dcn)
    if num_devices % slices:
        raise ConfigError(
            f"mesh.dcn_* sizes multiply to {slices} slices, which does not divide the {num_devices} devices; "
            "set mesh.dcn_data (etc.) to the number of slices"
        )
    per_slice = num_devices // slices
    if -1 in ici:
        known = math.prod(s for s in ici if s != -1)
        if per_slice % known:
            raise ConfigError(
                f"mesh sizes {dict(zip(MESH_AXES, ici))} cannot fill {per_slice} devices per slice: "
                f"{known} does not divide {per_slice}; change the fixed sizes"
            )
        ici[ici.index(-1)] = per_slice // known
    if math.prod(ici) != per_slice:
        sizes = "×".join(str(s) for s in ici)
        raise ConfigError(
            f"mesh sizes data×fsdp×tensor = {sizes} = {math.prod(ici)} do not multiply to the {per_slice} devices "
            f"per slice; set one of mesh.data/fsdp/tensor to -1 to fill the rest, or change the sizes"
        )
    return tuple(ici), tuple(dcn)


def make_mesh(mesh_cfg: ml_collections.ConfigDict, devices: Sequence[Any] | None = None) -> Mesh:
    """The device mesh (axis types Auto, so the model's gathers need no explicit shardings)."""
    devices = list(jax.devices() if devices is None else devices)
    ici, dcn = mesh_shape(mesh_cfg, len(devices))
    if devices[0].platform != "tpu":
        if math.prod(dcn) > 1:
            return Mesh(mesh_utils.create_hybrid_device_mesh(ici, dcn, devices), MESH_AXES)
        return Mesh(np.asarray(devices).reshape(ici), MESH_AXES)
    return Mesh(tpu_device_array(ici, dcn, devices), MESH_AXES)


def tpu_device_array(ici: tuple[int, ...], dcn: tuple[int, ...], devices: list[Any]) -> np.ndarray:
    """TPU devices laid out along the torus: each mesh axis on whole physical axes where it can
    be, else on a split physical axis (e.g. data=8 × fsdp=8 on a 4×4×4 v5p slice, where 8 is no
    product of whole axes); a ConfigError naming sizes that map when neither can."""

    def build(split: bool) -> np.ndarray:
        if math.prod(dcn) > 1:
            return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=split)
        return mesh_utils.create_device_mesh(ici, devices, allow_split_physical_axes=split)

    try:
        return build(split=False)
    except (NotImplementedError, ValueError, AssertionError):
        pass
    try:
        return build(split=True)
    except (NotImplementedError, ValueError, AssertionError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        physical = "×".join(str(n) for n in _physical_shape(devices, dcn))
        raise ConfigError(
            f"mesh data×fsdp×tensor = {'×'.join(map(str, ici))} per slice cannot be laid out on the {physical} TPU "
            f"torus ({reason}); give each mesh axis a product of the torus' axis sizes, e.g. "
            f"{_suggestion(_physical_shape(devices, dcn))}"
        ) from None


def _physical_shape(devices: list[Any], dcn: tuple[int, ...]) -> list[int]:
    """The torus of one slice (chips along x, y, z; × cores per chip where there are several)."""
    per_slice = devices[: len(devices) // math.prod(dcn)]
    shape = [len({d.coords[i] for d in per_slice}) for i in range(3)]
    cores = len(per_slice) // math.prod(shape)
    return [n for n in shape if n > 1] + ([cores] if cores > 1 else []) or [1]


def _suggestion(physical: list[int]) -> str:
    """Mesh sizes that map onto the torus: fsdp along its last axis, data along the rest."""
    fsdp = physical[-1]
    return f"--config.mesh.data=-1 --config.mesh.fsdp={fsdp} --config.mesh.tensor=1"


def parse_rules(text: str, field: str = "sharding.rules") -> Rules:
    """`"logical=axis+axis, …"` → {logical: (mesh axes)}; unknown names or repeats are errors."""
    rules: Rules = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        logical, sep, target = (s.strip() for s in item.partition("="))
        if not sep:
            raise ConfigError(f"{field}: rule {item!r} is not 'logical=mesh_axis' (e.g. 'mlp=tensor')")
        if logical not in LOGICAL_AXES:
            raise ConfigError(f"{field}: {logical!r} is not a logical axis; known: {', '.join(LOGICAL_AXES)}")
        if logical in rules:
            raise ConfigError(f"{field}: {logical!r} has two rules; give each logical axis one rule")
        axes = tuple(a.strip() for a in target.split("+") if a.strip() and a.strip() != "none")
        for axis in axes:
            if axis not in MESH_AXES:
                raise ConfigError(f"{field}: {logical}={target} names unknown mesh axis {axis!r}; use {MESH_AXES}")
        if len(set(axes)) != len(axes):
            raise ConfigError(f"{field}: {logical}={target} repeats a mesh axis")
        rules[logical] = axes
    return rules


def logical_to_spec(logical_axes: Sequence[str | None], rules: Rules, what: str = "") -> P:
    """PartitionSpec for a tensor with the given logical axes; a mesh axis may be used once."""
    spec, used = [], []
    for name in logical_axes:
        axes = rules.get(name, ()) if name else ()
        used += axes
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    if len(set(used)) != len(used):
        raise ConfigError(
            f"sharding.rules conflict for {what or 'a tensor'} with logical axes {tuple(logical_axes)}: mesh axis "
            f"used twice ({used}); map those logical axes to different mesh axes"
        )
    return P(*spec)


def param_shardings(abstract_params: nnx.State, mesh: Mesh, rules: Rules) -> Any:
    """A NamedSharding per parameter, from its logical axis names; checks divisibility."""

    def sharding_of(path: tuple, var: Any) -> Any:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        logical = var.get_metadata()["out_sharding"]
        spec = logical_to_spec(logical, rules, what=f"parameter {name}")
        shape = var.get_value().shape
        for dim, axes, lname in zip(shape, spec, logical):
            axes = (axes,) if isinstance(axes, str) else axes or ()
            shards = math.prod(mesh.shape[a] for a in axes)
            if dim % shards:
                raise ConfigError(
                    f"parameter {name} has {lname}={dim}, not divisible by its {shards} shards over {axes}; "
                    f"change the model size or sharding.rules for {lname!r}"
                )
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(sharding_of, abstract_params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Sharding of (B, T) data arrays: rows over the mesh axes of the `batch` rule."""
    return NamedSharding(mesh, logical_to_spec((BATCH_AXIS, None), rules))


def activation_layout(mesh: Mesh, rules: Rules) -> ActivationLayout:
    """Where the model keeps activations, for the model to constrain them while tracing."""
    return ActivationLayout(
        activations=NamedSharding(mesh, logical_to_spec((BATCH_AXIS, None, None), rules)),
        # The lookup gathers rows of a table whose `embed` dim is FSDP-sharded; gathered rows split
        # on `embed` cannot be re-split by batch efficiently (XLA falls back to replicating), so
        # gather the table along `embed` first, as FSDP does for every weight it uses.
        embedding_table=NamedSharding(mesh, logical_to_spec(("vocab", None), rules)),
        heads_BTNH=NamedSharding(mesh, logical_to_spec((BATCH_AXIS, None, "heads", None), rules)),
        kv_heads_BTGH=NamedSharding(mesh, logical_to_spec((BATCH_AXIS, None, "kv_heads", None), rules)),
        rows_BT=NamedSharding(mesh, logical_to_spec((BATCH_AXIS, None), rules)),
    )


def data_parallel_size(mesh: Mesh, rules: Rules) -> int:
    return math.prod(mesh.shape[a] for a in rules.get(BATCH_AXIS, ()))


def process_rows(sharding: NamedSharding, global_batch_size: int) -> np.ndarray:
    """Rows of the global batch held by this process's devices (what this process must load)."""
    index_map = sharding.addressable_devices_indices_map((global_batch_size, 1))
    rows = set()
    for index in index_map.values():
        rows.update(range(global_batch_size)[index[0]])
    return np.array(sorted(rows), dtype=np.int64)


def global_batch(local_rows: dict[str, np.ndarray], sharding: NamedSharding, global_batch_size: int) -> dict[str, Any]:
    """Assemble global arrays from this process's rows (the rows given by `process_rows`)."""
    return {
        key: jax.make_array_from_process_local_data(sharding, rows, (global_batch_size, *rows.shape[1:]))
        for key, rows in local_rows.items()
    }


def per_device_bytes(abstract_tree: Any, shardings: Any) -> int:
    """Bytes one device holds of a tree of abstract arrays under the given shardings."""
    total = 0
    for leaf, sh in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
        total += math.prod(sh.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
    return total
