"""Read a compiled kernel's machine code: the hot loop's instruction count, the tensor-core
instruction kinds, registers and spills (`benchmarks/gpu_static_model.py` builds its
estimates from these facts).

A Triton kernel is compiled for a target (`aot.compile_config`'s path, keeping the cubin),
disassembled with the `nvdisasm` that Triton's wheel ships, and parsed: every instruction
with its address, every label, and the loops, which in SASS are the backward branches (a
`BRA` to a label at or before it). The hot loop is the loop holding the most tensor-core
instructions (the most instructions when there is none); its instruction count (NOPs
excluded) is what one warp issues per iteration; its FP32-pipe cycles (`FP32_PIPE`) what
it asks of the FP32 lanes, which bound a loop of packed FP32 arithmetic before its issue
slots do. Tensor-core kinds: HMMA (mma.sync, any
generation), HGMMA / QGMMA (Hopper wgmma), UTC*MMA (Blackwell tcgen05), IMMA (integer).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+|\.L_\w+):")
_TARGET = re.compile(r"`\((\.L_[\w]+)\)")
# cycles of one SM sub-partition's 32 FP32 lanes per warp-instruction: sm_100's packed
# FFMA2 / FMUL2 / FADD2 take one issue slot but do two lanes' work (Blackwell's FP32 peak is
# 128 FMAs per SM and clock, as Hopper's: B200's published ~75-80 TFLOPS over 148 SMs at
# 1.965 GHz); other instructions on that pipe (IMAD's share of it) are not counted
FP32_PIPE = {"FFMA": 1, "FMUL": 1, "FADD": 1, "FFMA2": 2, "FMUL2": 2, "FADD2": 2}
TENSOR_CORE = ("HMMA", "HGMMA", "QGMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA", "UTCMMA", "IMMA")


@dataclass(frozen=True)
class Instr:
    addr: int
    text: str  # predicate, opcode and operands as nvdisasm prints them

    @property
    def opcode(self) -> str:
        """The mnemonic without its predicate and modifiers (`@!P1 BRA` -> `BRA`)."""
        words = [w for w in self.text.split() if not w.startswith("@")]
        return words[0].split(".")[0] if words else ""

    @property
    def tensor_core(self) -> bool:
        return self.opcode in TENSOR_CORE


@dataclass
class Loop:
    start: int  # address of the branch target (the loop head)
    end: int  # address of the backward branch
    body: list[Instr] = field(default_factory=list)

    @property
    def count(self) -> int:
        """Instructions one warp issues per iteration (NOPs excluded)."""
        return sum(1 for i in self.body if i.opcode != "NOP")

    @property
    def fp32_cycles(self) -> int:
        """Cycles of the FP32 lanes one warp takes per iteration (`FP32_PIPE`)."""
        return sum(FP32_PIPE.get(i.opcode, 0) for i in self.body)

    def kinds(self) -> dict[str, int]:
        """Tensor-core instructions in the body by opcode."""
        out: dict[str, int] = {}
        for i in self.body:
            if i.tensor_core:
                out[i.opcode] = out.get(i.opcode, 0) + 1
        return out

    def opcodes(self, *names: str) -> int:
        return sum(1 for i in self.body if i.opcode in names)


@dataclass
class Sass:
    instrs: list[Instr]
    labels: dict[str, int]

    def loops(self) -> list[Loop]:
        """Every backward branch as a loop [target, branch], its body the instructions
        between (inner loops included); not a branch whose span holds an unpredicated EXIT
        (the return jump of an out-of-line wait loop)."""
        out = []
        for ins in self.instrs:
            if ins.opcode != "BRA":
                continue
            m = _TARGET.search(ins.text)
            if not m or m.group(1) not in self.labels:
                continue
            head = self.labels[m.group(1)]
            if head <= ins.addr:
                body = [i for i in self.instrs if head <= i.addr <= ins.addr]
                # a wait loop placed after the function's end (sm_100's mbarrier try-wait
                # spins) jumps back into the main code: its "body" would hold the EXIT
                if not any(i.text.split()[0] == "EXIT" for i in body):
                    out.append(Loop(head, ins.addr, body))
        return out

    def hot_loop(self) -> Loop | None:
        """The loop with the most tensor-core instructions, then the most instructions;
        None for straight-line code."""
        loops = self.loops()
        if not loops:
            return None
        return max(loops, key=lambda lp: (sum(lp.kinds().values()), lp.count))

    def count(self) -> int:
        return sum(1 for i in self.instrs if i.opcode != "NOP")

    @property
    def fp32_cycles(self) -> int:
        return Loop(0, 0, self.instrs).fp32_cycles

    def kinds(self) -> dict[str, int]:
        return Loop(0, 0, self.instrs).kinds()


def parse(text: str) -> Sass:
    """nvdisasm output (one kernel) -> instructions and labels (label -> the address of the
    instruction after it)."""
    instrs: list[Instr] = []
    pending: list[str] = []
    labels: dict[str, int] = {}
    for line in text.splitlines():
        lm = _LABEL.match(line)
        if lm:
            pending.append(lm.group(1))
            continue
        im = _INSTR.search(line)
        if im:
            ins = Instr(int(im.group(1), 16), im.group(2).strip())
            for name in pending:
                labels[name] = ins.addr
            pending = []
            instrs.append(ins)
    return Sass(instrs, labels)


def nvdisasm_path() -> str:
    """The nvdisasm of Triton's wheel (or the one on PATH)."""
    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    path = os.path.join(bundled, "nvdisasm")
    return path if os.path.exists(path) else "nvdisasm"


def disassemble(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run(
            [nvdisasm_path(), "-c", path], capture_output=True, text=True, timeout=120
        )
    if proc.returncode:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr.strip()[-400:]}")
    return proc.stdout
