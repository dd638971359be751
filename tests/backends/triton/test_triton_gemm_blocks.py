"""The GEMMs' code -> value decoders (`gemm_blocks.e2m1_value`, `e2m1_pair_values`, and the
word decoders `e2m1_word_values` / `e8m0_word_scales` of the decode GEMM's word path)
against `formats`, bit for bit, over every code, every packed byte and every nibble
position of a word (-0.0 included: compared as fp32 bits), with E8M0 scales from the
subnormal 2^-127 to 2^127 and NaN.

Runs on CPU under TRITON_INTERPRET=1 (tests/backends/conftest.py) or on CUDA when compiled.
"""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.backends.triton.gemm_blocks import (
    e2m1_pair_values,
    e2m1_value,
    e2m1_word_values,
    e8m0_word_scales,
)
from vllm_mxplus.backends.triton.gemm_launch import dot_dtype
from vllm_mxplus.backends.triton.launch import tl, triton
from vllm_mxplus.formats.e2m1 import e2m1_decode


@triton.jit
def _decode_bytes_kernel(b_ptr, lo_ptr, hi_ptr, nib_lo_ptr, nib_hi_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    b = tl.load(b_ptr + i).to(tl.int32)
    lo, hi = e2m1_pair_values(b)
    tl.store(lo_ptr + i, lo)
    tl.store(hi_ptr + i, hi)
    tl.store(nib_lo_ptr + i, e2m1_value(b & 15))
    tl.store(nib_hi_ptr + i, e2m1_value(b >> 4))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_e2m1_decoders_match_formats_on_every_byte(triton_device):
    device = triton_device
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(device)
    outs = [torch.empty(256, dtype=torch.float32, device=device) for _ in range(4)]
    _decode_bytes_kernel[(1,)](b, *outs, N=256)
    lo, hi, nib_lo, nib_hi = (o.cpu() for o in outs)
    want_lo = e2m1_decode((b.cpu() & 15).to(torch.uint8)).to(torch.float32)
    want_hi = e2m1_decode((b.cpu() >> 4).to(torch.uint8)).to(torch.float32)
    assert torch.equal(_bits(lo), _bits(want_lo))
    assert torch.equal(_bits(hi), _bits(want_hi))
    assert torch.equal(_bits(nib_lo), _bits(want_lo))
    assert torch.equal(_bits(nib_hi), _bits(want_hi))
    # the check can fail: code 8 is -0.0, whose bits differ from +0.0's
    assert not torch.equal(_bits(want_lo), _bits(want_lo.abs()))


@triton.jit
def _decode_words_kernel(q_ptr, s_ptr, out_ptr, R: tl.constexpr, W: tl.constexpr,
                         BS: tl.constexpr, DOT_DTYPE: tl.constexpr):  # fmt: skip
    """out[p, r, c] = value of column c of word tile p (`e2m1_word_values`) x its scale."""
    r = tl.arange(0, R)[:, None]
    q = tl.load(q_ptr + r * W + tl.arange(0, W)[None, :])
    nb: tl.constexpr = W * 8 // BS
    s = tl.load(s_ptr + r * nb + tl.arange(0, nb)[None, :]).to(tl.int32)
    sv = e8m0_word_scales(s, BS // 8, DOT_DTYPE)
    c = tl.arange(0, 2 * W)[None, :]
    for p in tl.static_range(4):
        v = e2m1_word_values(q, p, DOT_DTYPE) * sv
        tl.store(out_ptr + p * R * 2 * W + r * 2 * W + c, v.to(tl.float32))


def _word_reference(codes: torch.Tensor, scales: torch.Tensor, bs: int) -> torch.Tensor:
    """[4, R, 2W]: element 8j + p + 4h of each row at [p, r, 2j + h], x 2^(scale - 127)."""
    rows, k = codes.shape
    v = e2m1_decode(codes.to(torch.uint8)).to(torch.float64)
    e = scales.to(torch.float64)
    sv = torch.where(scales == 255, torch.nan, torch.exp2(e - 127.0))
    v = (v * sv.repeat_interleave(bs, dim=1)).to(torch.float32)
    # element 8j + 4h + p -> [p, r, j, h]
    return v.view(rows, k // 8, 2, 4).permute(3, 0, 1, 2).reshape(4, rows, k // 4)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # 6 x 2^127: Inf
@pytest.mark.parametrize("bs", [16, 32])
def test_word_decoders_match_formats_in_every_nibble(triton_device, bs):
    rows, w = 64, 16  # 128 codes per row
    gen = torch.Generator().manual_seed(bs)
    codes = torch.randint(0, 16, (rows, w * 8), generator=gen)
    codes[:16] = torch.arange(16).repeat(16, w * 8 // 16)  # every code in every position
    scales = torch.randint(100, 150, (rows, w * 8 // bs), generator=gen)
    scales[:, 0] = torch.tensor([0, 1, 2, 126, 127, 128, 253, 254, 255] * 8)[:rows]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    words = packed.view(torch.int32)  # 4 bytes per word, little-endian: element 8j + p in nibble p
    out = torch.empty(4, rows, 2 * w, dtype=torch.float32, device=triton_device)
    _decode_words_kernel[(1,)](
        words.to(triton_device), scales.to(torch.uint8).to(triton_device), out, R=rows, W=w,
        BS=bs, DOT_DTYPE=dot_dtype(),
    )  # fmt: skip
    got = out.cpu()
    want = _word_reference(codes, scales, bs)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    bad = _bits(got)[~nan] != _bits(want)[~nan]
    assert not bad.any(), f"{int(bad.sum())} values differ"
    # the check can fail: the permutation matters (tile 1 is not tile 0) and so does the sign
    assert not torch.equal(want[0].nan_to_num(), want[1].nan_to_num())
    assert (_bits(want) == _bits(torch.tensor(-0.0))).any()
