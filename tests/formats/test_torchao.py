"""Bit-exact agreement with torchao's reference MX / NVFP4 casts (torchao 0.18, CPU)."""

import warnings

import pytest
import torch

from vllm_mxplus.formats import fake_quantize, qsnr, quantize
from vllm_mxplus.formats.e8m0 import float_exponent_mantissa

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor", reason="torchao not installed")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize


def _data(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 1024, generator=g) * torch.logspace(-3, 3, 128)[:, None]
    x[:, ::97] *= 15  # outliers
    return x.bfloat16()


def _torchao(x, block, mode):
    scale, data = mx.to_mx(x, torch.float4_e2m1fn_x2, block, mode)
    return scale.view(torch.uint8).reshape(x.shape[0], -1), data.view(torch.uint8)


@pytest.mark.parametrize(
    "fmt,block,mode", [("mxfp4-ocp", 32, "FLOOR"), ("mxfp4-16", 16, "RCEIL")], ids=["ocp", "16"])
@pytest.mark.parametrize("seed", [0, 1])
def test_bit_exact(fmt, block, mode, seed):
    x = _data(seed)
    scale, data = _torchao(x, block, ScaleCalculationMode[mode])
    q = quantize(x, fmt)
    assert torch.equal(q.scales, scale)
    assert torch.equal(q.codes, data.reshape(q.codes.shape))


def test_oas_equals_even_except_at_significand_175():
    x = _data(2)
    x[0, :16] = 1.75  # force blocks whose absmax significand is exactly 1.75
    x[1, 16:32] = -3.5
    scale, data = _torchao(x, 16, ScaleCalculationMode.EVEN)
    q = quantize(x, "mxfp4-16-oas")
    absmax = x.float().reshape(128, -1, 16).abs().amax(-1)
    _, man = float_exponent_mantissa(absmax)
    at_175 = man == 0x600000
    differ = q.scales != scale
    assert bool(at_175[0, 0]) and bool(at_175[1, 1])
    assert torch.equal(differ, at_175)  # every 1.75 block differs, nothing else does
    # the paper maps 1.75 into (3.5, 7]: our scale is one binade smaller there
    assert bool((q.scales[at_175].int() == scale[at_175].int() - 1).all())
    codes_eq = (q.codes.reshape(128, -1, 8) == data.reshape(128, -1, 8)).all(-1)
    assert torch.equal(~codes_eq & ~at_175, torch.zeros_like(at_175))


@pytest.mark.parametrize("seed", [0, 1])
def test_nvfp4_qsnr_within_001_db(seed):
    x = _data(seed)
    ours = qsnr(x.float(), fake_quantize(x, "nvfp4"))
    g = x.float().abs().amax() / (6.0 * 448.0)
    scales, data = nvfp4_quantize(x, 16, per_tensor_scale=g)
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4

    vals = f4_unpacked_to_f32(unpack_uint4(data.view(torch.uint8))).reshape(128, -1, 16)
    ref = (vals * scales.float().reshape(128, -1, 1) * g).reshape(x.shape)
    theirs = qsnr(x.float(), ref)
    assert abs(ours - theirs) < 0.01, (ours, theirs)
