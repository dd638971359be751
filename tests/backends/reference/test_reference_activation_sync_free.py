"""The reference backend's activation fake-quant without a host branch (`branch=False`, the
path taken on a GPU) equals formats.fake_quantize bit for bit, hard blocks included."""

import pytest
import torch

from vllm_mxplus.backends.reference.activation import FAST_FORMATS, fast_fake_quantize
from vllm_mxplus.formats import fake_quantize


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("fmt", FAST_FORMATS)
@pytest.mark.parametrize("value", [1e-39, 2.0**-124, 3.0e38, 2.0**126, float("nan")], ids=str)
@pytest.mark.parametrize("k", [300, 576], ids=lambda k: f"K{k}")
def test_hard_blocks_without_a_branch(fmt, value, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(3, k, generator=g)
    x[1, 40:60] = value  # hard blocks in one row, easy blocks around them
    x[2, -1] = -float("inf")
    want = fake_quantize(x, fmt)
    assert _bits_equal(fast_fake_quantize(x, fmt, 128, branch=False), want)


def test_only_hard_blocks_come_from_the_general_path(monkeypatch):
    """With the general path replaced by NaNs, exactly the hard blocks are NaN."""
    from vllm_mxplus.backends.reference import activation

    monkeypatch.setattr(
        activation, "fake_quantize", lambda x, *a, **k: torch.full_like(x, torch.nan)
    )
    x = torch.randn(2, 64)
    x[1, 16:32] = 1e-39  # block 16..31 of row 1 is hard (subnormal absmax)
    got = activation.fast_fake_quantize(x, "mxfp4-16-oas", 128, branch=False)
    nan = got.isnan()
    assert nan[1, 16:32].all() and nan.sum() == 16


@pytest.mark.parametrize("fmt", FAST_FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_easy_tensors_without_a_branch(fmt, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 5, 200, generator=g) * 8).to(dtype)
    x[0, 0, :7] = 0.0
    assert _bits_equal(fast_fake_quantize(x, fmt, 128, branch=False), fake_quantize(x, fmt))


@pytest.mark.parametrize("macro", [32, 64, 256])
def test_macro_block_sizes_without_a_branch(macro):
    x = torch.randn(4, 700)
    x[2, 100:110] = 1e-39
    assert _bits_equal(
        fast_fake_quantize(x, "mxfp4-mbs-s", macro, branch=False),
        fake_quantize(x, "mxfp4-mbs-s", macro_block=macro),
    )
