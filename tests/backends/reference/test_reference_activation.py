"""The reference backend's fast activation fake-quant equals formats.fake_quantize bit for bit."""

import pytest
import torch

from vllm_mxplus.backends.reference.activation import FAST_FORMATS, fast_fake_quantize
from vllm_mxplus.formats import fake_quantize
from vllm_mxplus.formats.e2m1 import e2m1_round


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))  # NaN == NaN, -0 != +0


def test_e2m1_round_all_bf16_patterns():
    x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    v = x.abs()[torch.isfinite(x)]
    from vllm_mxplus.formats.e2m1 import e2m1_decode, e2m1_magnitude_code

    assert torch.equal(e2m1_round(v), e2m1_decode(e2m1_magnitude_code(v)))


@pytest.mark.parametrize("fmt", FAST_FORMATS)
@pytest.mark.parametrize("m", [1, 33, 100], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k", [17, 100, 576, 1536], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_bit_exact(fmt, m, k, dtype):
    g = torch.Generator().manual_seed(m * 7919 + k)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-4, 4, m)[:, None]).to(dtype)
    x[0, : min(k, 5)] = 0.0
    if m > 1:
        x[1, k // 2] = float("nan")
    if m > 2:
        x[2, 0] = -float("inf")
        x[2, -1] = -0.0
    assert _bits_equal(fast_fake_quantize(x, fmt, 128), fake_quantize(x, fmt))


@pytest.mark.parametrize("macro", [32, 64, 256])
def test_macro_block_sizes(macro):
    x = torch.randn(4, 700)
    assert _bits_equal(
        fast_fake_quantize(x, "mxfp4-mbs-s", macro),
        fake_quantize(x, "mxfp4-mbs-s", macro_block=macro),
    )


def test_leading_dims():
    x = torch.randn(2, 3, 200)
    assert _bits_equal(fast_fake_quantize(x, "mxfp4-16-oas", 128), fake_quantize(x, "mxfp4-16-oas"))


@pytest.mark.parametrize("fmt", FAST_FORMATS)
@pytest.mark.parametrize("value", [1e-39, 2.0**-124, 3.0e38, 2.0**126], ids=str)
def test_range_ends_take_the_general_path(fmt, value):
    x = torch.randn(3, 300)
    x[1, 40:60] = value
    assert _bits_equal(fast_fake_quantize(x, fmt, 128), fake_quantize(x, fmt))
