"""Programmatic dependent launch (`launch.pdl_launch`) of the decode step and of the prefill
pipelines after their GEMM-side kernels. The decode step: on sm_90 and later
the decode GEMM launches with `launch_pdl` and waits for the kernel before it at its first
instruction (PDL: `gemm_blocks.wait_prior_grid`, PTX griddepcontrol.wait), and the activation
quantizer that writes x_hat lets it start (TRIGGER: griddepcontrol.launch_dependents); not on
sm_80, not under the interpreter, not with VLLM_MXPLUS_GPU_PDL=0. Launches captured on meta
tensors; the compiled PTX from Triton's own compiler in a subprocess without the interpreter.
No GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compile_script import compiled

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


def _compiled(script: str, tmp_path: Path) -> dict:
    """The JSON a compile script prints, run without the interpreter (Triton's compiler)."""
    return compiled(script, tmp_path, [str(ROOT), str(Path(__file__).parent)])


def test_compiled_kernels_carry_the_grid_dependency_control(tmp_path):
    out = _compiled(COMPILE, tmp_path)
    assert out["80"] == {"wait": 0, "gemm_pdl": False, "trigger": 0, "quant_wait": 0}
    for arch in ("90", "100"):  # one wait at the GEMM's start, one trigger in the quantizer
        assert out[arch] == {"wait": 1, "gemm_pdl": True, "trigger": 1, "quant_wait": 0}, arch


def _prefill_chain(capability: int) -> dict:
    """{kernel name: its launch} of sm_100's FP4 pipeline after its quantizer (relative
    scales, the FP4 GEMM with K split, its sum, the fallback's row list and rows GEMM) and
    of the FP8 GEMM before that row list, on meta tensors."""
    from vllm_mxplus.backends.triton.fp4_rel_scales import aligned_rows, rel_scales
    from vllm_mxplus.backends.triton.fp4_scaled_gemm import fp4_scaled_gemm
    from vllm_mxplus.backends.triton.fp8_chunk_gemm import fp8_chunk_gemm
    from vllm_mxplus.backends.triton.launch import capture_launches
    from vllm_mxplus.backends.triton.mx_gemm import mx_gemm_rows

    m, meta = 256, torch.device("meta")

    def fp4_op(rows: int):
        return (_meta(rows, K // 2), aligned_rows(rows, K // 16, torch.uint8, meta),
                aligned_rows(K // 128, rows, torch.float32, meta))  # fmt: skip

    def packed(rows: int):
        return _meta(rows, K // 2), _meta(rows, K // 16), _meta(rows, K // 128), None

    with capture_launches(capability) as launches:
        if capability >= 100:
            rel_scales(_meta(m, K // 16), _meta(m, K // 128), K, 16, per_chunk=True)
            fp4_scaled_gemm(fp4_op(m), fp4_op(N), K, None, torch.bfloat16, True, split_k=2)
        fp8 = _meta(m, K, dtype=torch.float8_e4m3fn)
        fp8_chunk_gemm(fp8, _meta(K // 128, m, dtype=torch.float32),
                       _meta(N, K, dtype=torch.float8_e4m3fn),
                       _meta(K // 128, N, dtype=torch.float32), None, torch.bfloat16)  # fmt: skip
        mx_gemm_rows(_meta(m, N, dtype=torch.bfloat16), _meta(m, dtype=torch.bool), packed(m),
                     packed(N), K, fmt="e8m0", block_size=16, macro_block=128)  # fmt: skip
    return {lc.kernel.__name__: lc for lc in launches}


# kernel -> (griddepcontrol.wait, griddepcontrol.launch_dependents) in its sm_90+ PTX: each
# dependent launch waits first; each kernel a dependent launch follows lets it start
CHAIN = {
    "_rel_scales_kernel": (1, 1),
    "_fp4_scaled_gemm_kernel": (1, 1),
    "_finish_kernel": (1, 1),
    "_fp8_chunk_gemm_kernel": (0, 1),
    "_list_rows_kernel": (1, 1),
    "_mx_gemm_kernel": (1, 0),
}

COMPILE_CHAIN = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[2])
from test_pdl_launch import _prefill_chain
from vllm_mxplus.kernel_tools.aot import compile_kernel, config_of

out = {}
for arch in (90, 100):
    for name, lc in _prefill_chain(arch).items():
        ptx = compile_kernel(config_of(lc), arch).asm["ptx"]
        out[f"{arch}:{name}"] = [ptx.count("griddepcontrol.wait"),
                                 ptx.count("griddepcontrol.launch_dependents"),
                                 bool(lc.kwargs.get("launch_pdl"))]
print(json.dumps(out))
"""


def test_prefill_pipelines_chain_their_launches(monkeypatch):
    """The captured launches: every kernel after the FP4 pipeline's quantizer is a dependent
    launch (PDL, `launch_pdl`) that lets the next one start (TRIGGER), the row list and the
    rows GEMM after the FP8 GEMM too (which triggers); none of it on sm_80 or with
    VLLM_MXPLUS_GPU_PDL=0."""
    pytest.importorskip("triton")
    for cap in (90, 100):
        chain = _prefill_chain(cap)
        assert set(chain) == set(CHAIN) if cap == 100 else set(chain) < set(CHAIN)
        for name, lc in chain.items():
            wait, trigger = CHAIN[name]
            assert bool(lc.kwargs.get("PDL")) == bool(wait) == bool(lc.kwargs.get("launch_pdl"))
            assert bool(lc.kwargs.get("TRIGGER")) == bool(trigger), name
    for chain in (_prefill_chain(80), None):
        if chain is None:
            monkeypatch.setenv("VLLM_MXPLUS_GPU_PDL", "0")
            chain = _prefill_chain(100)
        for lc in chain.values():
            assert not lc.kwargs.get("PDL") and not lc.kwargs.get("TRIGGER")
            assert "launch_pdl" not in lc.kwargs


def test_prefill_chain_ptx_carries_the_grid_dependency_control(tmp_path):
    out = _compiled(COMPILE_CHAIN, tmp_path)
    assert len(out) == len(CHAIN) + 3  # sm_90: no FP4 MMA, the FP8 GEMM and the fallback
    for key, (wait, trigger, pdl) in out.items():
        want = CHAIN[key.split(":", 1)[1]]
        assert (wait, trigger) == want and pdl == bool(want[0]), key
