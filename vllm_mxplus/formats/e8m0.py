"""E8M0 block scales and the three scale rules (ocp, floor, oas).

docs/numerics.md, E8M0 block scales:

A block with absmax a = 2^E * f, f in [1, 2), gets the scale exponent E - 2 + d:
  ocp   (OCP MX v1.0 §6.3): d = 0           -> scaled absmax in [4, 8) (6..8 saturates)
  floor (paper §4.2, masking the mantissa of 6/a): d = [f > 1.5]  -> (3, 6]
  oas   (Overflow-Aware Scaling, paper §4.2):      d = [f > 1.75] -> (3.5, 7]
OAS needs no division: it compares the mantissa bits of a with 0x600000.
"""

from __future__ import annotations

import torch

from vllm_mxplus.formats.constants import (
    E8M0_BIAS,
    E8M0_NAN,  # code 255 is NaN (OCP MX v1.0 §5.4.1)
    FLOOR_MANTISSA,
    OAS_MANTISSA,
)
from vllm_mxplus.formats.constants import FP32_MANTISSA_BITS as FP32_MANT_BITS

E8M0_MAX_FINITE = E8M0_NAN - 1
FP32_MIN_NORMAL = 2.0**-126

# d = 1 when the 23-bit mantissa of the absmax exceeds this (ocp: never, 2^23 is above every
# mantissa).
_MANTISSA_THRESHOLD = {"ocp": 1 << FP32_MANT_BITS, "floor": FLOOR_MANTISSA, "oas": OAS_MANTISSA}


def mantissa_threshold(rule: str) -> int:
    """The scale rule in one number: d = [23-bit mantissa of the block absmax > this], so the
    scale exponent is E - 2 + d (every backend that reads the absmax's bits uses this)."""
    return _MANTISSA_THRESHOLD[rule]


def float_exponent_mantissa(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, mantissa bits) of positive finite fp32 values, so a = 2^E * (1 + man/2^23).

    Exact for subnormals: they are first scaled by 2^64 (exact) into the normal range.
    """
    sub = a < FP32_MIN_NORMAL
    an = torch.where(sub, a * 2.0**64, a)
    bits = an.view(torch.int32)
    e = ((bits >> FP32_MANT_BITS) & 0xFF) - 127 - sub.to(torch.int32) * 64
    return e, bits & 0x7FFFFF


def scale_exponent(absmax: torch.Tensor, rule: str) -> torch.Tensor:
    """Unclamped scale exponent E - 2 + d (int32) for positive finite fp32 block absmax."""
    e, man = float_exponent_mantissa(absmax)
    return e - 2 + (man > mantissa_threshold(rule)).to(torch.int32)


def e8m0_block_scale(absmax: torch.Tensor, rule: str) -> torch.Tensor:
    """E8M0 codes (uint8) for fp32 block absmax under a scale rule.

    Zero blocks get code 0; blocks whose absmax is NaN or +-Inf get code 255 (NaN).
    Exponents below the E8M0 range are clamped to code 0 (2^-127).
    """
    safe = torch.where(torch.isfinite(absmax) & (absmax > 0), absmax, torch.ones_like(absmax))
    code = (scale_exponent(safe, rule) + E8M0_BIAS).clamp(0, E8M0_MAX_FINITE)
    code = torch.where(absmax == 0, torch.zeros_like(code), code)
    code = torch.where(torch.isfinite(absmax), code, torch.full_like(code, E8M0_NAN))
    return code.to(torch.uint8)


def pow2_f32(k: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2^k for integer k in [-149, 127], built from the bits (no libm)."""
    k = k.to(torch.int32)
    normal = (k.clamp(-126, 127) + 127) << FP32_MANT_BITS
    subnormal = torch.ones_like(k) << (k.clamp(-149, -127) + 149)
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def e8m0_to_float(code: torch.Tensor) -> torch.Tensor:
    """fp32 value of E8M0 codes: 2^(code-127); code 255 is NaN."""
    c = code.to(torch.int32)
    x = pow2_f32(c.clamp(max=E8M0_MAX_FINITE) - E8M0_BIAS)
    return torch.where(c == E8M0_NAN, torch.full_like(x, float("nan")), x)


def e8m0_reciprocal(code: torch.Tensor) -> torch.Tensor:
    """fp32 2^(127-code), the exact factor that maps a block onto the E2M1 grid."""
    c = code.to(torch.int32).clamp(max=E8M0_MAX_FINITE)
    return pow2_f32(E8M0_BIAS - c)
