"""Block quantization with E8M0 scales (MXFP4-OCP, MXFP4-16, OAS) and the MBS factor.

Inputs here are fp32 with the last dimension already padded with zeros to a whole number
of blocks (zeros change neither a block absmax nor an SSE, so padding is invisible).
"""

from __future__ import annotations

import torch

from vllm_mxplus.formats.constants import MBS_DENOM
from vllm_mxplus.formats.e2m1 import e2m1_decode, e2m1_magnitude_code, sign_bit
from vllm_mxplus.formats.e8m0 import E8M0_NAN, e8m0_block_scale, e8m0_reciprocal, e8m0_to_float


def mbs_factor(m: torch.Tensor) -> torch.Tensor:
    """F = 1 + m/256 (exact in fp32) for MBS bytes m (paper §4.3.1)."""
    return (m.to(torch.float32) + float(MBS_DENOM)) / float(MBS_DENOM)


def apply_macro(x: torch.Tensor, f: torch.Tensor, op: str) -> torch.Tensor:
    """Multiply or divide each macro block of x [..., nM*L] by its factor f [..., nM]."""
    lead = x.shape[:-1]
    xm = x.reshape(*lead, f.shape[-1], -1)
    out = xm * f[..., None] if op == "mul" else xm / f[..., None]
    return out.reshape(x.shape)


def quantize_e8m0_blocks(
    y: torch.Tensor, block: int, rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize fp32 y [..., nB*block] -> (unpacked codes [..., nB*block], E8M0 [..., nB]).

    Elements of a NaN/Inf block get code 0; the block's scale code 255 makes them NaN.
    """
    scale = e8m0_block_scale(y.reshape(*y.shape[:-1], -1, block).abs().amax(-1), rule)
    return encode_e8m0_blocks(y, scale, block), scale


def encode_e8m0_blocks(y: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """Unpacked codes of fp32 y [..., nB*block] under GIVEN E8M0 scales [..., nB]: each
    element's magnitude times 2^-s (exact) rounded to E2M1; a NaN scale's block gets code 0."""
    yb = y.reshape(*y.shape[:-1], -1, block)
    v = yb.abs() * e8m0_reciprocal(scale)[..., None]  # exact: a power of two
    codes = e2m1_magnitude_code(v) | (sign_bit(yb).to(torch.uint8) << 3)
    codes = torch.where((scale == E8M0_NAN)[..., None], torch.zeros_like(codes), codes)
    return codes.reshape(y.shape)


def dequantize_e8m0_blocks(codes: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """value(code) * 2^(scale-127) in fp32; codes [..., nB*block] unpacked, scale [..., nB]."""
    vals = e2m1_decode(codes).reshape(*codes.shape[:-1], -1, block)
    return (vals * e8m0_to_float(scale)[..., None]).reshape(codes.shape)


def quantize_mbs(
    x: torch.Tensor, m: torch.Tensor, block: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """MBS quantization for given bytes m: y = fp32(x * F), then OAS block quantization."""
    y = apply_macro(x, mbs_factor(m), "mul")
    return quantize_e8m0_blocks(y, block, "oas")


def dequantize_mbs(
    codes: torch.Tensor, scale: torch.Tensor, m: torch.Tensor, block: int = 16
) -> torch.Tensor:
    """x_hat = (value * X) / F, an IEEE fp32 division per element.

    docs/numerics.md, Macro Block Scaling.
    """
    return apply_macro(dequantize_e8m0_blocks(codes, scale, block), mbs_factor(m), "div")
