"""The devices a program is compiled for: a TPU slice or a GPU node named by its topology, from any
machine (the dry run's `dry_run_topology`).

libtpu (TPU) and jax's CUDA plugin (GPU) hand out compile-only devices for a topology: no chip is
needed, and compiling for them runs the real compiler (XLA:TPU with Mosaic for Pallas TPU kernels;
XLA:GPU with Triton and cuDNN), with its own memory analysis and its own out-of-memory verdict.
The HBM a program may use is the compiler's own figure where it states one (XLA:TPU refuses a
program that does not fit and names the memory available), else the device description's.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.resources
import os
import re
from typing import Any

from fbt_jax import hardware
from fbt_jax.errors import ConfigError

TPU_CHIPS = ("v4", "v5e", "v5p", "v6e")
MEGACORE = ("v4", "v5p")
TPU_FORM = re.compile(r"^(v4|v5e|v5p|v6e):\d+x\d+(x\d+)?$")
TPU_EXAMPLES = "v5e:8x8, v5p:4x4x4, v6e:16x16, v4:2x2x2"
INSTALL_TPU = "pip install 'fbt-jax[tpu]'"
# XLA's published device descriptions (xla/tools/hlo_opt/gpu_specs), shipped as data: GPU name →
# file under fbt_jax/gpu_specs/.
# (H200: XLA publishes none; its file is the H100's with the H200's memory, as it says.)
GPU_SPECS = {"a100": "a100_sxm_80.txtpb", "h100": "h100_sxm.txtpb", "h200": "h200_sxm.txtpb"}
GPU_FORM = re.compile(r"^(a100|h100|h200):(\d+)$")
INSTALL_GPU = "pip install 'fbt-jax[cuda]'"
# XLA:TPU's refusal: "... HLO temporaries (20.40G) exceeds available HBM (15.75G)" (G: GiB).
AVAILABLE_HBM = re.compile(r"exceeds available HBM \(([\d.]+)G\)")


@dataclasses.dataclass(frozen=True)
class Target:
    """Compile-only devices and what their compiler says about them."""

    name: str  # as the user gave it: "v5e:8x8", "h100:8"
    devices: list[Any]
    compiler: str  # "TPU compiler (libtpu 0.0.42.1)"
    hbm_bytes: float  # per device, available to a program
    hbm_source: str  # where that figure comes from
    num_slices: int = 1

    @property
    def platform(self) -> str:
        return self.devices[0].platform

    def describe(self) -> str:
        slices = f" × {self.num_slices} slices" if self.num_slices > 1 else ""
        return (
            f"{self.compiler}, topology {self.name}{slices}, {len(self.devices)} × {self.devices[0].device_kind}, "
            f"{self.hbm_bytes / 2**30:.2f} GiB HBM per device ({self.hbm_source})"
        )


def target(name: str, num_slices: int = 1) -> Target:
    """The TPU slice (`v5e:8x8`) or GPU node (`h100:8`) `name`, `num_slices` times; a one-line
    ConfigError for an unknown form, a topology the compiler rejects, or a compiler not installed."""
    if num_slices < 1:
        raise ConfigError(f"dry_run_num_slices={num_slices} must be at least 1")
    if GPU_FORM.match(name.lower()):
        if num_slices > 1:
            raise ConfigError("dry_run_num_slices applies to TPU slices; a GPU node is one slice")
        return gpu_target(name.lower())
    return tpu_target(name, num_slices)


def tpu_target(topology: str, num_slices: int = 1) -> Target:
    if not TPU_FORM.match(topology):
        raise ConfigError(
            f"dry_run_topology={topology!r} is not a TPU topology or GPU node; use CHIP:AxB or CHIP:AxBxC with CHIP "
            f"one of {', '.join(TPU_CHIPS)} (e.g. {TPU_EXAMPLES}), or GPU:COUNT with GPU one of "
            f"{', '.join(GPU_SPECS)} (e.g. h100:8)"
        )
    version = _installed("libtpu")
    if version is None:
        raise ConfigError(
            f"dry_run_topology={topology!r} compiles with the TPU compiler (libtpu), which is not installed; "
            f"{INSTALL_TPU} brings the version that matches jax"
        )
    # libtpu reads the host's TPU metadata when it loads, and on a machine that is not a TPU VM
    # writes its warnings into the environment (TPU_WORKER_ID="WARNING: could not determine…"),
    # where every later command of this process would read them. Only compile-only devices are
    # made here: give it what it asks for, and put the environment back afterwards.
    saved = dict(os.environ)
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    # libtpu takes a machine-wide lock for the chips it drives; compiling drives none, and two dry
    # runs (or test workers) at once must not refuse each other.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    # v4 and v5p run as one device per chip ("megacore", as jax does on those VMs); v5e and v6e
    # chips have one core.
    extra = {"chip_config_name": "megacore"} if topology.split(":")[0] in MEGACORE else {}
    extra |= {"num_slices": num_slices} if num_slices > 1 else {}
    try:
        devices = list(topologies.get_topology_desc(platform="tpu", topology_name=topology, **extra).devices)
        hbm = available_hbm_bytes(devices[0])  # the first compile: libtpu's compiler starts here
    except Exception as e:  # libtpu's INVALID_ARGUMENT: the shape is not one it builds
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"dry_run_topology={topology!r}: the TPU compiler rejects it ({reason}); use a slice shape of that chip, "
            f"e.g. {TPU_EXAMPLES}"
        ) from None
    finally:
        restore_environment(saved)
    source = "available to programs, the compiler's figure"
    if hbm is None:  # a libtpu that words its refusal otherwise: the chip's nominal memory
        hbm, source = hardware.hbm_gib_of_kind(devices[0].device_kind) * 2**30, "the chip's nominal memory"
    return Target(topology, devices, f"TPU compiler (libtpu {version})", hbm, source, num_slices)


def gpu_target(name: str) -> Target:
    match = GPU_FORM.match(name)
    assert match is not None
    gpu, count = match.group(1), int(match.group(2))
    version = _installed("jax-cuda12-plugin") or _installed("jax-cuda13-plugin")
    if version is None:
        raise ConfigError(
            f"dry_run_topology={name!r} compiles with the GPU compiler of jax's CUDA plugin, which is not installed; "
            f"{INSTALL_GPU} (no GPU or driver needed to compile)"
        )
    if count < 1:
        raise ConfigError(f"dry_run_topology={name!r}: a node has at least one GPU (e.g. {gpu}:8)")
    spec = importlib.resources.files("fbt_jax").joinpath("gpu_specs", GPU_SPECS[gpu]).read_text()
    from jax.experimental import topologies

    try:
        devices = list(
            topologies.get_topology_desc("topo", "cuda", target_config=spec, topology=f"1x1x{count}").devices
        )
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"dry_run_topology={name!r}: the GPU compiler rejects it ({reason})") from None
    memory = re.search(r"device_memory_size:\s*(\d+)", spec)
    total = float(memory.group(1)) if memory else hardware.chip_hbm_gib(gpu) * 2**30
    # jax preallocates this fraction of a GPU's memory and gives programs nothing beyond it.
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    source = f"{fraction:.0%} of the {total / 2**30:.2f} GiB of XLA's device description: jax's XLA_PYTHON_CLIENT_MEM_FRACTION"
    return Target(name, devices, f"GPU compiler (jax CUDA plugin {version})", total * fraction, source)


def available_hbm_bytes(device: Any) -> float | None:
    """The HBM a program may use on `device`, as XLA:TPU states it when refusing a program that
    cannot fit (a 256 GiB argument: refused in milliseconds, nothing allocated)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sharding = NamedSharding(Mesh(np.array([device]), ("one",)), PartitionSpec())
    try:
        jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((2**36,), jnp.float32, sharding=sharding)).compile()
    except Exception as e:
        found = AVAILABLE_HBM.search(str(e))
        return float(found.group(1)) * 2**30 if found else None
    return None


def restore_environment(saved: dict[str, str]) -> None:
    """The process environment back to `saved`, also what libtpu set from C (setenv), which
    os.environ does not see but every command this process starts would inherit."""
    import ctypes

    environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    names, i = [], 0
    while environ[i]:
        names.append(environ[i].split(b"=", 1)[0].decode(errors="replace"))
        i += 1
    for name in names:
        if name not in saved:
            os.unsetenv(name)
    os.environ.clear()
    os.environ.update(saved)


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
