"""Per-device matmul FLOPs and collective traffic read off a compiled executable's HLO text, with every op
counted as many times as it runs.

XLA's `cost_analysis()` visits a while loop's body once, so the layer stack under `lax.scan` (and the MTP depth
loop) would be counted as one layer. Here the text is walked from ENTRY through the computations each
instruction calls (fusions, calls, conditionals, while bodies), multiplying a while body by its trip count
when the loop condition compares the counter with a constant (the form `lax.scan` and `fori_loop` with static
bounds compile to); loops with data-dependent bounds (the MoE's loop over used blocks) count once and are
reported. FLOPs are those of `dot` and `convolution` ops (XLA:TPU writes matmuls as convolutions) and of
XLA:TPU's grouped-matmul custom calls (`ragged_dot`): 2 x output elements x contracted size. Collective bytes are what each device sends in a ring algorithm:
all-gather (n-1)/n x result, reduce-scatter (n-1) x result, all-reduce 2 (n-1)/n x size, all-to-all
(n-1)/n x size, collective-permute the size.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict

DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3b11fnuz": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
               "f64": 8, "c64": 8, "c128": 16}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
               "ragged-all-to-all")

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|branch_computations)=(\{[%\w.\-, ]*\}|%?[\w.\-]+)")


class HloParseError(ValueError):
    """The HLO text does not have the structure this reader expects."""


def _arrays(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a (possibly tuple) HLO type, layouts ignored."""
    out = []
    for dtype, dims in _ARRAY.findall(re.sub(r"\{[^{}]*\}", "", type_text)):
        if dtype in DTYPE_BYTES:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def _bytes(array: tuple[str, tuple[int, ...]]) -> int:
    return DTYPE_BYTES[array[0]] * math.prod(array[1])


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
    instructions: list


def parse_computations(text: str) -> tuple[dict[str, _Computation], str]:
    computations, entry, current = {}, None, None
    for line in text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = _Computation(header.group(2), {}, [])
            computations[current.name] = current
            if header.group(1):
                entry = current.name
            for param in re.finditer(r"([\w.\-]+):\s*((?:\([^)]*\))|(?:[a-z]\w*\[[\d,]*\]))", header.group(3)):
                current.shapes[param.group(1)] = _arrays(param.group(2))
            continue
        if current is None:
            continue
        if line.strip() == "}":
            current = None
            continue
        match = _INSTR.match(line)
        if match:
            name, type_text, op, rest = match.groups()
            current.shapes[name] = _arrays(type_text)
            current.instructions.append(_Instruction(name, type_text, op, rest))
    if entry is None:
        raise HloParseError("no ENTRY computation in the HLO text")
    return computations, entry


def _operand_names(rest: str) -> list[str]:
    args = rest.split(")", 1)[0]
    return [name for name in re.findall(r"%([\w.\-]+)", args)]


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
    # convolution: contracted size = the kernel's input features x the window taps that land on input
    # elements. XLA:TPU writes a batched matmul as a convolution whose batch dims are spatial dims with
    # window = lhs_dilate = batch: one tap per output there, so taps per dim are ceil(window / lhs_dilate).
    labels = re.search(r"dim_labels=[^_]+_([^-]+)->", inst.rest)
    if not rhs or not labels:
        return 0.0
    features = math.prod(size for letter, size in zip(labels.group(1), rhs[0][1]) if letter == "i")
    window = re.search(r"window=\{([^}]*)\}", inst.rest)
    taps = 1
    if window:
        sizes = re.search(r"size=([\dx]+)", window.group(1))
        dilate = re.search(r"lhs_dilate=([\dx]+)", window.group(1))
        sizes = [int(v) for v in sizes.group(1).split("x")] if sizes else []
        dilate = [int(v) for v in dilate.group(1).split("x")] if dilate else [1] * len(sizes)
        taps = math.prod(-(-size // d) for size, d in zip(sizes, dilate))
    return 2.0 * out_elements * features * taps


def _ragged_dot_flops(inst: _Instruction, comp: _Computation) -> float:
    """XLA:TPU's grouped matmul (a custom call after its int32 group metadata): every output row contracts the
    lhs's last dim once; the lhs is the first floating-point operand."""
    out = _arrays(inst.type_text)
    operands = [comp.shapes.get(name) for name in _operand_names(inst.rest)]
    lhs = next((shape[0] for shape in operands if shape and shape[0][0] in ("bf16", "f16", "f32", "f64")), None)
    if not out or lhs is None:
        return 0.0
    return 2.0 * math.prod(out[0][1]) * lhs[1][-1]


def _group_size(rest: str, num_devices: int) -> int:
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest)
    if named:
        sizes = dict((k.strip("' "), int(v)) for k, v in (p.split("=") for p in named.group(1).split(",")))
        return math.prod(sizes[a.strip("' ")] for a in named.group(2).split(",") if a.strip())
    iota = re.search(r"replica_groups=\[([\d,]+)\]<=", rest)
    if iota:
        return int(iota.group(1).split(",")[-1])
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if explicit:
        return max(1, len([d for d in explicit.group(1).split(",") if d]))
    return num_devices


def _sent_bytes(kind: str, inst: _Instruction, comp: _Computation, num_devices: int) -> float:
    arrays = _arrays(inst.type_text)
    if not arrays:
        return 0.0
    size = max(_bytes(a) for a in arrays)  # async -start ops return (operand, result): the larger one
    n = _group_size(inst.rest, num_devices)
    if kind == "collective-permute":
        return float(size)
    if n <= 1:
        return 0.0
    return {"all-gather": size * (n - 1) / n, "reduce-scatter": size * (n - 1),
            "all-reduce": 2 * size * (n - 1) / n}.get(kind, size * (n - 1) / n)


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NO_METADATA = "(no metadata)"  # e.g. a fusion's root: it takes the fusion instruction's source
_WRAPPERS = {"while", "body", "cond", "closed_call", "remat", "rematted_computation", "branch_0_fun", "branch_1_fun"}


def _source(inst: _Instruction) -> str:
    """The JAX operation an instruction came from (its `op_name` metadata without jit/transpose wrappers)."""
    match = _OP_NAME.search(inst.rest)
    if not match:
        return _NO_METADATA
    parts = [p for p in match.group(1).split("/")
             if p not in _WRAPPERS and not p.startswith(("jit(", "pjit(", "jvp(", "transpose(", "checkpoint"))]
    return "/".join(parts) or match.group(1)


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


@dataclasses.dataclass
class HloStats:
    matmul_flops: float
    collective_bytes: dict[str, float]
    collective_counts: dict[str, int]
    dynamic_loops: int  # while loops whose trip count is data-dependent (counted once)
    flops_by_source: dict[str, float] = dataclasses.field(default_factory=dict)  # op_name metadata -> FLOPs

    @property
    def total_collective_bytes(self) -> float:
        return sum(self.collective_bytes.values())


def hlo_stats(text: str, num_devices: int) -> HloStats:
    computations, entry = parse_computations(text)
    flops = 0.0
    sent: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    dynamic = 0
    memo: dict[str, tuple] = {}

    def visit(name: str) -> tuple[float, dict, dict, int, dict]:
        if name in memo:
            return memo[name]
        comp = computations.get(name)
        if comp is None:
            raise HloParseError(f"computation {name!r} is called but not defined")
        c_flops, c_sent, c_counts, c_dynamic = 0.0, defaultdict(float), defaultdict(int), 0
        c_sources: dict[str, float] = defaultdict(float)
        for inst in comp.instructions:
            op = inst.op
            inst_flops = 0.0
            if op in ("dot", "convolution"):
                inst_flops = _matmul_flops(inst, comp)
            elif op == "custom-call" and inst.name.startswith("ragged-dot"):
                inst_flops = _ragged_dot_flops(inst, comp)
            if inst_flops:
                c_flops += inst_flops
                c_sources[_source(inst)] += inst_flops
            kind = op[:-len("-start")] if op.endswith("-start") else op
            if kind in COLLECTIVES:
                c_sent[kind] += _sent_bytes(kind, inst, comp, num_devices)
                c_counts[kind] += 1
            called = {key: [n.strip().lstrip("%") for n in value.strip("{}").split(",") if n.strip()]
                      for key, value in _CALLED.findall(inst.rest)}
            times = 1
            if op == "while":
                trips = _trip_count(computations.get(called.get("condition", [""])[0]))
                if trips is None:
                    c_dynamic += 1
                times = trips or 1
            for key, names in called.items():
                if op == "while" and key == "condition":
                    continue
                for callee in names:
                    f, s, n, d, src = visit(callee)
                    c_flops += times * f
                    for k, v in s.items():
                        c_sent[k] += times * v
                    for k, v in n.items():
                        c_counts[k] += times * v
                    for k, v in src.items():
                        c_sources[_source(inst) if k == _NO_METADATA else k] += times * v
                    c_dynamic += d
        memo[name] = (c_flops, dict(c_sent), dict(c_counts), c_dynamic, dict(c_sources))
        return memo[name]

    flops, sent_map, count_map, dynamic, sources = visit(entry)
    sent.update(sent_map)
    counts.update(count_map)
    return HloStats(matmul_flops=flops, collective_bytes=dict(sent), collective_counts=dict(counts),
                    dynamic_loops=dynamic, flops_by_source=dict(sorted(sources.items(), key=lambda kv: -kv[1])))
