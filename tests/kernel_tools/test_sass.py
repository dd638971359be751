"""The machine-code counter (`kernel_tools.sass`) that `benchmarks/gpu_static_model.py`
builds on: exact counts on a hand-written listing, and on toy Triton kernels compiled for
sm_90 with a known loop (one load per element against two; a tl.dot loop on the tensor
cores). Compiles with Triton's bundled ptxas/nvdisasm: no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mxplus.kernel_tools import sass

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("triton")

LISTING = """
        .text.k:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   NOP ;
.L_x_1:
        /*0030*/                   HMMA.16816.F32.BF16 R8, R12, R14, R8 ;
        /*0040*/                   HMMA.16816.F32.BF16 R8, R16, R18, R8 ;
        /*0050*/              @!P0 BRA `(.L_x_1) ;
        /*0060*/                   IADD3 R4, P1, R4, 0x80, RZ ;
        /*0070*/              @!P1 BRA `(.L_x_0) ;
        /*0080*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0090*/                   EXIT ;
"""


def test_listing_loops_and_counts():
    code = sass.parse(LISTING)
    assert code.labels == {".L_x_0": 0x10, ".L_x_1": 0x30, ".L_x_2": 0x90}
    loops = {(lp.start, lp.end): lp for lp in code.loops()}
    assert set(loops) == {(0x30, 0x50), (0x10, 0x70)}  # the forward BRA is no loop
    inner, outer = loops[(0x30, 0x50)], loops[(0x10, 0x70)]
    assert inner.count == 3 and inner.kinds() == {"HMMA": 2}
    assert outer.count == 6  # 7 instructions, the NOP not counted
    hot = code.hot_loop()
    assert hot is not None and (hot.start, hot.end) == (0x10, 0x70)  # same HMMAs, more work
    assert code.count() == 9 and code.kinds() == {"HMMA": 2}


# sm_100's pipelined loops wait on an mbarrier in a spin placed after the EXIT, which jumps
# back into the loop: that backward branch spans the epilogue and is not a loop
OUT_OF_LINE_WAIT = """
.L_x_11:
        /*0000*/                   UTCOMMA.4X gdesc[UR10], gdesc[UR12], tmem[UR9], tmem[UR6], idesc[UR7], tmem[UR20], UPT ;
        /*0010*/              @!P6 BRA `(.L_x_10) ;
.L_x_16:
        /*0020*/                   IADD3 R4, P1, R4, 0x80, RZ ;
        /*0030*/                   BRA.U UP0, `(.L_x_11) ;
        /*0040*/                   F2FP.BF16.F32.PACK_AB R2, R3, R2 ;
        /*0050*/                   STG.E desc[UR4][R6.64], R2 ;
        /*0060*/              @P0 EXIT ;
        /*0070*/                   STG.E desc[UR4][R8.64], R2 ;
        /*0080*/                   EXIT ;
.L_x_10:
        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P6, [UR8+0x8], R3 ;
        /*00a0*/              @!P6 BRA `(.L_x_10) ;
        /*00b0*/                   BRA `(.L_x_16) ;
"""


def test_out_of_line_wait_is_no_loop():
    code = sass.parse(OUT_OF_LINE_WAIT)
    spans = {(lp.start, lp.end) for lp in code.loops()}
    assert spans == {(0x00, 0x30), (0x90, 0xA0)}  # not (0x20, 0xB0): it holds the EXIT
    hot = code.hot_loop()
    assert hot is not None and (hot.start, hot.end) == (0x00, 0x30) and hot.count == 4


PACKED = """
.L_x_3:
        /*0000*/                   LDTM.x64 R4, tmem[UR8] ;
        /*0010*/                   FMUL2 R70, R70.F32x2.HI_LO, R235.F32 ;
        /*0020*/                   FFMA2 R152, R70.F32x2.HI_LO, R22.F32x2.HI_LO, R152.F32x2.HI_LO ;
        /*0030*/                   FFMA R8, R9, R10, R8 ;
        /*0040*/                   FADD R8, R8, R11 ;
        /*0050*/                   IMAD R12, R12, 0x200, R5 ;
        /*0060*/                   HFMA2 R13, R14, R15, R13 ;
        /*0070*/                   BRA.U UP0, `(.L_x_3) ;
"""


def test_fp32_lane_cycles_count_packed_work_twice():
    """FMUL2 and FFMA2 take one issue slot and two FP32-lane cycles each, FFMA and FADD one;
    IMAD, HFMA2 (the half-precision pipe) and the rest none."""
    (lp,) = sass.parse(PACKED).loops()
    assert lp.count == 8
    assert lp.fp32_cycles == 2 + 2 + 1 + 1


def test_opcode_strips_predicate_and_modifiers():
    ins = sass.Instr(0, "@!P1 LDG.E.128 R4, desc[UR4][R2.64]")
    assert ins.opcode == "LDG" and not ins.tensor_core
    assert sass.Instr(0, "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24").tensor_core


TOY = r"""
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_mxplus.kernel_tools import sass


@triton.jit
def one_load(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(n):
        acc += tl.load(x_ptr + i * BLOCK + offs)
    tl.store(out_ptr + offs, acc)


@triton.jit
def two_loads(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for i in range(n):
        acc += tl.load(x_ptr + i * BLOCK + offs) * tl.load(y_ptr + i * BLOCK + offs)
    tl.store(out_ptr + offs, acc)


@triton.jit
def dot_loop(a_ptr, b_ptr, c_ptr, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK), tl.float32)
    for i in range(n):
        a = tl.load(a_ptr + i * BLOCK * BLOCK + r[:, None] * BLOCK + r[None, :])
        b = tl.load(b_ptr + i * BLOCK * BLOCK + r[:, None] * BLOCK + r[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + r[:, None] * BLOCK + r[None, :], acc)


def hot(kernel, signature, constexprs):
    ck = triton.compile(ASTSource(kernel, signature, constexprs),
                        target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    lp = sass.parse(sass.disassemble(ck.asm["cubin"])).hot_loop()
    return {"count": lp.count, "ldg": lp.opcodes("LDG"), "kinds": lp.kinds()}


f32 = {"out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
print(json.dumps({
    "one": hot(one_load, {"x_ptr": "*fp32", **f32}, {"BLOCK": 128}),
    "two": hot(two_loads, {"x_ptr": "*fp32", "y_ptr": "*fp32", **f32}, {"BLOCK": 128}),
    "dot": hot(dot_loop, {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "n": "i32",
                          "BLOCK": "constexpr"}, {"BLOCK": 32}),
}))
"""


def test_toy_kernels_on_sm90(tmp_path):
    """Compiled in a child without TRITON_INTERPRET (the suite interprets kernels); @jit
    wants its source in a file."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    script = tmp_path / "toy_kernels.py"
    script.write_text(TOY)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    one, two, dot = got["one"], got["two"], got["dot"]
    # the same unrolling, twice the loads per iteration; no tensor cores
    assert one["ldg"] > 0 and two["ldg"] == 2 * one["ldg"], got
    assert two["count"] > one["count"] and one["kinds"] == {} == two["kinds"], got
    # a 32x32x32 bf16 tile per iteration on 4 warps: 4 mma.sync m16n8k16
    assert dot["kinds"] == {"HMMA": 4}, got
