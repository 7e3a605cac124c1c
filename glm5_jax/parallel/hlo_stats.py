"""Per-device matmul FLOPs, HBM bytes and collective traffic read off a compiled executable's HLO text, with
every op counted as many times as it runs.

XLA's `cost_analysis()` visits a while loop's body once, so the layer stack under `lax.scan` (and the MTP depth
loop) would be counted as one layer, and for GPU executables it reports no FLOPs at all. Here the text is
walked from ENTRY through the computations each instruction calls (fusions, calls, conditionals, while
bodies), multiplying a while body by its trip count when the loop condition compares the counter with a
constant (the form `lax.scan` and `fori_loop` with static bounds compile to); loops with data-dependent
bounds (the MoE's loop over used blocks) count once and are reported. A conditional counts its costliest
branch.

Counted:
- Matmul FLOPs: `dot` and `convolution` ops wherever they sit (inside fusions too; XLA:TPU writes matmuls as
  convolutions, XLA:GPU as dots inside Triton gemm fusions), XLA:TPU's grouped-matmul custom calls
  (`ragged-dot`) and cuBLAS gemm custom calls: 2 x output elements x contracted size. Pallas kernels count
  what they declare: a Mosaic TPU kernel's `pl.CostEstimate` travels in its backend_config; jax's Triton
  lowering drops the estimate, so a Triton kernel declares it as frontend attributes
  (`pallas_kernels.kernel_cost.declared_cost`). A kernel that
  declares nothing is listed by name in `kernels_without_cost`, never counted as zero work silently. All
  FLOPs are attributed to the JAX operation they came from (`op_name` metadata).
- HBM bytes: for every op executed at the level of ENTRY, while bodies, conditional branches and calls (not
  the ops inside a fusion, which stay on chip), the bytes of its operands and outputs. Two refinements follow
  XLA's cost analysis: a slice, dynamic slice, async `slice-start` (XLA:TPU's sliced prefetch into VMEM reads a
  buffer in slices, each one a slice-start) or fusion parameter only sliced reads the slice, and a dynamic
  update slice (or a fusion whose root is one) reads and writes the update, not the buffer it updates in
  place; a ragged all-to-all reads what it sends and writes its result, not reading the output buffer it
  updates in place. Arrays count as stored: padded to their layout's tiles (XLA:TPU's `T(8,128)`), and not at
  all when the layout puts them in on-chip memory (`S(1)`: a weight prefetched into VMEM is read from HBM once, by its
  copy). A kernel with a declared cost counts its declared bytes. Not counted: tuples, get-tuple-element,
  bitcasts, parameters and constants (no data moves), the while condition, and caches (every other access
  is taken to reach HBM, so this is an upper bound on a fusion's traffic, like XLA's own figure). Against
  `cost_analysis()["bytes accessed"]` of loop-free modules: XLA:CPU's figure exactly; XLA:TPU's exactly for
  streaming fusions, while for matmuls, reductions and gathers XLA:TPU also counts on-chip reads and the
  re-reads of its tiling (this counter gives 0.2-0.7 of its figure there: the compulsory HBM traffic).
- Collective bytes: what each device sends in a ring algorithm: all-gather (n-1)/n x result, reduce-scatter
  (n-1)/n x operand, all-reduce 2 (n-1)/n x size, all-to-all and ragged all-to-all (n-1)/n x operand (the
  ragged one's whole send buffer: an upper bound), collective-permute the operand; by kind, by source, and by
  link: a replica group whose devices sit on more than one node (given `node_of_device`) is inter-node.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

# Frontend attributes a kernel without a backend-config cost declares its cost with (flops, bytes, transcendentals).
from pallas_kernels.kernel_cost import KERNEL_COST_ATTRIBUTES

DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
               "f64": 8, "c64": 8, "c128": 16}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
               "ragged-all-to-all")
# custom_call_target of Pallas kernels: Mosaic TPU, Triton GPU (XLA's and jaxlib's), Mosaic GPU.
KERNEL_TARGETS = ("tpu_custom_call", "__gpu$xla.gpu.triton", "triton_kernel_call", "mosaic_gpu", "mosaic_gpu_v2")
INTRA_NODE, INTER_NODE = "intra-node", "inter-node"
COMBINED_NAMES_SHOWN = 3  # sources named for an op XLA combined from several

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\](?:\{([^{}]*)\})?")  # dtype, dims, layout
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|branch_computations)=(\{[%\w.\-, ]*\}|%?[\w.\-]+)")
# Ops that move no data themselves (their callees, if any, are walked).
_NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
               "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
               "async-start", "async-update", "async-done", "copy-done"}
# Callees that run as programs of their own (their ops touch HBM), as opposed to fused or scalar computations.
_PROGRAM_CALLEES = {("while", "body"), ("conditional", "branch_computations"), ("call", "to_apply"),
                    ("call", "calls"), ("async-start", "calls")}


class HloParseError(ValueError):
    """The HLO text does not have the structure this reader expects."""


def _tiled(dims: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """Dims as stored: in layout order (major to minor), the minor ones rounded up to the layout's first tile
    (XLA:TPU's `T(8,128)`: a bf16[64, 16] array takes the HBM of a [64, 128] one)."""
    order, _, tiling = layout.partition(":")
    tile = re.match(r"T\(([\d,]+)\)", tiling)
    if not tile or not dims:
        return dims
    physical = [dims[int(axis)] for axis in reversed(order.split(",")) if axis]
    for j, size in enumerate(reversed([int(t) for t in tile.group(1).split(",")][-len(physical):]), start=1):
        physical[-j] = -(-physical[-j] // size) * size
    return tuple(physical)


@functools.lru_cache(maxsize=1 << 16)  # a module repeats a few thousand types over ~10^5 instructions
def _arrays(type_text: str, stored: bool = False) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(dtype, dims) of every array in a (possibly tuple) HLO type: logical dims, or with `stored` the dims its
    layout's tiling pads them to, leaving out arrays in on-chip memory (a layout's `S(n)`, n > 0: XLA:TPU's
    VMEM and SMEM)."""
    out = []
    for dtype, dims_text, layout in _ARRAY.findall(type_text):
        if stored and re.search(r"S\([1-9]\d*\)", layout):
            continue
        if dtype in DTYPE_BYTES:
            dims = tuple(int(d) for d in dims_text.split(",") if d)
            out.append((dtype, _tiled(dims, layout) if stored and layout else dims))
    return tuple(out)


def _bytes(arrays) -> int:
    return sum(DTYPE_BYTES[dtype] * math.prod(dims) for dtype, dims in arrays)


def _tuple_elements(type_text: str) -> list[str]:
    """The top-level elements of a tuple type `(a, (b, c), d)`."""
    inner, parts, depth, start = type_text.strip()[1:-1], [], 0, 0
    for i, char in enumerate(inner):
        depth += (char in "([{") - (char in ")]}")
        if char == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    return parts + [inner[start:].strip()]


def _slice_traffic(result_type: str) -> int:
    """HBM bytes of a slice with result `result_type`: its part of the operand read (as stored in HBM) and the
    result written where its layout puts it (nothing to HBM when that is on chip, `S(n)`)."""
    read = _arrays(re.sub(r"S\(\d+\)", "", result_type), stored=True)
    return _bytes(read) + _bytes(_arrays(result_type, stored=True))


@dataclasses.dataclass
class _Instruction:
    name: str
    type_text: str
    op: str
    rest: str


@dataclasses.dataclass
class _Computation:
    name: str
    shapes: dict  # instruction / parameter name -> list of arrays
    stored: dict  # the same with the dims their layouts pad them to in memory
    instructions: list
    root: str = ""
    traffic: float | None = None  # HBM bytes of a fusion calling this computation, once computed


def parse_computations(text: str) -> tuple[dict[str, _Computation], str]:
    computations, entry, current = {}, None, None
    # XLA prints some backend configs as multi-line JSON (a Mosaic kernel's cost_estimate, seen on v6e): a line that
    # ends by opening a brace inside a backend config goes on over the next lines until that brace closes. Only the
    # braces from there on count: a Triton kernel's one-line config may hold unbalanced ones in its strings.
    open_braces = 0
    for line in text.splitlines():
        if open_braces > 0 and current is not None and current.instructions:
            last = current.instructions[-1]
            current.instructions[-1] = dataclasses.replace(last, rest=last.rest + " " + line.strip())
            open_braces += line.count("{") - line.count("}")
            continue
        open_braces = 0
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = _Computation(header.group(2), {}, {}, [])
            computations[current.name] = current
            if header.group(1):
                entry = current.name
            for param in re.finditer(r"([\w.\-]+):\s*((?:\([^)]*\))|(?:[a-z]\w*\[[\d,]*\]))", header.group(3)):
                current.shapes[param.group(1)] = current.stored[param.group(1)] = _arrays(param.group(2))
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTR.match(line)
        if match:
            root, name, type_text, op, rest = match.groups()
            current.shapes[name] = _arrays(type_text)
            current.stored[name] = _arrays(type_text, stored=True)
            current.instructions.append(_Instruction(name, type_text, op, rest))
            if root:
                current.root = name
            if "backend_config=" in rest and rest.rstrip().endswith("{"):
                open_braces = 1
    if entry is None:
        raise HloParseError("no ENTRY computation in the HLO text")
    return computations, entry


def result_shapes(text: str, op: str) -> list[tuple[int, ...]]:
    """The result shape of every `op` instruction in HLO text, e.g. the all-gathers of a compiled step; an
    async `-start` form, whose result is the tuple (operand, result), gives its largest array."""
    computations, _ = parse_computations(text)
    return [max((dims for _, dims in arrays), key=math.prod) for comp in computations.values()
            for inst in comp.instructions if inst.op in (op, op + "-start") and (arrays := _arrays(inst.type_text))]


_OPERAND = re.compile(r"%([\w.\-]+)")


def _operand_names(rest: str) -> list[str]:
    return _OPERAND.findall(rest.split(")", 1)[0])


def _dims(rest: str, key: str) -> list[int]:
    match = re.search(key + r"=\{([\d,]*)\}", rest)
    return [int(d) for d in match.group(1).split(",") if d] if match else []


def _matmul_flops(inst: _Instruction, comp: _Computation) -> float:
    out = _arrays(inst.type_text)
    if not out:
        return 0.0
    out_elements = math.prod(out[0][1])
    operands = _operand_names(inst.rest)
    lhs = comp.shapes.get(operands[0]) if operands else None
    rhs = comp.shapes.get(operands[1]) if len(operands) > 1 else None
    if inst.op == "dot":
        if not lhs:
            return 0.0
        contracted = math.prod(lhs[0][1][d] for d in _dims(inst.rest, "lhs_contracting_dims"))
        return 2.0 * out_elements * contracted
    # convolution: per output element, the kernel's input features x the window taps that land on input
    # elements (not on padding or on the holes of lhs dilation), counted exactly per spatial dim. XLA:TPU writes
    # batched matmuls as convolutions whose extra dims are spatial: a batch dim as window = lhs_dilate = batch
    # (one tap per output), a weight's free dim as a window over an input of size 1 padded by window - 1 on
    # both sides (again one tap per output, where counting the window would multiply by its size).
    labels = re.search(r"dim_labels=([^_]+)_([^-]+)->(\w+)", inst.rest)
    if not lhs or not rhs or not labels:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    features = math.prod(size for letter, size in zip(rhs_labels, rhs[0][1]) if letter == "i")
    spatial = sorted(letter for letter in out_labels if letter.isdigit())
    window = _window(inst.rest, len(spatial))
    out_dims, lhs_dims = out[0][1], lhs[0][1]
    per_output_position = out_elements
    landed = 1
    for index, letter in enumerate(spatial):
        out_size = out_dims[out_labels.index(letter)]
        per_output_position //= max(out_size, 1)
        landed *= _landed_taps(lhs_dims[lhs_labels.index(letter)], out_size,
                               *(attribute[index] for attribute in window))
    return 2.0 * per_output_position * features * landed


def _window(rest: str, rank: int) -> list[list[int]]:
    """[size, stride, pad_low, lhs_dilate, rhs_dilate] per spatial dim of a convolution's window."""
    text = re.search(r"window=\{([^}]*)\}", rest)
    text = text.group(1) if text else ""

    def field(name: str, default: int) -> list[int]:
        match = re.search(rf"\b{name}=([\d_x-]+)", text)
        if not match:
            return [default] * rank
        return [int(part.split("_")[0]) for part in match.group(1).split("x")]

    return [field("size", 1), field("stride", 1), field("pad", 0), field("lhs_dilate", 1), field("rhs_dilate", 1)]


def _landed_taps(in_size: int, out_size: int, size: int, stride: int, pad_low: int, lhs_dilate: int,
                 rhs_dilate: int) -> int:
    """(output position, window tap) pairs of one spatial dim whose tap reads an input element: position
    o * stride + k * rhs_dilate - pad_low must lie on the dilated input, 0 .. (in_size - 1) * lhs_dilate, at a
    multiple of lhs_dilate."""
    last = (in_size - 1) * lhs_dilate
    pairs = 0
    for tap in range(size):
        offset = tap * rhs_dilate - pad_low
        first_o = max(0, -(offset // stride))  # ceil(-offset / stride)
        last_o = min(out_size - 1, (last - offset) // stride)
        if last_o < first_o:
            continue
        if lhs_dilate == 1:
            pairs += last_o - first_o + 1
            continue
        for residue in range(lhs_dilate):  # o = residue (mod lhs_dilate) lands on an element or never does
            if (residue * stride + offset) % lhs_dilate == 0:
                start = first_o + (residue - first_o) % lhs_dilate
                if start <= last_o:
                    pairs += (last_o - start) // lhs_dilate + 1
    return pairs


def _ragged_dot_flops(inst: _Instruction, comp: _Computation) -> float:
    """XLA:TPU's grouped matmul (a custom call after its int32 group metadata): every output row contracts the
    lhs's last dim once; the lhs is the first floating-point operand."""
    out = _arrays(inst.type_text)
    operands = [comp.shapes.get(name) for name in _operand_names(inst.rest)]
    lhs = next((shape[0] for shape in operands if shape and shape[0][0] in ("bf16", "f16", "f32", "f64")), None)
    if not out or lhs is None:
        return 0.0
    return 2.0 * math.prod(out[0][1]) * lhs[1][-1]


def _cublas_flops(inst: _Instruction, comp: _Computation) -> float:
    """cuBLAS gemm custom call: its dot dimension numbers sit in the backend_config."""
    out = _arrays(inst.type_text)
    operands = _operand_names(inst.rest)
    lhs = comp.shapes.get(operands[0]) if operands else None
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.rest)
    if not out or not lhs or not contracting:
        return 0.0
    dims = [int(d.strip('" ')) for d in contracting.group(1).split(",") if d.strip('" ')]
    return 2.0 * math.prod(out[0][1]) * math.prod(lhs[0][1][d] for d in dims)


def _custom_call_target(inst: _Instruction) -> str:
    match = re.search(r'custom_call_target="([^"]*)"', inst.rest)
    return match.group(1) if match else ""


def _kernel_cost(inst: _Instruction) -> tuple[float, float] | None:
    """(flops, bytes accessed) a Pallas kernel declared, or None when it declared none. The cost its caller
    declared (frontend attributes: a Triton kernel's, or a wrapper's around a kernel it does not own, such as
    jax's flash attention) comes before the Mosaic kernel's own `pl.CostEstimate`."""
    flops_key, bytes_key, _ = KERNEL_COST_ATTRIBUTES
    flops = re.search(flops_key + r'="?(\d+)', inst.rest)
    accessed = re.search(bytes_key + r'="?(\d+)', inst.rest)
    if flops or accessed:
        return float(flops.group(1)) if flops else 0.0, float(accessed.group(1)) if accessed else 0.0
    mosaic = re.search(r'"cost_estimate":\s*\{([^{}]*)\}', inst.rest)
    if mosaic:
        values = dict(re.findall(r'"(\w+)":\s*"?(\d+)', mosaic.group(1)))
        return float(values.get("flops", 0)), float(values.get("bytes_accessed", 0))
    return None


def _kernel_name(inst: _Instruction) -> str:
    """The kernel's own name: Triton's backend_config carries it; Mosaic names the instruction after it."""
    named = re.search(r'\bname = "([^"]*)"', inst.rest)
    return named.group(1) if named else re.sub(r"\.\d+$", "", inst.name)


def _replica_groups(rest: str, num_devices: int) -> list[list[int]] | None:
    """Device ids of each replica group (source/target pairs for a collective-permute); None for a mesh-axes
    form `_mesh_axis_groups` does not know."""
    pairs = re.search(r"source_target_pairs=\{(\{[\d,{} ]*\})\}", rest)
    if pairs:
        return [[int(v) for v in group.split(",") if v] for group in re.findall(r"\{([\d,]*)\}", pairs.group(1))]
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest)
    if iota:
        shape = [int(v) for v in iota.group(1).split(",")]
        dims = [int(v) for v in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(v) for v in iota.group(3).split(",")])
        return ids.reshape(shape[0], -1).tolist()
    explicit = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest)
    if explicit:
        groups = [[int(v) for v in group.split(",") if v] for group in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
        return groups if groups and groups[0] else [list(range(num_devices))]
    if "replica_groups=mesh" in rest:
        return _mesh_axis_groups(rest)
    return [list(range(num_devices))]


_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\((.+?)\))?\s*\{([^}]*)\}")


def _mesh_axes(named: re.Match) -> tuple[dict[str, int], list[str]]:
    """A `_MESH_GROUPS` match's mesh axes {name: size}, in order, and the axes its groups run along."""
    sizes = {name.strip("' "): int(size) for name, size in (part.split("=") for part in named.group(1).split(","))}
    return sizes, [name.strip("' ") for name in named.group(3).split(",") if name.strip()]


def _iota_ids(text: str | None, count: int) -> np.ndarray | None:
    """The device order of a mesh-axes device list: none given (0..count-1), an iota `[2,8]T(1,0)` (arange
    reshaped, transposed, flattened) or the ids listed; None for a form not known here."""
    if text is None:
        return np.arange(count)
    iota = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    if iota:
        ids = np.arange(count).reshape([int(v) for v in iota.group(1).split(",")])
        return (ids.transpose([int(v) for v in iota.group(2).split(",")]) if iota.group(2) else ids).reshape(-1)
    if re.fullmatch(r"[\d,\s]+", text):
        return np.array([int(v) for v in text.split(",") if v.strip()])
    return None


def _mesh_axis_groups(rest: str) -> list[list[int]] | None:
    """Replica groups XLA writes as mesh axes, `mesh['a'=8,'b'=2], device_ids=([2,8]T(1,0)) {'b'}`: the devices laid
    out on the mesh in `device_ids` order, each group the devices that differ only along the named axes. None
    for a form not known here (sub-axes, say)."""
    named = _MESH_GROUPS.search(rest)
    if not named:
        return None
    sizes, grouped = _mesh_axes(named)
    names, shape = list(sizes), list(sizes.values())
    ids = _iota_ids(named.group(2), math.prod(shape))
    if ids is None or ids.size != math.prod(shape) or not set(grouped) <= set(names):
        return None
    over = [names.index(name) for name in grouped]
    others = [i for i in range(len(shape)) if i not in over]
    return ids.reshape(shape).transpose(others + over).reshape(-1, math.prod(shape[i] for i in over)).tolist()


def _group_size(rest: str, num_devices: int) -> int:
    named = _MESH_GROUPS.search(rest)  # the named axes' sizes, whatever order the devices are in
    if named:
        sizes, grouped = _mesh_axes(named)
        return math.prod(sizes[name] for name in grouped)
    groups = _replica_groups(rest, num_devices)
    return max(1, len(groups[0])) if groups else num_devices


def _sent_bytes(kind: str, inst: _Instruction, comp: _Computation, num_devices: int) -> float:
    operands = [comp.shapes.get(name, []) for name in _operand_names(inst.rest)]
    operand_bytes = _bytes(operands[0]) if kind == "ragged-all-to-all" and operands else \
        sum(_bytes(shape) for shape in operands)
    if kind == "collective-permute":
        return float(operand_bytes)
    n = _group_size(inst.rest, num_devices)
    if n <= 1:
        return 0.0
    if kind == "all-gather":
        # An async start returns (operands, results): the results are what is left after the operands.
        result = _bytes(_arrays(inst.type_text)) - (operand_bytes if inst.op.endswith("-start") else 0)
        return result * (n - 1) / n
    return operand_bytes * (2 if kind == "all-reduce" else 1) * (n - 1) / n


def _link(inst: _Instruction, num_devices: int, node_of_device: Sequence[int] | None) -> str:
    if node_of_device is None:
        return INTRA_NODE
    groups = _replica_groups(inst.rest, num_devices) or [list(range(num_devices))]
    spans = any(len({node_of_device[d] for d in group}) > 1 for group in groups)
    return INTER_NODE if spans else INTRA_NODE


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NO_METADATA = "(no metadata)"  # e.g. a fusion's root: it takes the fusion instruction's source
_WRAPPERS = {"while", "body", "cond", "closed_call", "remat", "rematted_computation", "branch_0_fun", "branch_1_fun"}


def _clean_op_name(op_name: str) -> str:
    parts = [p for p in op_name.split("/")
             if p not in _WRAPPERS and not p.startswith(("jit(", "pjit(", "jvp(", "transpose(", "checkpoint"))]
    return "/".join(parts) or op_name


def _source(inst: _Instruction) -> str:
    """The JAX operation an instruction came from (its `op_name` metadata without jit/transpose wrappers).
    XLA names an op it combined from several `common/scope/(name1:name2:...)`: the first few are kept."""
    match = _OP_NAME.search(inst.rest)
    if not match:
        return _NO_METADATA
    combined = re.fullmatch(r"(?:(.*?)/)?\((.*)\)", match.group(1))
    if not combined:
        return _clean_op_name(match.group(1))
    scope = combined.group(1) + "/" if combined.group(1) else ""
    names = list(dict.fromkeys(_clean_op_name(scope + name) for name in combined.group(2).split(":")))
    more = f" +{len(names) - COMBINED_NAMES_SHOWN} more" if len(names) > COMBINED_NAMES_SHOWN else ""
    return "combined(" + ", ".join(names[:COMBINED_NAMES_SHOWN]) + more + ")"


def _trip_count(condition: _Computation | None) -> int | None:
    """N of `i < N` when the loop condition compares with a constant; None when the bound is dynamic."""
    if condition is None:
        return None
    constants = [int(m) for inst in condition.instructions if inst.op == "constant"
                 for m in re.findall(r"^(-?\d+)\)", inst.rest)]
    # The compare may sit inside a fusion (XLA:CPU wraps it); a bound read from the loop state is dynamic.
    compares = [inst for inst in condition.instructions if inst.op in ("compare", "fusion")]
    if not constants or not compares:
        return None
    return max(constants)


def _users(comp: _Computation, name: str) -> list[_Instruction]:
    """Instructions reading `name`, looking through bitcasts."""
    users = []
    for inst in comp.instructions:
        if name in _operand_names(inst.rest):
            users.extend(_users(comp, inst.name) if inst.op == "bitcast" else [inst])
    return users


def _defining(comp: _Computation, name: str) -> _Instruction | None:
    inst = next((i for i in comp.instructions if i.name == name), None)
    while inst is not None and inst.op == "bitcast":
        inst = next((i for i in comp.instructions if i.name == _operand_names(inst.rest)[0]), None)
    return inst


def _in_place_bytes(comp: _Computation, inst: _Instruction | None, full: int) -> int:
    """Bytes an output really writes: a dynamic update slice writes its update; a tuple, each element's."""
    if inst is None:
        return full
    if inst.op == "dynamic-update-slice":
        return _bytes(comp.stored.get(_operand_names(inst.rest)[1], []))
    if inst.op == "tuple":
        return sum(_in_place_bytes(comp, _defining(comp, name), _bytes(comp.stored.get(name, [])))
                   for name in _operand_names(inst.rest))
    return full


def _fusion_traffic(fused: _Computation, operand_shapes: list) -> float:
    """HBM bytes of a fusion: each parameter as it is read (a slice of it when only sliced, the update's
    size when updated in place) plus its outputs (an in-place update writes the update)."""
    params = {int(re.match(r"(\d+)\)", inst.rest).group(1)): inst.name
              for inst in fused.instructions if inst.op == "parameter"}
    total = 0
    for index, shape in enumerate(operand_shapes):
        full = _bytes(shape)
        users = _users(fused, params[index]) if index in params else []
        first = [u for u in users if _operand_names(u.rest)[:1] == [params[index]]]
        if users and len(first) == len(users) and all(u.op in ("dynamic-slice", "slice", "gather") for u in users):
            total += min(full, sum(_bytes(fused.stored[u.name]) for u in users))
        elif users and len(first) == len(users) and all(u.op == "dynamic-update-slice" for u in users):
            total += min(full, sum(_bytes(fused.stored.get(_operand_names(u.rest)[1], [])) for u in users))
        else:
            total += full
    root = _defining(fused, fused.root)
    return total + _in_place_bytes(fused, root, _bytes(fused.stored.get(fused.root, [])))


@dataclasses.dataclass
class _Totals:
    """What one computation does per execution, its callees included."""

    flops: Counter = dataclasses.field(default_factory=Counter)  # source -> FLOPs
    kernel_flops: float = 0.0
    hbm: float = 0.0
    hbm_by_source: Counter = dataclasses.field(default_factory=Counter)
    sent: Counter = dataclasses.field(default_factory=Counter)  # kind -> bytes
    sent_by_source: Counter = dataclasses.field(default_factory=Counter)
    sent_by_link: Counter = dataclasses.field(default_factory=Counter)
    counts: Counter = dataclasses.field(default_factory=Counter)
    uncosted: Counter = dataclasses.field(default_factory=Counter)  # kernel name -> executions
    dynamic: int = 0

    def add(self, other: _Totals, times: int, source: str) -> None:
        """Add a callee run `times` times; its unattributed work takes the calling instruction's source."""
        for key, value in other.flops.items():
            self.flops[source if key == _NO_METADATA else key] += times * value
        for mine, theirs in ((self.sent_by_source, other.sent_by_source), (self.hbm_by_source, other.hbm_by_source)):
            for key, value in theirs.items():
                mine[source if key == _NO_METADATA else key] += times * value
        self.kernel_flops += times * other.kernel_flops
        self.hbm += times * other.hbm
        for mine, theirs in ((self.sent, other.sent), (self.sent_by_link, other.sent_by_link),
                             (self.counts, other.counts), (self.uncosted, other.uncosted)):
            for key, value in theirs.items():
                mine[key] += times * value
        self.dynamic += other.dynamic


@dataclasses.dataclass
class HloStats:
    matmul_flops: float
    collective_bytes: dict[str, float]
    collective_counts: dict[str, int]
    dynamic_loops: int  # while loops whose trip count is data-dependent (counted once)
    flops_by_source: dict[str, float] = dataclasses.field(default_factory=dict)  # op_name metadata -> FLOPs
    hbm_bytes: float = 0.0
    hbm_bytes_by_source: dict[str, float] = dataclasses.field(default_factory=dict)
    collective_bytes_by_source: dict[str, float] = dataclasses.field(default_factory=dict)
    collective_bytes_by_link: dict[str, float] = dataclasses.field(default_factory=dict)  # intra / inter-node
    kernel_flops: float = 0.0  # the part of matmul_flops Pallas kernels declared
    kernels_without_cost: dict[str, int] = dataclasses.field(default_factory=dict)  # name -> executions

    @property
    def total_collective_bytes(self) -> float:
        return sum(self.collective_bytes.values())


def _add_instruction(totals: _Totals, inst: _Instruction, comp: _Computation, computations: dict, program: bool,
                     num_devices: int, node_of_device: Sequence[int] | None) -> None:
    """Add one instruction's own work (not its callees') to its computation's `totals`; HBM traffic only where
    it runs as a program op."""
    op, source = inst.op, _source(inst)
    flops = 0.0
    operand_shapes = [comp.stored.get(name, []) for name in _operand_names(inst.rest)]
    traffic = sum(_bytes(shape) for shape in operand_shapes) + _bytes(_arrays(inst.type_text, stored=True))
    if op in ("dot", "convolution"):
        flops = _matmul_flops(inst, comp)
    elif op == "custom-call":
        target = _custom_call_target(inst)
        if inst.name.startswith("ragged-dot"):
            flops = _ragged_dot_flops(inst, comp)
        elif target.startswith("__cublas$"):
            flops = _cublas_flops(inst, comp)
        elif target in KERNEL_TARGETS:
            cost = _kernel_cost(inst)
            if cost is None:
                totals.uncosted[_kernel_name(inst)] += 1
            else:
                flops = cost[0]
                totals.kernel_flops += cost[0]
                traffic = cost[1]
    kind = op[:-len("-start")] if op.endswith("-start") else op
    if kind in COLLECTIVES:
        sent = _sent_bytes(kind, inst, comp, num_devices)
        totals.sent[kind] += sent
        totals.sent_by_source[source] += sent
        totals.sent_by_link[_link(inst, num_devices, node_of_device)] += sent
        totals.counts[kind] += 1
    if program and op not in _NO_TRAFFIC and not op.endswith("-done"):
        if op == "fusion":
            fused = computations.get(_called(inst).get("calls", [""])[0])
            if fused is not None:
                if fused.traffic is None:
                    fused.traffic = _fusion_traffic(fused, operand_shapes)
                traffic = fused.traffic
        elif op == "copy-start":  # returns (destination, source, context): only the destination is written
            destination = _arrays(_ARRAY.search(inst.type_text).group(0), stored=True)
            traffic = sum(_bytes(shape) for shape in operand_shapes) + _bytes(destination)
        elif op in ("dynamic-slice", "slice"):
            traffic = _slice_traffic(inst.type_text)
        elif op == "slice-start":  # ((operand), slice, context): only the slice is read
            traffic = _slice_traffic(_tuple_elements(inst.type_text)[1])
        elif op == "dynamic-update-slice":
            traffic = 2 * _bytes(operand_shapes[1])
        elif op == "ragged-all-to-all":  # its output operand is updated in place: the received rows are written
            traffic -= _bytes(operand_shapes[1])
        totals.hbm += traffic
        totals.hbm_by_source[source] += traffic
    if flops > 0:  # no zero entries by source
        totals.flops[source] += flops


def _called(inst: _Instruction) -> dict[str, list[str]]:
    return {key: [n.strip().lstrip("%") for n in value.strip("{}").split(",") if n.strip()]
            for key, value in _CALLED.findall(inst.rest)}


def flops_in_scope(stats: HloStats, scope: str) -> float:
    """Matmul FLOPs of the instructions whose JAX operation ran inside `jax.named_scope(scope)` (the first part of
    their source once the jit and transform wrappers are dropped)."""
    return sum(flops for source, flops in stats.flops_by_source.items() if source.split("/", 1)[0] == scope)


def hlo_stats(text: str, num_devices: int, node_of_device: Sequence[int] | None = None) -> HloStats:
    """Counts of a compiled per-device HLO module. `node_of_device[i]`: the node (host) of logical device i,
    to split collective bytes into intra- and inter-node; None puts every collective on one node."""
    if node_of_device is not None and len(node_of_device) != num_devices:
        raise ValueError(f"node_of_device has {len(node_of_device)} entries; it needs one per device "
                         f"(num_devices={num_devices})")
    computations, entry = parse_computations(text)
    memo: dict[tuple[str, bool], _Totals] = {}

    def visit(name: str, program: bool) -> _Totals:
        if (name, program) in memo:
            return memo[(name, program)]
        comp = computations.get(name)
        if comp is None:
            raise HloParseError(f"computation {name!r} is called but not defined")
        totals = _Totals()
        for inst in comp.instructions:
            _add_instruction(totals, inst, comp, computations, program, num_devices, node_of_device)
            called = _called(inst)
            times = 1
            if inst.op == "while":
                known = re.search(r'"known_trip_count":\{"n":"(\d+)"', inst.rest)
                condition = computations.get(called.get("condition", [""])[0])
                trips = int(known.group(1)) if known else _trip_count(condition)
                totals.dynamic += trips is None
                times = trips or 1
            for key, names in called.items():
                if inst.op == "while" and key == "condition":
                    continue
                callee_program = program and (inst.op, key) in _PROGRAM_CALLEES
                branches = [visit(callee, callee_program) for callee in names]
                if inst.op == "conditional":  # one branch runs: count the costliest
                    branches = [max(branches, key=lambda t: (sum(t.flops.values()), t.hbm))] if branches else []
                for branch in branches:
                    totals.add(branch, times, _source(inst))
        memo[(name, program)] = totals
        return totals

    totals = visit(entry, True)
    return HloStats(
        matmul_flops=float(sum(totals.flops.values())), collective_bytes=dict(totals.sent),
        collective_counts=dict(totals.counts), dynamic_loops=totals.dynamic,
        flops_by_source=dict(totals.flops.most_common()), hbm_bytes=totals.hbm,
        hbm_bytes_by_source=dict(totals.hbm_by_source.most_common()),
        collective_bytes_by_source=dict(totals.sent_by_source.most_common()),
        collective_bytes_by_link=dict(totals.sent_by_link), kernel_flops=totals.kernel_flops,
        kernels_without_cost=dict(totals.uncosted.most_common()))
