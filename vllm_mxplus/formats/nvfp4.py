"""NVFP4 baseline: E2M1 elements, E4M3 block-16 scales and an fp32 global scale.

g = amax / (6 * 448); s = e4m3(amax_b / 6 / g) (round to nearest even, saturating, fn);
codes = e2m1(x / (s * g)); x_hat = value * s * g; s = 0 is a zero block (docs/numerics.md, NVFP4).
Every division is IEEE fp32 on every device (`div_rn`: torch on CUDA does not divide by a
Python number exactly).
amax is over the tensor given, or over each row (the last dim) with per_row=True, which is
what the activation path uses so that results never depend on batching.

NaN/Inf (our rule; the spec is silent): the global amax ignores non-finite elements and a
block holding NaN or Inf gets the e4m3 NaN scale, so it dequantizes to NaN like the MX formats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_mxplus.formats.constants import E2M1_MAX, F8E4M3_MAX, SMALL_BLOCK, ceil_div
from vllm_mxplus.formats.e2m1 import e2m1_decode, e2m1_magnitude_code, sign_bit

NVFP4_BLOCK = SMALL_BLOCK


def div_rn(a: torch.Tensor, c: float) -> torch.Tensor:
    """a / c correctly rounded (IEEE) on every device. torch on CUDA divides a tensor by a
    Python number as a * fp32(1 / c), one ulp off for some a where c is not a power of two
    (6, 2688): the divisor as a 0-dim tensor on a's device takes the true division there."""
    return a / torch.full((), c, dtype=a.dtype, device=a.device)


def global_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """g = amax / (6 * 448) in fp32, correctly rounded (`div_rn`)."""
    return div_rn(amax.to(torch.float32), E2M1_MAX * F8E4M3_MAX)


def nvfp4_global_scale(x: torch.Tensor, per_row: bool) -> torch.Tensor:
    """g = amax / (6 * 448) in fp32 over finite |x|: shape [] or [..., 1] with per_row."""
    ax = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    amax = ax.amax(-1, keepdim=True) if per_row else ax.amax()
    return global_from_amax(amax)


def quantize_nvfp4_blocks(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x [..., nB*16], global g -> (unpacked codes, float8_e4m3fn scales [..., nB])."""
    s = nvfp4_block_scales(x, g)
    return encode_nvfp4_blocks(x, s, g), s


def nvfp4_block_scales(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The E4M3 block scales [..., nB] of fp32 x [..., nB*16] under global g ([] or [..., 1],
    broadcast over the block dim): e4m3(amax_b / 6 / g), 0 when g = 0, NaN for a NaN/Inf block."""
    absmax = x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK).abs().amax(-1)
    s32 = div_rn(absmax, E2M1_MAX) / g
    s32 = torch.where(g > 0, s32, torch.zeros_like(s32))
    # a block holding NaN/Inf gets the NaN scale (clamp would turn Inf into 448)
    s32 = torch.where(torch.isfinite(absmax), s32, torch.full_like(s32, float("nan")))
    return s32.clamp(max=F8E4M3_MAX).to(torch.float8_e4m3fn)


def encode_nvfp4_blocks(x: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Unpacked codes of fp32 x [..., nB*16] under GIVEN E4M3 scales s and global g:
    e2m1(|x| / (s * g)); a zero or NaN scale's block gets code 0."""
    xb = x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    sf = s.to(torch.float32)
    zero = (sf == 0) | ~torch.isfinite(sf)
    denom = torch.where(zero, torch.ones_like(sf), sf * g)
    v = xb.abs() / denom[..., None]
    codes = e2m1_magnitude_code(v) | (sign_bit(xb).to(torch.uint8) << 3)
    codes = torch.where(zero[..., None], torch.zeros_like(codes), codes)
    return codes.reshape(x.shape)


def dequantize_nvfp4_blocks(codes: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x_hat = value * s * g in fp32 (left to right)."""
    vals = e2m1_decode(codes).reshape(*codes.shape[:-1], -1, NVFP4_BLOCK)
    sg = s.to(torch.float32)[..., None]
    g_b = g[..., None] if g.dim() else g
    return ((vals * sg) * g_b).reshape(codes.shape)


def _pad_blocks(x: torch.Tensor) -> torch.Tensor:
    """fp32 x, its last dim zero-padded to whole blocks of 16."""
    k = x.shape[-1]
    return F.pad(x.to(torch.float32), (0, ceil_div(k, NVFP4_BLOCK) * NVFP4_BLOCK - k))


def quantize_nvfp4_given(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 of x [..., K] (any K: a partial last block is zero-padded) with a GIVEN global
    scale g ([] or [..., 1]): (unpacked codes [..., K], e4m3 scales [..., ceil(K/16)])."""
    codes, scales = quantize_nvfp4_blocks(_pad_blocks(x), g)
    return codes[..., : x.shape[-1]], scales


def fake_quantize_nvfp4_given(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """quantize_nvfp4_given, dequantized: fp32 [..., K] (rows whose global scale comes from
    the whole unsharded row, or from one logical weight of a fused weight)."""
    codes, scales = quantize_nvfp4_blocks(_pad_blocks(x), g)
    return dequantize_nvfp4_blocks(codes, scales, g)[..., : x.shape[-1]].contiguous()
