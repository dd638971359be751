"""The packed inline-asm layout check (`kernel_tools.asm_packs`): on TTGIR written by hand (a
run of 16 bytes per thread passes; runs of 2, the wrong fastest dimension and a linear
layout are named), and on the packed-weight FP8 GEMM as Triton compiles it for sm_90 and
sm_100 (its PRMT sequence reads four consecutive code bytes per call). No GPU: Triton's own
compiler, in a subprocess without the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mxplus.kernel_tools.asm_packs import packed_asm_problems

ROOT = Path(__file__).resolve().parents[2]

TTGIR = """#blocked = #ttg.blocked<{sizePerThread = [1, 16], threadsPerWarp = [8, 4], warpsPerCTA = [8, 1], order = [1, 0]}>
#blocked1 = #ttg.blocked<{sizePerThread = [1, 2], threadsPerWarp = [8, 4], warpsPerCTA = [8, 1], order = [1, 0]}>
#blocked2 = #ttg.blocked<{sizePerThread = [4, 4], threadsPerWarp = [8, 4], warpsPerCTA = [8, 1], order = [0, 1]}>
#linear = #ttg.linear<{register = [[0, 4], [0, 1]], lane = [], warp = [], block = []}>
module {
  %a:2 = tt.elementwise_inline_asm "x" {constraints = "=r,r", packed_element = 4 : i32, pure = true} %cb : tensor<128x64xi8, LAYOUT> -> tensor<128x64xi8, LAYOUT> loc(#loc1)
  %f = tt.elementwise_inline_asm "y" {constraints = "=f,f", packed_element = 1 : i32, pure = true} %x : tensor<128xf32, #linear> -> tensor<128xf32, #linear> loc(#loc2)
}
"""


@pytest.mark.parametrize(
    "layout,problem",
    [("#blocked", None), ("#blocked1", "not consecutive"), ("#blocked2", "not consecutive"),
     ("#linear", "runs not checked")],
)  # fmt: skip
def test_layouts_by_hand(layout, problem):
    found = packed_asm_problems(TTGIR.replace("LAYOUT", layout))
    if problem is None:
        assert found == []
    else:
        assert found and all(problem in p and layout in p for p in found)


COMPILE = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from vllm_mxplus.backends.cutlass.fp8_packed_gemm import fp8_packed_gemm
from vllm_mxplus.backends.triton.launch import capture_launches
from vllm_mxplus.kernel_tools.aot import compile_kernel, config_of
from vllm_mxplus.kernel_tools.asm_packs import packed_asm_problems

def meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")

out = {}
for arch in (90, 100):
    with capture_launches(arch) as launches:
        fp8_packed_gemm(meta((256, 512), torch.float8_e4m3fn), meta((4, 256), torch.float32),
                        meta((384, 256), torch.uint8), meta((384, 32), torch.uint8),
                        meta((384, 4), torch.uint8), 512, None, torch.bfloat16)
    ck = compile_kernel(config_of(launches[0]), arch)
    ttgir = ck.asm["ttgir"]
    out[arch] = {"problems": packed_asm_problems(ttgir),
                 "packed": ttgir.count("packed_element = 4")}
print(json.dumps(out))
"""


@pytest.mark.slow  # Triton compiles for sm_90 and sm_100: ~1-2 min
def test_packed_weight_gemm_compiles_to_word_runs(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", COMPILE, str(ROOT)], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for arch in ("90", "100"):
        assert res[arch]["packed"] == 1, "the PRMT sequence is in the compiled kernel"
        assert res[arch]["problems"] == [], res[arch]["problems"]
