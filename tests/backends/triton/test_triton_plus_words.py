"""MX+'s block-max words (`plus_words`): every block-max code (sign and j) at every position
under every E8M0 scale byte, read back the way the Triton kernels read them, against
`formats`' own dequantization: δ bit for bit (fp32 of the spec's block-max value minus the
plain E2M1 value), the position exact, no block max as 0. Pure torch, no kernel."""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.backends.triton.plus_words import (
    WORD_DELTA_MASK,
    WORD_POS_MASK,
    block_max_words,
)
from vllm_mxplus.formats.constants import NO_BLOCK_MAX
from vllm_mxplus.formats.e2m1 import pack_fp4
from vllm_mxplus.formats.mx import dequantize_e8m0_blocks
from vllm_mxplus.formats.mxplus import dequantize_mxplus_blocks


def read_words(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(delta fp32, position, has) as `decode_gemm._block_max_deltas` computes them."""
    w = words.to(torch.int32)
    bits = w & WORD_DELTA_MASK
    return (bits << 16).view(torch.float32), w & WORD_POS_MASK, bits != 0


def weight(scale_codes: list[int], seed: int = 0):
    """One row of blocks per (scale byte, block-max code) pair: random plain codes, the block
    max at a random position; every 5th block without a block max."""
    gen = torch.Generator().manual_seed(seed)
    pairs = [(s, c) for s in scale_codes for c in range(16)]
    nb = len(pairs)
    codes = torch.randint(0, 16, (1, nb * 32), generator=gen, dtype=torch.uint8)
    index = torch.randint(0, 32, (1, nb), generator=gen, dtype=torch.uint8)
    index[0, ::5] = NO_BLOCK_MAX
    scales = torch.tensor([[s for s, _ in pairs]], dtype=torch.uint8)
    for b, (_, c) in enumerate(pairs):
        if index[0, b] != NO_BLOCK_MAX:
            codes[0, b * 32 + int(index[0, b])] = c
    return codes, scales, index


SCALES = [0, 1, 2, 60, 126, 127, 128, 200, 251, 252, 253, 254]


def test_every_block_max_code_and_scale_reads_back_as_the_spec():
    codes, scales, index = weight(SCALES)
    words = block_max_words(pack_fp4(codes), scales, index)
    assert words.dtype == torch.int16 and words.shape == index.shape
    delta, pos, has = read_words(words)
    want_has = index != NO_BLOCK_MAX
    assert torch.equal(has, want_has)
    assert torch.equal(pos[has], index[has].to(torch.int32))
    assert torch.equal(delta[~has], torch.zeros_like(delta[~has]))
    # the spec's block-max value minus what the plain decode gives, per block: both at unit
    # scale by `formats` (exact), times the scale 2^(s - 127) in fp64 (formats' fp32 values
    # overflow at the top scales), then fp32 (Inf above its range)
    unit = torch.full_like(scales, 127)
    spec = dequantize_mxplus_blocks(codes, unit, index).double()
    plain = dequantize_e8m0_blocks(codes, unit, 32).double()
    at = torch.arange(index.shape[1]) * 32 + torch.where(want_has, index.long(), 0)[0]
    x = torch.exp2(scales[0].double() - 127)
    rest = ((spec[0, at] - plain[0, at]) * x).float()
    got, want = delta[0][want_has[0]], rest[want_has[0]]
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.isinf(got).any() and (got < 0).any()  # 4 * 2^127 overflows, signs kept


def test_a_nan_scale_keeps_its_block_max_as_nan():
    """A NaN scale (255) with a block max listed reads as a NaN delta, not as none."""
    codes, scales, index = weight([255])
    delta, _, has = read_words(block_max_words(pack_fp4(codes), scales, index))
    live = index != NO_BLOCK_MAX
    assert torch.equal(has, live) and delta[live].isnan().all()


def test_odd_k_and_mismatched_fields():
    """K = 40 (the last block 8 elements, its codes' byte count odd-sized): the words of the
    tail block too; shapes that are not one weight are refused by name."""
    codes, scales, index = weight([127])
    k = 40
    c, s, i = codes[:, :k].clone(), scales[:, :2], index[:, :2].clone()
    i[0, 1] = 7  # in the 8-element tail block
    words = block_max_words(pack_fp4(c), s, i)
    _, pos, has = read_words(words)
    assert has[0, 1] and pos[0, 1] == 7
    with pytest.raises(ValueError, match="block_max_words"):
        block_max_words(pack_fp4(c), scales[:, :3], i)
