"""The split-K finish (`gemm_launch.finish_output`, one Triton launch): the fp32 partials of
the K slices summed in slice order, then the bias, then the cast, bit for bit the same fold
done step by step in torch, for every output dtype and bias dtype, ragged sizes included."""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.backends.triton.gemm_launch import FINISH_BLOCK, finish_output


def _fold(out: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    acc = out[0].clone()
    for s in range(1, out.shape[0]):
        acc = acc + out[s]
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(out_dtype)


@pytest.mark.parametrize(
    "split,m,n", [(2, 1, 40), (5, 3, 333), (16, 16, 4096 // 8), (9, 1, FINISH_BLOCK + 7)]
)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32])
def test_finish_is_the_ordered_fold(split, m, n, out_dtype, bias_dtype, triton_device):
    g = torch.Generator().manual_seed(split * 1000 + n)
    # magnitudes 2^-20..2^20 so that the order of the additions shows in the bits
    out = torch.randn(split, m, n, generator=g) * torch.exp2(
        torch.randint(-20, 21, (split, m, n), generator=g).float()
    )
    bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
    want = _fold(out, bias, out_dtype)
    dev = triton_device
    got = finish_output(out.to(dev), None if bias is None else bias.to(dev), out_dtype).cpu()
    assert got.dtype == out_dtype and got.shape == (m, n)
    view = {2: torch.int16, 4: torch.int32}[got.element_size()]
    assert torch.equal(got.view(view), want.view(view))


def test_two_d_output_is_only_cast(triton_device):
    y = torch.randn(3, 5).to(triton_device)
    assert finish_output(y, None, torch.float32) is y
    assert finish_output(y, None, torch.bfloat16).dtype == torch.bfloat16


def test_empty_output(triton_device):
    out = torch.zeros(4, 0, 8, device=triton_device)
    assert finish_output(out, None, torch.bfloat16).shape == (0, 8)
