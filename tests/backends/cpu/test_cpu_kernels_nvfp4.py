"""NVFP4 on the CPU integer path (csrc/mx_nvfp4_cpu.cpp) against `vllm_mxplus.formats`: the
activation codes, E4M3 scale bytes and per-row global scales bit for bit; the linear within
its derived bound of the float64 product of the spec's values.

The bound (csrc/mx_nvfp4_cpu.cpp; docs/numerics.md, "Kernel numerics and error bounds"):
with x_hat, w_hat the spec's fp32 values (x_hat = (value * s) * g), y64 their float64
product plus the bias, u = 2^-24 and n_b blocks in K,
    |y - y64| <= (n_b + 6) u (|x_hat| |w_hat|^T + |b|) + 2^-146 n_b ga gw
(block sums are exact integers and each block term I * (sa * sw) is exact before one FMA;
2u for the spec's roundings of x_hat and w_hat, n_b + 1 additions, 2u for (ga * gw) and the
final multiply, u for second-order terms; the absolute term covers an underflowing ga * gw).
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from vllm_mxplus.backends.reference.linear import fake_quant_nvfp4_rows
from vllm_mxplus.formats import fake_quantize, quantize
from vllm_mxplus.formats.constants import ceil_div
from vllm_mxplus.formats.e2m1 import e2m1_decode, unpack_fp4

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")


def _special_rows(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    x[1, k // 2] = float("nan")
    x[2, 0] = -float("inf")  # a NaN block; the row's global scale ignores it
    x[3] = 0.0
    x[4] *= 1e-30
    x[5, : min(k, 20)] = 3.0e38
    x[6, : min(k, 16)] = 0.0  # a zero block in a live row
    x[7] = torch.linspace(-3, 3, k) * 2.0**100
    return x


def _doubled(codes: torch.Tensor, k: int) -> torch.Tensor:
    return (2 * e2m1_decode(unpack_fp4(codes, k))).to(torch.int8)


@pytest.mark.parametrize("k", [1, 15, 17, 33, 100, 577, 1536], ids=lambda k: f"K{k}")
def test_act_quant_bit_exact(ck, k):
    g = torch.Generator().manual_seed(k)
    x = _special_rows(torch.randn(9, k, generator=g) * torch.logspace(-6, 6, 9)[:, None])
    codes, scales, gs = ck.nvfp4_act_quant(x)
    q = quantize(x, "nvfp4", per_row=True)
    assert torch.equal(codes, _doubled(q.codes, k))
    assert torch.equal(scales, q.scales.view(torch.uint8))
    assert torch.equal(gs.view(torch.int32), q.global_scale.reshape(-1).view(torch.int32))


def test_act_quant_all_bf16_patterns(ck):
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x.reshape(-1, 1024)
    codes, scales, gs = ck.nvfp4_act_quant(x)
    q = quantize(x, "nvfp4", per_row=True)
    assert torch.equal(codes, _doubled(q.codes, 1024))
    assert torch.equal(scales, q.scales.view(torch.uint8))


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 3, k)[None, :].clamp(1e-2, 1e2)
    w[0, : min(k, 16)] *= 1e-6  # E4M3 subnormal block scales
    w[3, : min(k, 7)] = 0.0
    w[4, : min(k, 16)] = 0.0
    w[5, k // 2] = float("nan")
    w[6, -1] = float("inf")
    return w * 0.05


def _check(y, x, q, bias, act_g=None):
    xq = (
        fake_quantize(x, "nvfp4", per_row=True)
        if act_g is None
        else fake_quant_nvfp4_rows(x, act_g)
    ).double()
    w = q.dequantize().double()
    ref = xq @ w.T + (0 if bias is None else bias.double())
    scale = xq.abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    n_b = ceil_div(x.shape[-1], 16)
    _, _, ga = torch.ops.vllm_mxplus.cpu_nvfp4_act_quant(x)
    if act_g is not None:
        ga = act_g.reshape(-1)
    gw = q.global_scale.double().reshape(-1)
    bound = (n_b + 6) * 2.0**-24 * scale + 2.0**-146 * n_b * ga.double()[:, None] * gw
    nan_ref = torch.isnan(ref)
    assert torch.equal(torch.isnan(y), nan_ref), "NaN pattern differs"
    err = (y.double() - ref).abs()
    bad = ~nan_ref & ~(err <= bound)
    assert not bad.any(), (
        f"{int(bad.sum())} outputs out of bound: err {err[bad].max():.3g}, "
        f"bound {bound[bad].min():.3g}"
    )
    assert (~nan_ref).float().mean() > 0.3


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16, 17, 64, 333], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k", [33, 577, 1536], ids=lambda k: f"K{k}")
def test_linear_matches_float64(ck, m, k):
    g = torch.Generator().manual_seed(m * 1000 + k)
    q = quantize(_weight(45, k, m + k), "nvfp4")
    x = _special_rows(torch.randn(max(m, 9), k, generator=g) * 3)
    x = x[([8, 4, 7, 6, 1, 0, 2, 3, 5] + list(range(9, m)))[:m]].to(torch.bfloat16)
    bias = torch.randn(45, generator=g)
    y = ck.nvfp4_linear_packed(x, 45, k, *ck.pack_nvfp4(q), bias, torch.float32)
    _check(y, x, q, bias)


def test_given_row_global_scales_and_per_row_weight_scales(ck):
    """Row-parallel shards pass the whole row's global scale; fused weights carry one global
    scale per logical weight (here per row)."""
    k = 200
    w = torch.randn(40, k) * 0.05
    w[20:] *= 30.0
    q = quantize(w, "nvfp4", per_row=True)
    x = torch.randn(5, k)
    act_g = torch.rand(5, 1) * 0.01 + 1e-3
    y = ck.nvfp4_linear_packed(x, 40, k, *ck.pack_nvfp4(q), None, torch.float32, act_g)
    _check(y, x, q, None, act_g)


def test_bound_catches_a_wrong_scale(ck):
    """One block scale one E4M3 step up: outside the bound. Seeded, and a block below the
    largest scale (448 = 0x7E: one step up is NaN, which the check reports as a NaN pattern)."""
    k = 256
    g = torch.Generator().manual_seed(3)
    q = quantize(torch.randn(24, k, generator=g) * 0.05, "nvfp4")
    x = torch.randn(6, k, generator=g)
    bad = dataclasses.replace(q, scales=q.scales.clone())
    bits = bad.scales.view(torch.uint8)
    assert 0 < bits[3, 5] < 0x7E
    bits[3, 5] += 1  # the next E4M3 value
    y = ck.nvfp4_linear_packed(x, 24, k, *ck.pack_nvfp4(bad), None, torch.float32)
    with pytest.raises(AssertionError, match="out of bound"):
        _check(y, x, q, None)


def test_ops_trace_and_check(ck):
    q = quantize(torch.randn(20, 130), "nvfp4")
    x = torch.randn(3, 130, dtype=torch.bfloat16)
    args = (x, *ck.pack_nvfp4(q), 20, 130, None, None, torch.bfloat16)
    torch.library.opcheck(torch.ops.vllm_mxplus.cpu_nvfp4_linear.default, args)
    torch.library.opcheck(torch.ops.vllm_mxplus.cpu_nvfp4_act_quant.default, (x,))


def test_bad_inputs_name_the_tensor(ck):
    q = quantize(torch.randn(8, 64), "nvfp4")
    wc, ws, wg = ck.pack_nvfp4(q)
    with pytest.raises(RuntimeError, match="last dim 32 but the weight has K=64"):
        ck.nvfp4_linear_packed(torch.randn(2, 32), 8, 64, wc, ws, wg, None, torch.float32)
    with pytest.raises(RuntimeError, match="weight global scales"):
        ck.nvfp4_linear_packed(torch.randn(2, 64), 8, 64, wc, ws, wg[:3], None, torch.float32)
    with pytest.raises(RuntimeError, match="act_global_scale has 1 elements"):
        ck.nvfp4_linear_packed(
            torch.randn(2, 64), 8, 64, wc, ws, wg, None, torch.float32, torch.ones(1)
        )
    with pytest.raises(
        ValueError,
        match=r"2-D weight with E4M3 block scales and a global scale \(NVFP4\), got mxfp4-ocp",
    ):
        ck.pack_nvfp4(quantize(torch.randn(8, 64), "mxfp4-ocp"))
