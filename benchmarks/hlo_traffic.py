"""Bytes a compiled step reads and writes, counted from XLA's optimized HLO.

A step over large tensors is bound by memory traffic, so the bytes its
compiled program moves per parameter are its floor: SGD-momentum moves
`g`, `m` and `w` through memory, LARS moves them plus its norms' reads.
What XLA actually emits can move more than the formula (one pass per output
on CPU, for instance: the new momentum is written, then read back to update
the weight), and this module counts it from the program itself.

The count walks the entry computation of the optimized HLO text (what
`tf.function(jit_compile=True).experimental_get_compiler_ir(...)(
stage="optimized_hlo")` and JAX's `jit(f).lower(...).compile().as_text()`
print). Every instruction that runs as a kernel (a fusion, a dot, a copy,
a reduction, ...) reads each distinct operand once in full and writes its
result. Instructions that move nothing are skipped: parameters, constants,
bitcasts, tuples and their elements, optimization barriers. A `conditional`
is skipped too: its branches run only when taken, and the steps measured
here branch only to recover a norm that lost range.

`benchmarks/bench.py --only traffic` (TensorFlow) and
`benchmarks/jax_bench.py --only traffic` print the counts per parameter.
"""

import dataclasses
import re

_ELEMENT_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b(" + "|".join(_ELEMENT_BYTES) + r")\[([0-9,]*)\]")
_NAME = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
#: Opcodes that run no kernel and move no bytes.
MOVES_NOTHING = frozenset(
    {
        "parameter",
        "constant",
        "bitcast",
        "tuple",
        "get-tuple-element",
        "opt-barrier",
        "after-all",
        "conditional",
    }
)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes a program reads and writes (`read + written` is `total`)."""

    read: int
    written: int

    @property
    def total(self):
        return self.read + self.written


def array_bytes(shape_text):
    """Bytes of every array in `shape_text` (an HLO shape, tuples summed).

    >>> array_bytes("f32[3,4]{1,0}")
    48
    >>> array_bytes("(f32[], s64[2])")
    20
    """
    total = 0
    for element, dimensions in _ARRAY.findall(shape_text):
        count = 1
        for size in filter(None, dimensions.split(",")):
            count *= int(size)
        total += count * _ELEMENT_BYTES[element]
    return total


def _closing(text, start):
    """Index of the parenthesis that closes the one at `text[start]`."""
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "(":
            depth += 1
        elif text[index] == ")":
            depth -= 1
            if depth == 0:
                return index
    raise ValueError(f"Unbalanced parentheses in HLO line: {text!r}")


def _instructions(entry_lines):
    """`(name, result_bytes, opcode, operand names, is_root)` for each
    instruction of the entry computation."""
    for line in entry_lines:
        named = _NAME.match(line)
        if named is None:
            continue
        rest = line[named.end() :]
        if rest.startswith("("):  # a tuple shape
            shape_end = _closing(rest, 0) + 1
        else:
            shape_end = rest.index(" ")
        shape, rest = rest[:shape_end], rest[shape_end:]
        opcode = _OPCODE.match(rest)
        if opcode is None:
            raise ValueError(f"No opcode in HLO line: {line.strip()!r}")
        open_at = opcode.end() - 1
        operands = _OPERAND.findall(rest[open_at : _closing(rest, open_at)])
        yield (
            named.group(2),
            array_bytes(shape),
            opcode.group(1),
            operands,
            named.group(1) is not None,
        )


def entry_lines(hlo_text):
    """The lines of the entry computation of `hlo_text`."""
    lines = iter(hlo_text.splitlines())
    if not any(line.startswith("ENTRY") for line in lines):
        raise ValueError("The HLO text has no ENTRY computation.")
    body = []
    for line in lines:
        if line.startswith("}"):
            return body
        body.append(line)
    raise ValueError("The HLO text's ENTRY computation does not end.")


def traffic(hlo_text):
    """The `Traffic` of the entry computation of optimized HLO `hlo_text`.

    Each kernel reads each distinct operand in full once and writes its
    result; `MOVES_NOTHING` opcodes are skipped (see the module docstring).

    >>> text = '''ENTRY %main (x: f32[256]) -> f32[256] {
    ...   %x = f32[256]{0} parameter(0)
    ...   %two = f32[] constant(2)
    ...   ROOT %fusion = f32[256]{0} fusion(%x, %two, %x), kind=kLoop
    ... }'''
    >>> traffic(text)
    Traffic(read=1028, written=1024)
    """
    sizes = {}
    read = written = 0
    for name, result, opcode, operands, _ in _instructions(entry_lines(hlo_text)):
        sizes[name] = result
        if opcode in MOVES_NOTHING:
            continue
        read += sum(sizes[operand] for operand in dict.fromkeys(operands))
        written += result
    return Traffic(read, written)


def temporaries(hlo_text, at_least):
    """Names of the entry computation's buffers of `at_least` bytes or more
    that a kernel writes and that are not outputs of the program: values
    written to memory only to be read back within the step.

    >>> text = '''ENTRY %main (x: f32[256]) -> f32[256] {
    ...   %x = f32[256]{0} parameter(0)
    ...   %twice = f32[256]{0} fusion(%x), kind=kLoop
    ...   ROOT %out = f32[256]{0} fusion(%twice, %x), kind=kLoop
    ... }'''
    >>> temporaries(text, at_least=1024)
    ['twice']
    """
    found, outputs = [], set()
    for name, result, opcode, operands, root in _instructions(entry_lines(hlo_text)):
        found.append((name, result, opcode))
        if root:
            outputs = set(operands) if opcode == "tuple" else {name}
    return [
        name
        for name, result, opcode in found
        if result >= at_least and opcode not in MOVES_NOTHING and name not in outputs
    ]
