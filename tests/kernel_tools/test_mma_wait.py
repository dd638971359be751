"""`kernel_tools/mma_wait.py`: which K loops wait for their own MMA every step, on TTGIR of
both forms and of their pipelined counterparts, then on the compiled kernels (Triton's
compiler, no GPU): sm_100's FP4 GEMM keeps its MMA in flight, sm_90's FP8-chunk GEMM waits;
and the programs an SM holds by registers, shared memory and warps."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from compile_script import compiled

from vllm_mxplus.kernel_tools.mma_wait import programs_per_sm, waits_own_mma

HAS_TRITON = importlib.util.find_spec("triton") is not None
ROOT = Path(__file__).resolve().parents[2]

# sm_100, every step waits for the MMA it issued (the barrier made in the step)
TC5_SERIAL = """
    %r:3 = scf.for %i = %c0 to %n step %c1 iter_args(%u = %false) -> (i1) {
      %bar = ttg.local_alloc : () -> !ttg.memdesc<1xi64, #shared3, #smem, mutable>
      ttng.init_barrier %bar, 1 : !ttg.memdesc<1xi64, #shared3, #smem, mutable>
      ttng.tc_gen5_mma_scaled %a, %b, %acc, %sa, %sb, %u, %true lhs = e2m1 rhs = e2m1, %bar[%true] {is_async} : !ttg.memdesc<128x64xi8>
      ttng.wait_barrier %bar, %c0_i32, %true : !ttg.memdesc<1xi64, #shared3, #smem, mutable>
      scf.yield %true : i1
    }
"""
# pipelined: a step waits (at its start) for the barrier the previous step's MMA arrived on
TC5_PIPELINED = """
    %r:3 = scf.for %i = %c0 to %n step %c1 iter_args(%prev = %b0, %ph = %c0_i32) -> (...) {
      ttng.wait_barrier %prev, %ph deps %a0, %b0 : !ttg.memdesc<1xi64, #shared1, #smem, mutable>
      %t = ttng.tmem_load %part : !ttg.memdesc<128x128xf32> -> tensor<128x128xf32, #linear>
      %bar = ttg.memdesc_index %bars[%k] : !ttg.memdesc<2x1xi64> -> !ttg.memdesc<1xi64>
      ttng.tc_gen5_mma_scaled %a, %b, %part, %sa, %sb, %false, %true lhs = e2m1 rhs = e2m1, %bar[%true] {is_async} : !ttg.memdesc<128x64xi8>
      scf.yield %bar, %ph2 : !ttg.memdesc<1xi64>, i32
    }
    ttng.wait_barrier %r#0, %r#1 : !ttg.memdesc<1xi64, #shared1, #smem, mutable>
"""
WGMMA = """
    %r = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %z) -> (tensor<128x128xf32, #mma>) {
      %d = ttng.warp_group_dot %a, %b, %z {inputPrecision = 0 : i32, isAsync = true} : !ttg.memdesc<128x128xf8E4M3FN>
      %w:3 = ttng.warp_group_dot_wait %d, %a, %b {pendings = PENDING : i32} : tensor<128x128xf32, #mma>
      scf.yield %w#0 : tensor<128x128xf32, #mma>
    }
"""


def test_tcgen05_step_waiting_for_its_own_mma():
    assert waits_own_mma(TC5_SERIAL)


def test_tcgen05_pipelined_step_does_not():
    """Waiting for the previous step's barrier (carried by the loop) or after the loop is
    what a pipelined MMA does."""
    assert not waits_own_mma(TC5_PIPELINED)


def test_wgmma_waits_for_all_or_keeps_one_in_flight():
    assert waits_own_mma(WGMMA.replace("PENDING", "0"))
    assert not waits_own_mma(WGMMA.replace("PENDING", "1"))


def test_a_wait_after_the_loop_is_not_the_steps():
    """wgmma in one loop, its wait for all after the loop's yield: not a step's wait."""
    text = WGMMA.replace("PENDING", "1") + (
        "    %f = ttng.warp_group_dot_wait %r {pendings = 0 : i32} : tensor<128x128xf32>\n"
    )
    assert not waits_own_mma(text)


def test_programs_per_sm_by_registers_shared_memory_and_warps():
    # 194 registers -> 200 per thread x 256 threads: one program of 8 warps
    assert programs_per_sm(194, 8, 40_000, 100) == 1
    # 178 -> 184 x 128 threads: two of 4 warps by registers
    assert programs_per_sm(178, 4, 55_000, 100) == 2
    # shared memory decides: 3 x (75 KB + 1 KB) fits 228 KB, 4 do not
    assert programs_per_sm(32, 4, 75 * 1024, 90) == 3
    # warp slots decide: 64 warps per SM
    assert programs_per_sm(16, 16, 0, 90) == 4
    # never 0: a kernel that launches has one
    assert programs_per_sm(255, 32, 300_000, 90) == 1


# compiles cases of the static model and prints, per case, whether tcgen05.cp carries the
# scales and whether a step waits for its own MMA
COMPILE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from benchmarks import gpu_static_model as gsm
from vllm_mxplus.kernel_tools.mma_wait import waits_own_mma
out = {}
for arch, case in json.loads(sys.argv[2]):
    role, unit, drive = gsm._cases()[case]
    ck, _ = gsm._compile(gsm._capture(drive, arch), arch)
    text = ck.asm["ttgir"]
    out[case] = {"copy": "ttng.tmem_copy" in text, "waits": waits_own_mma(text)}
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_compiled_kernels(tmp_path):
    """sm_100's FP4 GEMM: its scales reach tensor memory by `tcgen05.cp` (`scale_rows`), so
    no step waits for its own MMA (with the scales through registers, as before, every step
    did). sm_90's FP8-chunk GEMM reads each chunk's product for the MBS promotion, which
    Triton 3.7 compiles to a wgmma wait for all in every step: the detector sees it."""
    cases = [(100, "prefill fp4 MBS-128"), (100, "prefill fp4 (no MBS)"),
             (90, "prefill fp8-chunk gemm")]  # fmt: skip
    out = compiled(COMPILE, tmp_path, [str(ROOT), json.dumps(cases)])
    for case in ("prefill fp4 MBS-128", "prefill fp4 (no MBS)"):
        assert out[case] == {"copy": True, "waits": False}, case
    assert out["prefill fp8-chunk gemm"]["waits"]
