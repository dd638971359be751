"""Programmatic dependent launch of the decode step (`launch.pdl_launch`): on sm_90 and later
the decode GEMM launches with `launch_pdl` and waits for the kernel before it at its first
instruction (PDL: `gemm_blocks.wait_prior_grid`, PTX griddepcontrol.wait), and the activation
quantizer that writes x_hat lets it start (TRIGGER: griddepcontrol.launch_dependents); not on
sm_80, not under the interpreter, not with VLLM_MXPLUS_GPU_PDL=0. Launches captured on meta
tensors; the compiled PTX from Triton's own compiler in a subprocess without the interpreter.
No GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
K, N = 4096, 4096


def _meta(*shape: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _decode_step(capability: int):
    """(the quantizer's launch, the decode GEMM's launch) of one 1-row linear on sm_<cap>."""
    from vllm_mxplus.backends.triton.act_quant import act_quant_hat
    from vllm_mxplus.backends.triton.decode_gemm import decode_gemm
    from vllm_mxplus.backends.triton.launch import capture_launches, last_gemm

    with capture_launches(capability) as quant:
        act_quant_hat(_meta(1, K, dtype=torch.bfloat16), "mxfp4-mbs-s", macro_block=128)
    with capture_launches(capability) as gemm:
        decode_gemm(_meta(1, K // 2), _meta(1, K // 16), _meta(1, K // 128), _meta(N, K // 2),
                    _meta(N, K // 16), _meta(N, K // 128), K, macro_block=128,
                    x_hat=_meta(1, K, dtype=torch.bfloat16), w_small_scales=True)  # fmt: skip
    return quant[-1], last_gemm(gemm)


def test_decode_step_launches_are_programmatic_dependent_from_sm90(monkeypatch):
    pytest.importorskip("triton")
    for cap in (90, 100):
        quant, gemm = _decode_step(cap)
        assert gemm.kwargs["PDL"] and gemm.kwargs["launch_pdl"], cap
        assert quant.kwargs["TRIGGER"], cap
    quant, gemm = _decode_step(80)  # no griddepcontrol before sm_90
    assert not gemm.kwargs["PDL"] and "launch_pdl" not in gemm.kwargs
    assert not quant.kwargs["TRIGGER"]
    monkeypatch.setenv("VLLM_MXPLUS_GPU_PDL", "0")
    quant, gemm = _decode_step(90)
    assert not gemm.kwargs["PDL"] and "launch_pdl" not in gemm.kwargs
    assert not quant.kwargs["TRIGGER"]
    monkeypatch.setenv("VLLM_MXPLUS_GPU_PDL", "maybe")
    with pytest.raises(ValueError, match="VLLM_MXPLUS_GPU_PDL"):
        _decode_step(90)


COMPILE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
from test_pdl_launch import _decode_step
from vllm_mxplus.kernel_tools.aot import compile_kernel, config_of

out = {}
for arch in (80, 90, 100):
    quant, gemm = _decode_step(arch)
    q, g = (compile_kernel(config_of(lc), arch) for lc in (quant, gemm))
    out[arch] = {"wait": g.asm["ptx"].count("griddepcontrol.wait"),
                 "gemm_pdl": bool(getattr(g.metadata, "launch_pdl", False)),
                 "trigger": q.asm["ptx"].count("griddepcontrol.launch_dependents"),
                 "quant_wait": q.asm["ptx"].count("griddepcontrol.wait")}
print(json.dumps(out))
"""


def test_compiled_kernels_carry_the_grid_dependency_control(tmp_path):
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE, str(ROOT), str(Path(__file__).parent)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["80"] == {"wait": 0, "gemm_pdl": False, "trigger": 0, "quant_wait": 0}
    for arch in ("90", "100"):  # one wait at the GEMM's start, one trigger in the quantizer
        assert out[arch] == {"wait": 1, "gemm_pdl": True, "trigger": 1, "quant_wait": 0}, arch
