"""The CPU kernels built for each instruction set (VLLM_MXPLUS_CPU_MARCH), every scheme: the
AVX2 kernel (x86-64-v3), the AVX-512 kernel without VNNI / VBMI (skylake-avx512) and the
portable C++ (x86-64) give the activation codes of `formats` bit for bit and outputs within
the same bounds as the native build (tests/backends/cpu/test_cpu_kernels.py, test_cpu_kernels_nvfp4.py,
test_cpu_kernels_mxplus.py), bf16 and fp16 outputs rounded as torch rounds (test_cpu_linear.py),
and the E8M0 schemes' outputs bit for bit with the fp32 model of the
kernels' operations (test_cpu_kernels_panel.py): every instruction set gives the same bits. One subprocess per target (one process loads one build of the ops);
builds are cached per -march like any other. A target this CPU cannot run is skipped with
the missing feature flags named (an AVX-512 build on an AVX2-only CPU would die of SIGILL).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mxplus.platform_amx import cpu_flags, read_cpuinfo

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")
HERE = Path(__file__).resolve().parent

_SCRIPT = r"""
import sys
import torch
sys.path[:0] = sys.argv[1:]  # tests/backends/cpu and tests/backends (bound_helpers)
import test_cpu_kernels as t
import test_cpu_kernels_mxplus as tm
import test_cpu_kernels_nvfp4 as tn
import test_cpu_kernels_panel as tp
from vllm_mxplus.formats import MACRO_BLOCK, quantize
from vllm_mxplus.backends.cpu import kernels as ck
ok, why = ck.load()
assert ok, why
for wf, af in t.PAIRS:
    for k in (33, 577):
        q = quantize(t._weight(k, n=21, seed=k) * 0.05, wf)
        assert t._bits_equal(ck.dequant_weight(q), q.dequantize())
        x = t._special_rows(torch.randn(11, k) * 3)[[8, 9, 10, 4, 7, 1, 0, 2, 3, 5, 6]]
        codes, scales, mbs = ck.act_quant(x, af, MACRO_BLOCK)
        assert torch.equal(codes, t._doubled_values(quantize(x, af).codes, k)), (af, k)
        assert t._bits_equal(ck.act_fake_quant(x, af, MACRO_BLOCK), t.fake_quantize(x, af))
        for m in (1, 3, 9, 11):
            y = ck.mx_linear(
                x[:m], wf, af, q.codes, q.scales, q.mbs, k, None, torch.float32, MACRO_BLOCK
            )
            t._assert_within_bound(y, t._reference(x[:m], q, af, None), torch.float32, k, wf, af)
for k in (33, 577):
    q = quantize(tn._weight(21, k, k), "nvfp4")
    x = tn._special_rows(torch.randn(11, k) * 3)[[8, 9, 10, 4, 7, 6, 1, 0, 2, 3, 5]]
    assert torch.equal(ck.nvfp4_act_quant(x)[0], tn._doubled(quantize(x, "nvfp4", per_row=True).codes, k))
    for m in (1, 3, 9, 11):
        y = ck.nvfp4_linear_packed(x[:m], 21, k, *ck.pack_nvfp4(q), None, torch.float32)
        tn._check(y, x[:m], q, None)
for k in (33, 577):
    q = quantize(tm.weight(21, k, k), "mxplus")
    x = tm.special_rows(torch.randn(12, k) * 3)[[9, 10, 11, 8, 4, 7, 1, 0, 2, 3, 5, 6]]
    codes, scales, _ = ck.act_quant(x, "mxplus", MACRO_BLOCK)
    assert torch.equal(codes, tm.doubled(quantize(x, "mxplus"), k)), ("mxplus", k)
    assert t._bits_equal(ck.act_fake_quant(x, "mxplus", MACRO_BLOCK), t.fake_quantize(x, "mxplus"))
    for m in (1, 3, 9, 12):
        y = ck.mxplus_linear_packed(x[:m], 21, k, *ck.pack_mxplus(q), None, torch.float32)
        tm.assert_within_bound(y, tm.reference(x[:m], q, None), k)
for scheme in ("mxfp4-mbs", "nvfp4", "mxplus"):  # x read in its own dtype (F16C or scalar)
    t.test_linear_reads_x_in_its_own_dtype_and_layout(ck, scheme, 40)
for pair in t.PAIRS:  # bit for bit with the fp32 model of the kernel's operations
    for m in (1, 5, 35, 66):
        tp.test_linear_bits_equal_model(ck, pair, m, 577)
for m in (4, 257):  # the register tiles and the panel kernel
    tp.test_plain_weights_take_the_fast_terms(ck, m)
for macro in (128, 256):  # the panel kernel's folded chunks
    tp.test_folded_chunks_bits_equal_model(ck, ("mxfp4-mbs-d", "mxfp4-mbs-s"), macro)
import test_cpu_linear as tl
for scheme in ("mxfp4-mbs", "nvfp4"):  # each task rounds its outputs (AVX-512, F16C or scalar)
    for odt in (torch.bfloat16, torch.float16):
        tl.test_bf16_and_fp16_outputs_are_the_fp32_outputs_rounded(scheme, odt, 40)
print("ISA-OK", ck.cflags()[0])
"""

# The CPU flags (as /proc/cpuinfo names them) that code built for each target executes.
TARGETS = {
    "avx2": ("x86-64-v3", {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"}),
    "avx512-no-vnni": (
        "skylake-avx512",
        {"avx2", "fma", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    ),
    "portable": ("x86-64", set()),
}


def _cpu_flags() -> set[str]:
    return cpu_flags(read_cpuinfo()) or set()


@pytest.mark.slow  # one kernel build per instruction set: ~100 s each on 2 cores
@pytest.mark.parametrize("target", list(TARGETS))
def test_instruction_set(target):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("these -march targets only exist on x86-64")
    march, needs = TARGETS[target]
    missing = sorted(needs - _cpu_flags())
    if missing:
        pytest.skip(f"this CPU cannot run -march={march} code: no {', '.join(missing)}")
    env = dict(os.environ, VLLM_MXPLUS_CPU_MARCH=march, OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(HERE), str(HERE.parent)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0 and f"ISA-OK -march={march}" in r.stdout, r.stdout + r.stderr
