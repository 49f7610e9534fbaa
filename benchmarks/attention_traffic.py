r"""The attention part of a compiled train step's HBM traffic, split by what its instructions do.

`benchmarks.hlo.traffic` puts each top-level instruction's HBM bytes in a part of the model by
its JAX op name; this splits the "attention" part of a saved optimised HLO (`--hlo_dir` of
`experiments/tpu_compile.py`) by the instruction's kind, counted the same way (memory space 0,
loop bodies as often as they run, XLA's unnamed copies with the instruction they serve):

- "kernel calls": the Pallas kernels' TPU custom calls (flash or splash: forward, dQ, dK/dV),
  their operands and results;
- "projections": fusions with a matmul (q, k, v and output projections, their gradients; the
  XLA path's score and mixing matmuls);
- "layout copies": copies and fusions that only transpose or copy ([B, S, h, d] <-> [B, h, S, d]);
- "padding and slicing": fusions that only pad, slice or concatenate (lengths padded to a
  kernel's blocks, statistics sliced to one lane);
- "broadcasts": fusions that only broadcast (statistics broadcast over lanes);
- "elementwise": the rest (the XLA path's softmax, scaling, masks, dropout, casts).

    python -m benchmarks.attention_traffic /tmp/hlo/v5e-2x4_train_host_B128_remat1_*.hlo.txt.gz

Legend: B batch, S length, h heads, d head width.
"""

import gzip
import re
import sys

from benchmarks import hlo

KINDS = (
    "kernel calls",
    "projections",
    "layout copies",
    "padding and slicing",
    "broadcasts",
    "elementwise",
)
_MATMULS = {"dot", "convolution"}


def _kind(inst: hlo.Instruction, computations: dict) -> str:
    if inst.opcode == "custom-call" and "tpu_custom_call" in inst.attrs:
        return "kernel calls"
    opcodes = {inst.opcode}
    called = dict(hlo._CALLED.findall(inst.attrs)).get("calls")
    if inst.opcode == "fusion" and called in computations:
        opcodes = hlo._fused_opcodes(called, computations)
    if opcodes & _MATMULS:
        return "projections"
    moves = opcodes - {"parameter", "tuple", "get-tuple-element", "bitcast", "constant"}
    if moves <= hlo._MOVES:
        if moves & {"transpose", "copy"}:
            return "layout copies"
        if moves & {"pad", "slice", "dynamic-slice", "concatenate", "dynamic-update-slice"}:
            return "padding and slicing"
        if "broadcast" in moves:
            return "broadcasts"
    return "elementwise"


def split(hlo_text: str) -> dict:
    """{kind: HBM bytes} of the attention part, per device and per execution."""
    computations, entry = hlo.parse(hlo_text)
    out = dict.fromkeys(KINDS, 0.0)

    def visit(name: str, times: float, seen: tuple) -> None:
        shapes = {i.name: i.shape for i in computations[name]}
        served = hlo._served(computations[name])
        for inst in computations[name]:
            called = dict(hlo._CALLED.findall(inst.attrs))
            if inst.opcode == "while":
                trip = hlo.trip_count(inst, computations, name)
                for key in ("body", "condition"):
                    if key in called and called[key] not in seen:
                        visit(called[key], times * (trip or 1), (*seen, called[key]))
            elif inst.opcode == "call" and called.get("to_apply") not in (None, *seen):
                visit(called["to_apply"], times, (*seen, called["to_apply"]))
            if inst.opcode in hlo._FREE or inst.opcode.endswith("-done"):
                continue
            read = hlo.operand_bytes(inst, shapes, computations)
            written = hlo.shape_bytes(inst.shape)
            if inst.opcode.endswith("-start") and inst.shape.startswith("("):
                written = max(written - read, 0.0)
            if inst.opcode == "slice-start":
                read, written = hlo._async_slice_bytes(inst, shapes)
            who = served.get(inst.name, inst)
            op_name = hlo._OP_NAME.search(who.attrs)
            if hlo._part(op_name.group(1) if op_name else "") != "attention":
                continue
            out[_kind(who, computations)] += (read + written) * times

    visit(entry, 1.0, (entry,))
    return out


def main(paths: list[str]) -> None:
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            parts = split(f.read())
        total = sum(parts.values())
        print(f"{path}: attention {total / 1e9:.1f} GB per device per step")
        for kind, moved in parts.items():
            print(f"  {kind:<20} {moved / 1e9:7.1f} GB")


if __name__ == "__main__":
    if len(sys.argv) < 2 or any(re.match(r"-", a) for a in sys.argv[1:]):
        raise SystemExit("usage: python -m benchmarks.attention_traffic HLO.txt[.gz] ...")
    main(sys.argv[1:])
