"""MX+ weights' block maxima as one 16-bit word per block of 32, built once at load for the
Triton GEMMs (docs/numerics.md, "MX+ on the decode GEMM").

The decode GEMM decodes every weight code as plain E2M1, so a block's max element enters as
±E2M1(j) · X where the spec's value is ±(8 + j)/2 · X; the rest, δ = ±((8 + j)/2 − E2M1(j)) · X
(4, 4, 4, 4, 4, 3.5, 3 or 1.5 times X), is added against the activation's element at the
block max's position. Read per step from the index, the code byte and the scale, δ took
three loads (one a gather) and the arithmetic for each block; the word holds it whole:

    bits 15..5: δ's bfloat16 bits (sign, exponent, the top 2 of 7 mantissa bits)
    bits  4..0: the block max's position in its block (0..31)
    0: no block max (`NO_BLOCK_MAX`)

δ is exact in bf16: its magnitude is 1, 1.75 or 1.5 times a power of two (two fraction bits
at most, also as a subnormal: 1.5 · 2^-127 is 0.11b · 2^-126), and bf16 spans fp32's
exponents, so its low five mantissa bits are always zero and carry the position. Where fp32
overflows (4 · 2^126) δ is Inf in both, and a NaN scale (255) gives NaN (BF16_NAN), as the
spec's value is NaN there; neither is 0, so a block max is never lost. The kernel takes δ as the fp32 of
(word & WORD_DELTA_MASK) << 16.
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.triton.launch import tl
from vllm_mxplus.formats.constants import MX_BLOCK, NO_BLOCK_MAX
from vllm_mxplus.formats.e2m1 import e2m1_decode
from vllm_mxplus.formats.e8m0 import e8m0_to_float

WORD_POS_BITS = 5  # the block max's position in its block of 32
WORD_POS_MASK = (1 << WORD_POS_BITS) - 1
WORD_DELTA_MASK = 0xFFFF & ~WORD_POS_MASK  # δ's bf16 bits without the low five
BF16_NAN = 0x7FC0  # a NaN scale's delta (its low five bits clear)
# the same, read inside the kernels
DELTA_MASK = tl.constexpr(WORD_DELTA_MASK)
POS_MASK = tl.constexpr(WORD_POS_MASK)


def block_max_words(codes: torch.Tensor, scales: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int16 words [N, nB] (module docstring) of an MX+ weight: packed codes uint8
    [N, ceil(K/2)], E8M0 scales and block-max indices uint8 [N, nB] (NO_BLOCK_MAX: none)."""
    n, nb = index.shape
    if scales.shape != (n, nb) or codes.shape[0] != n or codes.shape[1] * 2 < (nb - 1) * MX_BLOCK:
        raise ValueError(
            f"block_max_words: codes {tuple(codes.shape)}, scales {tuple(scales.shape)} and "
            f"indices {tuple(index.shape)} are not one MX+ weight"
        )
    has = index != NO_BLOCK_MAX
    pos = torch.where(has, index.long(), 0)
    elem = torch.arange(nb, device=index.device) * MX_BLOCK + pos
    byte = codes.long().gather(1, (elem // 2).clamp(max=codes.shape[1] - 1))
    code = (byte >> ((elem & 1) * 4)) & 15
    j = code & 7
    delta = ((8 + j).to(torch.float32) * 0.5 - e2m1_decode(j)) * e8m0_to_float(scales)
    delta = torch.where((code & 8) != 0, -delta, delta)
    bits = delta.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    bits = torch.where(delta.isnan(), BF16_NAN, bits)  # one NaN, whatever its payload
    if bool(((bits & WORD_POS_MASK) != 0)[has].any()):  # the exactness argument, at load
        raise RuntimeError("block_max_words: a block max's delta has low mantissa bits")
    word = torch.where(has, bits | pos.to(torch.int32), 0)
    return torch.where(word >= 1 << 15, word - (1 << 16), word).to(torch.int16)
