"""The fused split of the sm_90a exact fallback (`act_fp8_split_rows`): rows x[idx] quantized
and split into high / low FP8 operands in one Triton kernel, bit for bit
`split_fp8_chunks(formats.quantize(x[idx]))` (the torch definition, fp8_chunks.py)."""

from __future__ import annotations

import pytest
import torch
from test_cutlass_act_fp8 import activations, special_rows

from vllm_mxplus.backends.cutlass import fp8_chunks as fc
from vllm_mxplus.backends.cutlass.act_fp8 import SUPPORTED_FORMATS, act_fp8_split_rows
from vllm_mxplus.formats import quantize

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _check(x: torch.Tensor, fmt: str, idx: torch.Tensor) -> torch.Tensor:
    fp8, scale, exact = act_fp8_split_rows(x, fmt, idx)
    q = quantize(x.cpu()[idx.cpu()].float(), fmt)
    hi, lo, want_exact = fc.split_fp8_chunks(q.codes, q.scales, q.mbs, x.shape[-1])
    r = idx.shape[0]
    u8 = torch.uint8
    assert torch.equal(fp8[:r].cpu().view(u8), hi.fp8.view(u8)), "high fp8"
    assert torch.equal(fp8[r:].cpu().view(u8), lo.fp8.view(u8)), "low fp8"
    i32 = torch.int32
    assert torch.equal(scale[:, :r].cpu().view(i32), hi.scale.view(i32)), "high scale"
    assert torch.equal(scale[:, r:].cpu().view(i32), lo.scale.view(i32)), "low scale"
    assert torch.equal(exact.cpu(), want_exact), "exact rows"
    return want_exact


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_special_rows(fmt, dtype, triton_device):
    """NaN / Inf rows stay inexact; the > 14-binade row (6) becomes exact by the split."""
    x = special_rows(DTYPES[dtype]).to(triton_device)
    plain = fc.encode_fp8_chunks(
        *(lambda q: (q.codes, q.scales, q.mbs))(quantize(x.cpu().float(), fmt)), x.shape[-1]
    )
    assert not bool(plain.exact_rows[6])
    idx = torch.tensor([6, 1, 2, 0, 9, 6, 3, 15], device=triton_device)  # duplicates too
    exact = _check(x, fmt, idx)
    assert bool(exact[0]) and not bool(exact[1]) and not bool(exact[2])


@pytest.mark.parametrize("fmt", SUPPORTED_FORMATS)
@pytest.mark.parametrize("k", [100, 576, 1536])
def test_inexact_random_rows(fmt, k, triton_device):
    x = activations(64, k, torch.bfloat16, triton_device, seed=k + 5)
    q = quantize(x.cpu().float(), fmt)
    bad = (~fc.encode_fp8_chunks(q.codes, q.scales, q.mbs, k).exact_rows).nonzero()[:, 0]
    assert bad.numel() >= 2, "the data must hit inexact rows"
    _check(x, fmt, bad.flip(0).to(triton_device))


def test_no_rows(triton_device):
    x = activations(4, 256, torch.bfloat16, triton_device)
    fp8, scale, exact = act_fp8_split_rows(
        x, "mxfp4-mbs-s", torch.empty(0, dtype=torch.int64, device=triton_device)
    )
    assert fp8.shape == (0, 256) and scale.shape == (2, 0) and exact.shape == (0,)
