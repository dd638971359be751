"""A check on compiled Triton code: inline assembly that packs several elements per call sees
them in the order the kernel assumes.

`tl.inline_asm_elementwise(..., pack=P)` hands each call P elements of the thread's
registers, "which set of inputs a block receives is unspecified" (Triton's documentation):
they are P consecutive elements of the tensor only where the layout the compiler chose gives
each thread runs of P consecutive elements along the tensor's last dimension. A kernel whose
asm reads P packed bytes as one word of the row (`cutlass.fp8_packed_gemm`: four code bytes,
eight consecutive E2M1 codes) would compute wrong values, silently, under another layout.
This module reads the layouts from the TTGIR Triton compiled and names every packed
`tt.elementwise_inline_asm` whose operands are not in such a layout; the ahead-of-time
compile (`aot.compile_config`) fails a configuration on any.
"""

from __future__ import annotations

import re

_LAYOUT = re.compile(r"^(#\w+) = #ttg\.(\w+)<\{(.*)\}>", re.M)
_ASM = re.compile(
    r"tt\.elementwise_inline_asm .*?packed_element = (\d+).*?\} (.*?) : (.*?) -> ", re.S
)
_TENSOR = re.compile(r"tensor<([0-9x]+)x\w+, (#\w+)>")


def _ints(text: str, key: str) -> list[int] | None:
    m = re.search(key + r" = \[([0-9, ]*)\]", text)
    return [int(v) for v in m.group(1).split(",") if v.strip()] if m else None


def layouts(ttgir: str) -> dict[str, tuple[str, str]]:
    """#name -> (kind, body) of every layout the TTGIR defines."""
    return {m.group(1): (m.group(2), m.group(3)) for m in _LAYOUT.finditer(ttgir)}


def packed_asm_problems(ttgir: str) -> list[str]:
    """One line per packed inline-asm operand whose layout does not give each thread runs of
    `packed_element` consecutive elements along the last dimension (empty: all are fine)."""
    defs = layouts(ttgir)
    out = []
    for m in _ASM.finditer(ttgir):
        pack = int(m.group(1))
        if pack == 1:
            continue
        for shape, name in _TENSOR.findall(m.group(3)):
            rank = len(shape.split("x"))
            kind, body = defs.get(name, ("?", ""))
            spt, order = _ints(body, "sizePerThread"), _ints(body, "order")
            if kind != "blocked" or spt is None or order is None:
                out.append(f"pack={pack} asm on a {kind} layout {name}: runs not checked")
            elif order[0] != rank - 1 or spt[-1] % pack:
                out.append(
                    f"pack={pack} asm on {name} (sizePerThread {spt}, order {order}): a "
                    f"call's {pack} elements are not consecutive along the last dimension"
                )
    return out
