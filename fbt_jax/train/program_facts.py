"""What a compiled program holds, read from its HLO: the attention kernel's calls, any (T, T) buffer,
the collectives of one step, and the compiler's out-of-memory verdict.

The dry run reports these for programs compiled for a TPU slice or a GPU node (`fbt_jax.targets`):
evidence that a Pallas kernel was lowered (a Mosaic or Triton custom call in the program) rather
than emulated, and what one step sends over the chips' links (ICI) and between slices (DCN; XLA:TPU
lowers those to the megascale runtime's transfers). Collectives inside loops (the layer scan, the
microbatch loop) count once per iteration: each loop's trip count is read from its condition.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# Custom-call targets of the kernels: Mosaic (Pallas TPU), Triton (Pallas GPU), cuDNN's attention.
KERNEL_TARGETS = (("tpu_custom_call", "Mosaic"), ("__gpu$xla.gpu.triton", "Triton"), ("__cudnn$fmha", "cuDNN"))
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4}
DTYPE_BYTES |= {"u32": 4, "f64": 8, "s64": 8, "u64": 8}
SHAPE = re.compile(r"\b(pred|[sufb]f?\d+\w*)\[([\d,]*)\]")
HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = (.*?)\s([a-z][\w\-]*)\((.*)$")
CALLED = re.compile(r"\b(condition|body|calls|to_apply)=%?([\w.\-]+)")
BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
# XLA:TPU's refusal: "RESOURCE_EXHAUSTED: Ran out of memory ... temporaries (20.40G) exceeds available HBM (15.75G)".
REQUIRED = re.compile(r"memory required for HLO temporaries \(([\d.]+)([GMK])\)")


@dataclasses.dataclass
class Traffic:
    count: int = 0
    bytes: float = 0.0


def shapes_bytes(text: str) -> float:
    total = 0.0
    for dtype, dims in SHAPE.findall(text):
        size = DTYPE_BYTES.get(dtype, DTYPE_BYTES.get(dtype[:3], 4))
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


def computations(hlo: str) -> tuple[dict[str, list[str]], str]:
    """Computation name → its instruction lines, and the entry computation's name."""
    comps: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        header = HEADER.match(line)
        if header:
            current = header.group(1)
            comps[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current is not None and line.startswith("  "):
            comps[current].append(line)
    return comps, entry


def trip_count(line: str, comps: dict[str, list[str]]) -> int:
    """How often a while loop runs: its known trip count, else the bound in its condition (the
    counter of a scan starts at 0 and is compared with a constant)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", line)
    bounds = [int(n) for body in comps.get(condition.group(1) if condition else "", []) for n in _int_constants(body)]
    return max(bounds, default=1)


def _int_constants(line: str) -> list[str]:
    return re.findall(r"= s(?:32|64)\[\][^ ]* constant\((\d+)\)", line)


def multiplicities(comps: dict[str, list[str]], entry: str) -> dict[str, int]:
    """How often each computation runs in one execution of the entry computation."""
    calls: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)  # caller → (callee, times)
    for name, lines in comps.items():
        for line in lines:
            found = INSTRUCTION.match(line)
            loop = trip_count(line, comps) if found and found.group(2) == "while" else 1
            for role, callee in CALLED.findall(line):
                calls[name].append((callee, loop if role == "body" else 1))
            for branches in BRANCHES.findall(line):
                calls[name] += [(b.strip().lstrip("%"), 1) for b in branches.split(",") if b.strip()]
    times: dict[str, int] = collections.Counter()

    def visit(name: str, factor: int) -> None:
        times[name] += factor
        for callee, n in calls.get(name, ()):
            visit(callee, factor * n)

    visit(entry, 1)
    return times


def group_size(line: str) -> int:
    """Devices per replica group: `{{0,1},{2,3}}`, `[2,4]<=[8]` or `mesh['x'=4,'y'=2] {'x'}`."""
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if explicit:
        return len(explicit.group(1).split(","))
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]", line)
    if iota:
        return int(iota.group(1))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
    if mesh:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", mesh.group(1)))
        return math.prod(int(sizes.get(axis, 1)) for axis in re.findall(r"'([^']+)'", mesh.group(2)))
    return 1


def collectives(hlo: str) -> dict[tuple[str, str], Traffic]:
    """(kind, network) → count and bytes per device of one execution. Bytes: what one device's share
    of each collective amounts to (all-gather: the gathered result; reduce-scatter: its input;
    all-reduce, all-to-all, permute: the array), summed over executions."""
    comps, entry = computations(hlo)
    times = multiplicities(comps, entry)
    out: dict[tuple[str, str], Traffic] = collections.defaultdict(Traffic)
    for name, lines in comps.items():
        n = times.get(name, 0)
        if not n:
            continue
        for line in lines:
            found = INSTRUCTION.match(line)
            if not found:
                continue
            result, opcode = found.group(1), found.group(2)
            kind = opcode.removesuffix("-start")
            if kind in COLLECTIVES and not opcode.endswith("-done"):
                if opcode.endswith("-start"):  # an async op's result holds its operand and result: the larger
                    size = max(shapes_bytes(f"{dtype}[{dims}]") for dtype, dims in SHAPE.findall(result))
                else:
                    size = shapes_bytes(result) * (group_size(line) if kind == "reduce-scatter" else 1)
                traffic = out[(kind, "ICI")]
            elif opcode == "send" and "_xla_megascale_transfer_type=" in line:  # across slices
                kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', line).group(1).lower().replace("_", "-")
                size, traffic = shapes_bytes(result.split(", u32[]")[0]), out[(kind, "DCN")]
            else:
                continue
            traffic.count += n
            traffic.bytes += n * size
    return dict(out)


def kernel_calls(hlo: str) -> dict[str, int]:
    """Kernel name → custom calls of it in the program (each call site once)."""
    calls = {name: hlo.count(f'custom_call_target="{target}') for target, name in KERNEL_TARGETS}
    return {name: n for name, n in calls.items() if n}


def square_buffers(hlo: str, seq_len: int, heads: set[int]) -> int:
    """Arrays in the program shaped (rows, …heads…, T, T), `heads` being a head count (query heads,
    kv heads, heads per group, per device): the scores of attention computed whole, which a flash
    kernel never materialises. Rank 4 at least and the head dim tell them from (rows, T, D)
    activations and (2, D, D) weights where the model width D equals T (the 1B config: 2048 both)."""
    count = 0
    for _, dims in SHAPE.findall(hlo):
        shape = [int(d) for d in dims.split(",") if d]
        count += len(shape) >= 4 and shape[-2:] == [seq_len, seq_len] and any(d in heads for d in shape[1:-2])
    return count


def out_of_memory(error: BaseException) -> tuple[str, float] | None:
    """The compiler's refusal of a program that does not fit: (its one line, GiB of temporaries it
    required), or None when `error` is not one."""
    text = str(error).strip()
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    line = next((ln.strip() for ln in text.splitlines() if "memory" in ln.lower()), text.splitlines()[0])
    required = REQUIRED.search(text)
    scale = {"G": 1.0, "M": 2**-10, "K": 2**-20}
    return line[:300], float(required.group(1)) * scale[required.group(2)] if required else 0.0


def describe_collectives(traffic: dict[tuple[str, str], Traffic], platform: str = "tpu") -> str:
    """ "ICI: all-gather 38× 1.20 GiB, …; DCN: …" (within a GPU node the links are NVLink's)."""
    if not traffic:
        return "none"
    parts = []
    for network in ("ICI", "DCN"):
        items = sorted((k, t) for (k, net), t in traffic.items() if net == network)
        if items:
            text = ", ".join(f"{kind} {t.count}× {_size(t.bytes)}" for kind, t in items)
            parts.append(f"{'NVLink' if network == 'ICI' and platform == 'gpu' else network}: {text}")
    return "; ".join(parts)


def _size(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.0f} KiB" if n >= 2**10 else f"{n:.0f} B"
