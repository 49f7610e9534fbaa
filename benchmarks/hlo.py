"""What a compiled program moves, read from its optimised HLO text: HBM traffic at fusion
boundaries, collectives, host transfers.

XLA's `cost_analysis()["bytes accessed"]` is not HBM traffic on TPU: it adds up the operand and
output bytes of every instruction, the ones inside fusions included (values that live in vector
registers and VMEM), the copies into VMEM (memory space 1), and re-reads. What does cross HBM is
what a top-level instruction (a fusion, a copy, a collective, a custom call) reads from and
writes to memory space 0, since XLA materialises every value that passes from one fusion to the
next. `traffic` adds those up, with the bodies of while loops counted as often as they run (XLA's
cost analysis counts a loop body once, whatever its trip count).

It is an estimate, not a measurement: a fusion that tiles a large operand may read it more than
once (more traffic), an in-place update writes only its slice (less), and small arrays are
counted without their padding to the (8, 128) tiles.
"""

import dataclasses
import json
import re

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
# Instructions that move no data of their own: views, tuples, the "-done" half of async pairs
# (the "-start" half is counted), and control flow (its bodies are counted instead).
_FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
    "while", "conditional", "call",
}  # fmt: skip
_COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_HOST_OPS = ("send", "recv", "infeed", "outfeed", "send-done", "recv-done")
_HOST_MEMORY_SPACE = 5  # pinned host memory on TPU

_ARRAY = re.compile(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^{}]*\})?")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")
_CALLED = re.compile(r"\b(body|calls|to_apply|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str


def _split_shape(text: str) -> tuple[str, str]:
    """'f32[2]{0} add(%a, %b), ...' -> ('f32[2]{0}', 'add(%a, %b), ...')."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == " " and depth == 0:
            return text[:i], text[i + 1 :]
    return text, ""


def _operands(text: str) -> tuple[list[str], str]:
    """'(%a, %b), attrs' -> (['a', 'b'], 'attrs')."""
    depth, start = 0, 1
    names = []
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if (ch == "," and depth == 1) or (ch == ")" and depth == 0):
            token = text[start:i].strip().split(" ")[-1]
            if token.startswith("%"):
                names.append(token[1:])
            start = i + 1
            if depth == 0:
                return names, text[i + 1 :]
    return names, ""


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """({computation name: its instructions}, the entry computation's name)."""
    computations, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
            continue
        if current is None or " = " not in line or line.strip() == "}":
            continue
        lhs, rhs = line.strip().removeprefix("ROOT ").split(" = ", 1)
        shape, rest = _split_shape(rhs)
        opcode, _, args = rest.partition("(")
        operands, attrs = _operands("(" + args)
        current.append(Instruction(lhs.lstrip("%"), shape, opcode, operands, attrs))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def shape_bytes(shape: str, memory_space: int | None = 0) -> float:
    """Bytes of the arrays in an HLO shape string (tuples included) that live in
    `memory_space` (0: HBM; None: all)."""
    total = 0.0
    for dtype, dims, layout in _ARRAY.findall(shape):
        space = re.search(r"S\((\d+)\)", layout or "")
        if memory_space is not None and (int(space.group(1)) if space else 0) != memory_space:
            continue
        count = 1
        for d in dims.split(","):
            count *= int(d) if d else 1
        total += count * _DTYPE_BYTES.get(dtype, 0)
    return total


@dataclasses.dataclass
class Traffic:
    """Per device and per program execution."""

    hbm_bytes: float = 0.0  # read and written at top-level instructions, memory space 0
    by_scope: dict = dataclasses.field(default_factory=dict)  # forward | backward | other
    by_part: dict = dataclasses.field(default_factory=dict)  # attention, feed-forward, ...
    collectives: dict = dataclasses.field(default_factory=dict)  # kind -> result bytes
    collective_dtypes: dict = dataclasses.field(default_factory=dict)  # "kind dtype" -> bytes
    host_transfers: list = dataclasses.field(default_factory=list)  # "opcode name" lines
    loops: list = dataclasses.field(default_factory=list)  # (while name, trip count or None)

    def as_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


def _scope(name: str) -> str:
    """Forward, backward or neither (optimizer, casts, copies), from an instruction's JAX op
    name (`jvp(...)` wraps the forward pass, `transpose(jvp(...))` the backward)."""
    if "transpose(" in name:
        return "backward"
    if "jvp(" in name:
        return "forward"
    return "other"


def _part(name: str) -> str:
    """Which piece of the model an instruction works for, from the Flax module path in its op
    name; "optimizer and the rest" outside the differentiated function."""
    if _scope(name) == "other":
        return "optimizer and the rest"
    if "/self_attn/" in name or "/cross_attn/" in name:
        return "attention"
    if "/mlp/" in name:
        return "feed-forward"
    if "_ln/" in name or "ln_embedding/" in name:
        return "layer norms"
    if "layer_" in name:
        return "layers, other"
    return "embeddings, vocabulary logits and the loss"


def traffic(hlo_text: str) -> Traffic:
    """HBM traffic, collectives and host transfers of one execution of a compiled program."""
    computations, entry = parse(hlo_text)
    out = Traffic()

    def host_transfer(inst: Instruction) -> bool:
        target = _TARGET.search(inst.attrs)
        if inst.opcode in _HOST_OPS:
            return True
        if (
            inst.opcode == "custom-call"
            and target
            and re.search(r"callback|host", target.group(1), re.IGNORECASE)
        ):
            return True
        return shape_bytes(inst.shape, _HOST_MEMORY_SPACE) > 0

    def collective(inst: Instruction, shapes: dict, times: float) -> None:
        kind = inst.opcode.removesuffix("-start")
        if kind not in _COLLECTIVES:
            return
        results = inst.shape
        if inst.opcode.endswith("-start") and inst.shape.startswith("("):
            # (operands..., results...): the results are the trailing components
            arrays = _ARRAY.findall(inst.shape)[len(inst.operands) :]
            results = " ".join(f"{d}[{s}]{layout}" for d, s, layout in arrays)
        for dtype, dims, layout in _ARRAY.findall(results):
            size = shape_bytes(f"{dtype}[{dims}]{layout}", None) * times
            out.collectives[kind] = out.collectives.get(kind, 0.0) + size
            key = f"{kind} {dtype}"
            out.collective_dtypes[key] = out.collective_dtypes.get(key, 0.0) + size

    def fused(name: str, times: float, seen: tuple) -> None:
        """Collectives inside a fusion (XLA fuses some into their consumers on TPU)."""
        shapes = {i.name: i.shape for i in computations[name]}
        for inst in computations[name]:
            collective(inst, shapes, times)
            callee = dict(_CALLED.findall(inst.attrs)).get("calls")
            if callee in computations and callee not in seen:
                fused(callee, times, (*seen, callee))

    def visit(name: str, times: float, seen: tuple) -> None:
        shapes = {i.name: i.shape for i in computations[name]}
        for inst in computations[name]:
            if host_transfer(inst):
                out.host_transfers.append(f"{inst.opcode} {inst.name} (in {name})")
            called = dict(_CALLED.findall(inst.attrs))
            if inst.opcode == "while":
                trip = _TRIP.search(inst.attrs)
                out.loops.append((inst.name, int(trip.group(1)) if trip else None))
                n = int(trip.group(1)) if trip else 1
                for key in ("body", "condition"):
                    if key in called and called[key] not in seen:
                        visit(called[key], times * n, (*seen, called[key]))
            elif inst.opcode == "conditional":
                branches = _BRANCHES.search(inst.attrs)
                for branch in branches.group(1).split(",") if branches else []:
                    branch = branch.strip().lstrip("%")
                    if branch in computations and branch not in seen:
                        visit(branch, times, (*seen, branch))  # an upper bound: every branch
            elif inst.opcode == "call" and called.get("to_apply") not in (None, *seen):
                visit(called["to_apply"], times, (*seen, called["to_apply"]))
            elif inst.opcode == "fusion" and called.get("calls") in computations:
                fused(called["calls"], times, (*seen, called["calls"]))
            if inst.opcode in _FREE or inst.opcode.endswith("-done"):
                continue
            read = sum(shape_bytes(shapes.get(o, "")) for o in inst.operands)
            written = shape_bytes(inst.shape)
            if inst.opcode.endswith("-start") and inst.shape.startswith("("):
                written = max(written - read, 0.0)  # the start's tuple holds its operands too
            moved = (read + written) * times
            out.hbm_bytes += moved
            op_name = _OP_NAME.search(inst.attrs)
            op_name = op_name.group(1) if op_name else ""
            for table, key in ((out.by_scope, _scope(op_name)), (out.by_part, _part(op_name))):
                table[key] = table.get(key, 0.0) + moved
            collective(inst, shapes, times)

    visit(entry, 1.0, (entry,))
    return out
