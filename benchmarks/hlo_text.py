"""An optimised HLO text read into its computations' instructions (`parse`), and an HLO shape's
bytes (`shape_bytes`): what `benchmarks.hlo` counts traffic from."""

import dataclasses
import re

_DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
# One array of a shape string: dtype, dims, layout (e.g. "bf16[8,128]{1,0:T(8,128)S(1)}").
ARRAY = re.compile(r"([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\](\{[^{}]*\})?")
# The first line of an instruction: `  [ROOT ]%name = ...`.
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+ = ")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\) -> .* \{$")


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    literal: str = ""  # a constant's value, e.g. "4", or a parameter's index
    root: bool = False


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


def _logical_lines(hlo_text: str):
    """The HLO text's lines, an instruction whose attributes span several lines (a Pallas
    kernel's `kernel_metadata` holds newlines) joined into one."""
    pending = None
    for line in hlo_text.splitlines():
        if pending is not None and not (
            _HEADER.match(line) or _INSTRUCTION.match(line) or line.strip() == "}"
        ):
            pending += " " + line.strip()
            continue
        if pending is not None:
            yield pending
            pending = None
        if _INSTRUCTION.match(line):
            pending = line
        else:
            yield line
    if pending is not None:
        yield pending


def parse(hlo_text: str) -> tuple[dict[str, list[Instruction]], str]:
    """({computation name: its instructions}, the entry computation's name)."""
    computations, entry, current = {}, None, None
    for line in _logical_lines(hlo_text):
        header = _HEADER.match(line)
        if header:
            current = computations.setdefault(header.group(2), [])
            entry = header.group(2) if header.group(1) else entry
            continue
        if current is None or " = " not in line or line.strip() == "}":
            continue
        text = line.strip()
        lhs, rhs = text.removeprefix("ROOT ").split(" = ", 1)
        shape, rest = _split_shape(rhs)
        opcode, _, args = rest.partition("(")
        operands, attrs = _operands("(" + args)
        literal = args.partition(")")[0] if opcode in ("constant", "parameter") else ""
        root = text.startswith("ROOT ")
        current.append(Instruction(lhs.lstrip("%"), shape, opcode, operands, attrs, literal, root))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def shape_bytes(shape: str, memory_space: int | None = 0) -> float:
    """Bytes of the arrays in an HLO shape string (tuples included) that live in
    `memory_space` (0: HBM; None: all)."""
    total = 0.0
    for dtype, dims, layout in ARRAY.findall(shape):
        space = re.search(r"S\((\d+)\)", layout or "")
        if memory_space is not None and (int(space.group(1)) if space else 0) != memory_space:
            continue
        count = 1
        for d in dims.split(","):
            count *= int(d) if d else 1
        total += count * _DTYPE_BYTES.get(dtype, 0)
    return total
