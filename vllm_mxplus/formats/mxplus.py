"""MX+ baseline (Lee et al. 2025, as the paper describes it): MXFP4-OCP with block 32 where
the block-max element (first index of the largest |x|) keeps its exponent implicit (its
scaled value is in [4, 8)) and spends those bits on mantissa: value 4 * (1 + j/8), j 0..7,
ties to even, saturating at 7.5. The other elements are plain E2M1.

Storage: the block-max element's 4-bit code is sign | j; `block_max_index` (uint8 per block)
says which element it is, 255 when the block has none (an all-zero block, a NaN block, or a
block clamped at the bottom of the E8M0 range whose scaled max is below 4).
"""

from __future__ import annotations

import torch

from vllm_mxplus.formats.constants import MX_BLOCK, NO_BLOCK_MAX
from vllm_mxplus.formats.e2m1 import sign_bit
from vllm_mxplus.formats.e8m0 import E8M0_NAN, e8m0_reciprocal, e8m0_to_float
from vllm_mxplus.formats.mx import (
    dequantize_e8m0_blocks,
    encode_e8m0_blocks,
    quantize_e8m0_blocks,
)

MXPLUS_BLOCK = MX_BLOCK


def quantize_mxplus_blocks(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 x [..., nB*32] -> (unpacked codes, E8M0 scales, block_max_index uint8 [..., nB])."""
    _, scale = quantize_e8m0_blocks(x, MXPLUS_BLOCK, "ocp")
    bm_index = mxplus_block_max_index(x, scale)
    return encode_mxplus_blocks(x, scale, bm_index), scale, bm_index


def mxplus_block_max_index(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each block's block-max element (first index of the largest |x|) under E8M0 scales
    [..., nB]: uint8 [..., nB], NO_BLOCK_MAX when its scaled value is below 4 or the scale NaN."""
    xb = x.reshape(*x.shape[:-1], -1, MXPLUS_BLOCK)
    idx = xb.abs().argmax(-1, keepdim=True)  # first maximal index
    vmax = xb.gather(-1, idx).abs() * e8m0_reciprocal(scale)[..., None]
    has_bm = (vmax >= 4.0) & (scale != E8M0_NAN)[..., None]
    bm_index = torch.where(has_bm, idx, torch.full_like(idx, NO_BLOCK_MAX)).squeeze(-1)
    return bm_index.to(torch.uint8)


def _block_max_at(bm_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each block has a block max, its index, 0 where none) as [..., nB, 1]."""
    has_bm = (bm_index != NO_BLOCK_MAX)[..., None]
    return has_bm, torch.where(has_bm, bm_index[..., None].long(), 0)


def encode_mxplus_blocks(
    x: torch.Tensor, scale: torch.Tensor, bm_index: torch.Tensor
) -> torch.Tensor:
    """Unpacked codes of fp32 x [..., nB*32] under GIVEN E8M0 scales and block-max indices:
    plain E2M1, and the block-max element as sign | j with 4 * (1 + j/8) its scaled value."""
    codes = encode_e8m0_blocks(x, scale, MXPLUS_BLOCK)
    xb = x.reshape(*x.shape[:-1], -1, MXPLUS_BLOCK)
    cb = codes.reshape(xb.shape)
    has_bm, idx = _block_max_at(bm_index)
    xmax = xb.gather(-1, idx)
    vmax = xmax.abs() * e8m0_reciprocal(scale)[..., None]
    # 4 * (1 + j/8) = v  <=>  j = 2v - 8 (exact in fp32 for v in [4, 8)); round half to even
    j = torch.round(2.0 * vmax - 8.0).clamp(0, 7).to(torch.uint8)
    bm_code = j | (sign_bit(xmax).to(torch.uint8) << 3)
    cb = cb.scatter(-1, idx, torch.where(has_bm, bm_code, cb.gather(-1, idx)))
    return cb.reshape(x.shape)


def dequantize_mxplus_blocks(
    codes: torch.Tensor, scale: torch.Tensor, bm_index: torch.Tensor
) -> torch.Tensor:
    """Plain E2M1 dequantization, then the block-max element as +-4 * (1 + j/8) * X."""
    out = dequantize_e8m0_blocks(codes, scale, MXPLUS_BLOCK)
    ob = out.reshape(*out.shape[:-1], -1, MXPLUS_BLOCK)
    cb = codes.reshape(ob.shape)
    has_bm, idx = _block_max_at(bm_index)
    c = cb.gather(-1, idx)
    mag = 4.0 + 0.5 * (c & 0x7).to(torch.float32)
    val = torch.where((c & 0x8) > 0, -mag, mag) * e8m0_to_float(scale)[..., None]
    ob = ob.scatter(-1, idx, torch.where(has_bm, val, ob.gather(-1, idx)))
    return ob.reshape(out.shape)
