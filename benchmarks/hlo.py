"""What a compiled program moves, read from its optimised HLO text (`benchmarks.hlo_text`): HBM
traffic at fusion boundaries, collectives, host transfers.

XLA's `cost_analysis()["bytes accessed"]` is not HBM traffic on TPU: it adds up the operand and
output bytes of every instruction, the ones inside fusions included (values that live in vector
registers and VMEM), the copies into VMEM (memory space 1), and re-reads. What does cross HBM is
what a top-level instruction (a fusion, a copy, a collective, a custom call) reads from and
writes to memory space 0, since XLA materialises every value that passes from one fusion to the
next. `traffic` adds those up, with the bodies of while loops counted as often as they run (XLA's
cost analysis counts a loop body once, whatever its trip count). A loop without XLA's
`known_trip_count` (the windowed matmuls that overlap fsdp's collectives with compute, say) runs
as often as its counter says: `i < limit`, from a constant start, by a constant step. The same
walk counts the matmuls' FLOPs (`dot` and `convolution`) with every loop iteration.

Each instruction's bytes go to a part of the model by its JAX op name (`_part`); the copies and
slices XLA adds to move arrays into on-chip memory and back have none, and count with the
instruction they serve (`_served`). What lies outside the differentiated function ("optimizer and
the rest") is split by what it does (`_outside_part`): the optimizer update, the gradient norms,
casts, collectives, copies. An async slice (`slice-start`, several of which prefetch one large
array) reads only its slice, and so does a fusion of an operand it only slices (`operand_bytes`).

It is an estimate, not a measurement: a fusion that tiles a large operand may read it more than
once (more traffic), an in-place update writes only its slice (less), and small arrays are
counted without their padding to the (8, 128) tiles.
"""

import dataclasses
import json
import math
import re

import numpy as np

from benchmarks.hlo_text import ARRAY, Instruction, parse, shape_bytes

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

_CALLED = re.compile(r"\b(body|calls|to_apply|condition)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')


@dataclasses.dataclass
class Traffic:
    """Per device and per program execution."""

    hbm_bytes: float = 0.0  # read and written at top-level instructions, memory space 0
    by_scope: dict = dataclasses.field(default_factory=dict)  # forward | backward | other
    by_part: dict = dataclasses.field(default_factory=dict)  # attention, feed-forward, ...
    # by_part's "optimizer and the rest" split by what its instructions do (`_outside_part`)
    outside_by_kind: dict = dataclasses.field(default_factory=dict)
    collectives: dict = dataclasses.field(default_factory=dict)  # kind -> result bytes
    collective_dtypes: dict = dataclasses.field(default_factory=dict)  # "kind dtype" -> bytes
    host_transfers: list = dataclasses.field(default_factory=list)  # "opcode name" lines
    loops: list = dataclasses.field(default_factory=list)  # (while name, trip count or None)
    matmul_flops: float = 0.0  # dot and convolution FLOPs, loop bodies as often as they run
    matmul_flops_loops_once: float = 0.0  # the same with every loop body once, as XLA counts

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


_LLAMA_NORMS = re.compile(r"/(input_layernorm|post_attention_layernorm|norm)/")


def _part(name: str) -> str:
    """Which piece of the model an instruction works for, from the Flax module path in its op
    name; "optimizer and the rest" outside the differentiated function. BERT and BART name
    submodules (`self_attn/`, `mlp/`, `*_ln/`), Llama its projections (`self_attn_q_proj/`,
    `mlp_gate_proj/`), norms and scopes (`models.llama`); "layers, other" is the rest of a
    layer (Llama's rotary embedding, the residual adds)."""
    if _scope(name) == "other":
        return "optimizer and the rest"
    if "/self_attn/" in name or "/cross_attn/" in name:
        return "attention"
    if "/mlp/" in name:
        return "feed-forward"
    if "_ln/" in name or "ln_embedding/" in name or _LLAMA_NORMS.search(name):
        return "layer norms"
    if "/self_attn_" in name:
        return "attention"
    if "/mlp_" in name:
        return "feed-forward"
    if "layer_" in name or re.search(r"/layers_\d+/", name):
        return "layers, other"
    return "embeddings, vocabulary logits and the loss"


# The split of "optimizer and the rest" (`_outside_part`), in the order its rules are tried.
OUTSIDE_PARTS = (
    "collectives",
    "copies and layout changes",
    "optimizer update",
    "gradient norms",
    "casts",
    "other",
)
# Opcodes that only move or relabel data: a fusion of nothing else is a copy or a layout change.
_MOVES = {
    "parameter", "tuple", "get-tuple-element", "bitcast", "copy", "transpose", "reshape",
    "broadcast", "slice", "dynamic-slice", "dynamic-update-slice", "concatenate", "pad",
    "constant",
}  # fmt: skip
_FLOATS = re.compile(r"\b(f64|f32|bf16|f16|f8\w*)\[")


def _fused_opcodes(name: str, computations: dict, seen: tuple = ()) -> set:
    """The opcodes of a fused computation and of the computations it calls."""
    found = set()
    for inst in computations.get(name, []):
        found.add(inst.opcode)
        for callee in _CALLED.findall(inst.attrs):
            if callee[1] in computations and callee[1] not in seen:
                found |= _fused_opcodes(callee[1], computations, (*seen, callee[1]))
    return found


def _outside_part(inst: Instruction, computations: dict, shapes: dict) -> str:
    """What a top-level instruction outside the differentiated function does ("optimizer and
    the rest" in `_part`), from its opcode and what its fusion computes; JAX names these
    instructions after their primitive alone (`jit(step)/add`), so the op name cannot tell.

    - collectives: all-reduce, reduce-scatter, all-gather, ... (the gradients' sum when XLA
      places it after the backward pass, fsdp's gathers);
    - copies and layout changes: `copy`, `copy-start` and `slice-start` (to and from on-chip
      memory included), and fusions that only move data (transpose, slice, concatenate,
      dynamic-update-slice);
    - optimizer update: a fusion that takes a square root (AdamW's sqrt of the second moment):
      the moments and the new parameters, in one multi-output fusion per parameter;
    - gradient norms: a fusion or reduce whose results are all scalars (clipping's global norm,
      the logged gradient norms), which reads every gradient;
    - casts: a fusion whose floating-point results have a dtype none of its floating-point
      operands has, with no reduction (float32 parameters rounded to bfloat16 for the
      matmuls, bfloat16 gradients widened to float32);
    - other: the rest (the step counter, the schedule, scalars)."""
    kind = inst.opcode.removesuffix("-start")
    if kind in _COLLECTIVES:
        return "collectives"
    if kind in ("copy", "slice"):
        return "copies and layout changes"
    called = dict(_CALLED.findall(inst.attrs)).get("calls")
    ops = _fused_opcodes(called, computations) if inst.opcode == "fusion" else {inst.opcode}
    if ops & {"all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute"}:
        return "collectives"
    if ops <= _MOVES:
        return "copies and layout changes"
    if ops & {"sqrt", "rsqrt"}:
        return "optimizer update"
    results = ARRAY.findall(inst.shape)
    if "reduce" in ops and results and all(not dims for _, dims, _ in results):
        return "gradient norms"
    out_floats = set(_FLOATS.findall(inst.shape))
    in_floats = {d for o in inst.operands for d in _FLOATS.findall(shapes.get(o, ""))}
    if "convert" in ops and "reduce" not in ops and out_floats and not out_floats & in_floats:
        return "casts"
    return "other"


_INDEX = re.compile(r"\bindex=(\d+)")
_DIRECTION = re.compile(r"direction=(\w+)")
_WINDOW = re.compile(r"window=\{([^}]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=(\w+)_(\w+)->(\w+)")
_FEATURE_GROUPS = re.compile(r"feature_group_count=(\d+)")
_BATCH_GROUPS = re.compile(r"batch_group_count=(\d+)")
_LHS_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_PASS_THROUGH = ("copy", "bitcast", "convert", "copy-done")


def _dims(shape: str) -> list[int]:
    found = ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def _window_pairs(out: int, size: int, window: int, stride: int, pad_lo: int,
                  lhs_dilate: int, rhs_dilate: int) -> int:  # fmt: skip
    """(output position, window tap) pairs of one spatial dimension that read a real input
    element, not padding nor a hole of the input's dilation."""
    taps = np.arange(out)[:, None] * stride + np.arange(window)[None, :] * rhs_dilate - pad_lo
    real = (taps >= 0) & (taps <= (size - 1) * lhs_dilate) & (taps % lhs_dilate == 0)
    return int(real.sum())


def matmul_flops(inst: Instruction, shapes: dict) -> float:
    """FLOPs of a `dot` or `convolution` (2 per multiply-add of real elements: a convolution's
    taps on padding or on the holes of a dilated input, the way XLA writes a batched matmul,
    are not counted); 0 for any other instruction, or a convolution whose layout it cannot
    read (batch groups, unlabelled dimensions)."""
    out = _dims(inst.shape)
    lhs = _dims(shapes.get(inst.operands[0], "")) if inst.operands else []
    if inst.opcode == "dot":
        found = _LHS_CONTRACTING.search(inst.attrs)
        dims = [int(d) for d in found.group(1).split(",") if d] if found else []
        return 2.0 * math.prod(out) * math.prod(lhs[d] for d in dims if d < len(lhs))
    labels = _DIM_LABELS.search(inst.attrs)
    if inst.opcode != "convolution" or not labels or _BATCH_GROUPS.search(inst.attrs):
        return 0.0
    lhs_labels, _, out_labels = labels.groups()
    if len(lhs) != len(lhs_labels) or len(out) != len(out_labels) or "f" not in lhs_labels:
        return 0.0
    window = dict(
        item.split("=", 1) for item in (_WINDOW.search(inst.attrs) or ["", ""])[1].split() if item
    )
    spatial = [c for c in out_labels if c.isdigit()]
    fields = {}
    for key in ("size", "stride", "pad", "lhs_dilate", "rhs_dilate"):
        values = window.get(key, "").split("x") if key in window else []
        fields[key] = values if len(values) == len(spatial) else None
    pairs = 1
    for i, d in enumerate(sorted(spatial)):
        size, window_size = lhs[lhs_labels.index(d)], int((fields["size"] or ["1"] * 9)[i])
        pad_lo = int((fields["pad"] or ["0_0"] * 9)[i].split("_")[0])
        pairs *= _window_pairs(out[out_labels.index(d)], size, window_size,
                               int((fields["stride"] or ["1"] * 9)[i]), pad_lo,
                               int((fields["lhs_dilate"] or ["1"] * 9)[i]),
                               int((fields["rhs_dilate"] or ["1"] * 9)[i]))  # fmt: skip
    groups = _FEATURE_GROUPS.search(inst.attrs)
    features = lhs[lhs_labels.index("f")] // (int(groups.group(1)) if groups else 1)
    rest = math.prod(n for n, c in zip(out, out_labels, strict=True) if not c.isdigit())
    return 2.0 * rest * features * pairs


def trip_count(inst: Instruction, computations: dict, caller: str) -> int | None:
    """How often a `while` runs: XLA's `known_trip_count`, else from its counter (the condition
    `counter < limit` or `limit > counter` against a constant, the counter's initial value a
    constant and the body adding a positive constant to it); None when neither is found."""
    known = _TRIP.search(inst.attrs)
    if known:
        return int(known.group(1))
    called = dict(_CALLED.findall(inst.attrs))
    cond, body = computations.get(called.get("condition")), computations.get(called.get("body"))
    if not cond or not body or len(inst.operands) != 1:
        return None
    cond_table = {i.name: i for i in cond}
    body_table = {i.name: i for i in body}
    caller_table = {i.name: i for i in computations[caller]}

    def constant(name, table):  # the integer a value is, through copies and converts
        seen = table.get(name)
        while seen is not None and seen.opcode in _PASS_THROUGH and seen.operands:
            seen = table.get(seen.operands[0])
        if seen is None or seen.opcode != "constant":
            return None
        try:
            return int(seen.literal)
        except ValueError:
            return None

    def element(name, table):  # k when `name` is element k of the loop's state
        seen = table.get(name)
        found = _INDEX.search(seen.attrs) if seen and seen.opcode == "get-tuple-element" else None
        return int(found.group(1)) if found else None

    compare = next((i for i in cond if i.root and i.opcode == "compare"), None)
    if compare is None or len(compare.operands) != 2:
        return None
    direction = _DIRECTION.search(compare.attrs)
    direction = direction.group(1) if direction else None
    a, b = compare.operands if direction == "LT" else reversed(compare.operands)
    k, limit = element(a, cond_table), constant(b, cond_table)
    init = caller_table.get(inst.operands[0])
    out = next((i for i in body if i.root and i.opcode == "tuple"), None)
    if direction not in ("LT", "GT") or None in (k, limit, init, out) or init.opcode != "tuple":
        return None
    if k >= len(init.operands) or k >= len(out.operands):
        return None
    start = constant(init.operands[k], caller_table)
    step = body_table.get(out.operands[k])
    if start is None or step is None or step.opcode != "add" or len(step.operands) != 2:
        return None
    x, y = step.operands
    increment = (
        constant(y, body_table)
        if element(x, body_table) == k
        else constant(x, body_table)
        if element(y, body_table) == k
        else None
    )
    if not increment or increment < 0:
        return None
    return max(0, -(-(limit - start) // increment))


def _served(instructions: list) -> dict:
    """{name: the instruction it serves} for the instructions of one computation that XLA made
    without a JAX op name (the copies and slices that move an array into on-chip memory and
    back): the first consumer with an op name, through the "-done" halves, bitcasts, tuples and
    XLA's other unnamed instructions (the concatenation of a prefetch's slices); without one
    (an array copied out to HBM for the program's result), the producer of its operand. Their
    traffic counts with the part they serve (a weight prefetched for an attention matmul, a
    parameter for the optimizer update), not as a part of its own."""
    table = {i.name: i for i in instructions}
    users: dict = {}
    for inst in instructions:
        for operand in inst.operands:
            users.setdefault(operand, []).append(inst)

    def named(inst):  # an instruction of JAX's with data of its own to move
        return (
            _OP_NAME.search(inst.attrs) is not None
            and inst.opcode not in _FREE
            and not inst.opcode.endswith(("-start", "-done"))
        )

    memo: dict = {}

    def consumer(name):
        if name not in memo:
            memo[name] = None
            for user in users.get(name, []):
                found = user if named(user) else consumer(user.name)
                if found is not None:
                    memo[name] = found
                    break
        return memo[name]

    def producer(name, depth=0):
        inst = table.get(name)
        if inst is None or depth > 8:
            return None
        if named(inst):
            return inst
        return producer(inst.operands[0], depth + 1) if inst.operands else None

    out = {}
    for inst in instructions:
        if named(inst) or inst.opcode in _FREE:
            continue
        found = consumer(inst.name) or (producer(inst.operands[0]) if inst.operands else None)
        if found is not None:
            out[inst.name] = found
    return out


_SLICING = {"slice", "dynamic-slice"}


def _sliced_reads(name: str, computations: dict, seen: tuple = ()) -> dict[int, float]:
    """{parameter index: bytes read} of fused computation `name` for each parameter that is only
    sliced inside it (by `slice` or `dynamic-slice`, directly or as a parameter of a nested
    fusion that only slices it): such a fusion reads its slices of that operand, not all of it
    (a loop that scores a large array block by block passes the whole array to a fusion each
    time and reads one block)."""
    instructions = computations.get(name, [])
    users: dict = {}
    for inst in instructions:
        for position, operand in enumerate(inst.operands):
            users.setdefault(operand, []).append((inst, position))
    out = {}
    for param in instructions:
        if param.opcode != "parameter" or not param.literal.isdigit():
            continue
        read = 0.0
        for user, position in users.get(param.name, []):
            called = dict(_CALLED.findall(user.attrs)).get("calls")
            if user.opcode in _SLICING and position == 0:
                read += shape_bytes(user.shape, None)
            elif user.opcode == "fusion" and called in computations and called not in seen:
                nested = _sliced_reads(called, computations, (*seen, called)).get(position)
                if nested is None:
                    break
                read += nested
            else:
                break
        else:
            if param.name in users:
                out[int(param.literal)] = read
    return out


def operand_bytes(inst: Instruction, shapes: dict, computations: dict) -> float:
    """HBM bytes an instruction reads: its operands in HBM, and of a fusion's operand that the
    fusion only slices, the slices (`_sliced_reads`)."""
    called = dict(_CALLED.findall(inst.attrs)).get("calls")
    sliced = _sliced_reads(called, computations) if inst.opcode == "fusion" else {}
    read = 0.0
    for position, operand in enumerate(inst.operands):
        size = shape_bytes(shapes.get(operand, ""))
        read += min(size, sliced[position]) if size and position in sliced else size
    return read


def _async_slice_bytes(inst: Instruction, shapes: dict) -> tuple[float, float]:
    """(read, written) HBM bytes of a `slice-start`, whose shape is ((operand), slice,
    context): it reads only its slice of the operand (XLA prefetches a large array into on-chip
    memory as several such slices, each one counted whole would count the array as often), and
    writes the slice, to HBM only when the slice lives there."""
    arrays = ARRAY.findall(inst.shape)
    if len(arrays) <= len(inst.operands) or not inst.operands:
        return 0.0, 0.0
    dtype, dims, layout = arrays[len(inst.operands)]
    piece = f"{dtype}[{dims}]{layout}"
    in_hbm = shape_bytes(shapes.get(inst.operands[0], "")) > 0
    return shape_bytes(piece, None) * in_hbm, shape_bytes(piece)


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
            arrays = ARRAY.findall(inst.shape)[len(inst.operands) :]
            results = " ".join(f"{d}[{s}]{layout}" for d, s, layout in arrays)
        for dtype, dims, layout in ARRAY.findall(results):
            size = shape_bytes(f"{dtype}[{dims}]{layout}", None) * times
            out.collectives[kind] = out.collectives.get(kind, 0.0) + size
            key = f"{kind} {dtype}"
            out.collective_dtypes[key] = out.collective_dtypes.get(key, 0.0) + size

    def matmuls(inst: Instruction, shapes: dict, times: float, once: float) -> None:
        flops = matmul_flops(inst, shapes)
        out.matmul_flops += flops * times
        out.matmul_flops_loops_once += flops * once

    def fused(name: str, times: float, seen: tuple, once: float = 1.0) -> None:
        """Collectives and matmuls inside a fusion (XLA fuses some collectives into their
        consumers on TPU)."""
        shapes = {i.name: i.shape for i in computations[name]}
        for inst in computations[name]:
            collective(inst, shapes, times)
            matmuls(inst, shapes, times, once)
            callee = dict(_CALLED.findall(inst.attrs)).get("calls")
            if callee in computations and callee not in seen:
                fused(callee, times, (*seen, callee), once)

    def visit(name: str, times: float, seen: tuple, once: float = 1.0) -> None:
        """`times`: how often `name` runs; `once`: how often XLA's cost analysis counts it."""
        shapes = {i.name: i.shape for i in computations[name]}
        served = _served(computations[name])
        for inst in computations[name]:
            if host_transfer(inst):
                out.host_transfers.append(f"{inst.opcode} {inst.name} (in {name})")
            called = dict(_CALLED.findall(inst.attrs))
            matmuls(inst, shapes, times, once)
            if inst.opcode == "while":
                trip = trip_count(inst, computations, name)
                out.loops.append((inst.name, trip))
                n = 1 if trip is None else trip
                for key in ("body", "condition"):
                    if key in called and called[key] not in seen:
                        visit(called[key], times * n, (*seen, called[key]), once)
            elif inst.opcode == "conditional":
                branches = _BRANCHES.search(inst.attrs)
                for branch in branches.group(1).split(",") if branches else []:
                    branch = branch.strip().lstrip("%")
                    if branch in computations and branch not in seen:
                        visit(branch, times, (*seen, branch), once)  # an upper bound: all
            elif inst.opcode == "call" and called.get("to_apply") not in (None, *seen):
                visit(called["to_apply"], times, (*seen, called["to_apply"]), once)
            elif inst.opcode == "fusion" and called.get("calls") in computations:
                fused(called["calls"], times, (*seen, called["calls"]), once)
            if inst.opcode in _FREE or inst.opcode.endswith("-done"):
                continue
            read = operand_bytes(inst, shapes, computations)
            written = shape_bytes(inst.shape)
            if inst.opcode.endswith("-start") and inst.shape.startswith("("):
                written = max(written - read, 0.0)  # the start's tuple holds its operands too
            if inst.opcode == "slice-start":
                read, written = _async_slice_bytes(inst, shapes)
            moved = (read + written) * times
            out.hbm_bytes += moved
            who = served.get(inst.name, inst)
            op_name = _OP_NAME.search(who.attrs)
            op_name = op_name.group(1) if op_name else ""
            part = _part(op_name)
            for table, key in ((out.by_scope, _scope(op_name)), (out.by_part, part)):
                table[key] = table.get(key, 0.0) + moved
            if part == "optimizer and the rest":
                key = _outside_part(who, computations, shapes)
                out.outside_by_kind[key] = out.outside_by_kind.get(key, 0.0) + moved
            collective(inst, shapes, times)

    visit(entry, 1.0, (entry,))
    return out
