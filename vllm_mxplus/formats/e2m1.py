"""E2M1 (FP4) elements: rounding, decoding and nibble packing (OCP MX v1.0 §5.3.3).

Codes 0..7 encode the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
Rounding is to nearest with ties to the even code, saturating at 6.
"""

from __future__ import annotations

import torch

from vllm_mxplus.formats.constants import E2M1_MAX  # noqa: F401  (re-exported)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Decision thresholds between consecutive codes, and whether reaching the threshold
# exactly rounds up: a tie goes to the even code (0.25->0, 0.75->1.0 (code 2), 1.25->1.0,
# 1.75->2.0 (code 4), 2.5->2.0, 3.5->4.0 (code 6), 5.0->4.0).
E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_TIE_ROUNDS_UP = (False, True, False, True, False, True, False)


def e2m1_magnitude_code(v: torch.Tensor) -> torch.Tensor:
    """Round non-negative fp32 magnitudes to E2M1 codes 0..7 (uint8); NaN maps to 0."""
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t, up in zip(E2M1_THRESHOLDS, E2M1_TIE_ROUNDS_UP):
        code += (v >= t) if up else (v > t)
    return code


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude VALUE of non-negative fp32 v (ties to the even code, saturating at 6):
    the value of `e2m1_magnitude_code(v)`, in arithmetic (no comparisons per threshold)."""
    step = torch.where(v < 2.0, 0.5, torch.where(v < 4.0, 1.0, 2.0))
    return torch.clamp_max(torch.round(v / step) * step, E2M1_MAX)


def e2m1_encode(v: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """Codes for already-scaled values: magnitude code of |v| with the sign bit from `negative`."""
    return e2m1_magnitude_code(v.abs()) | (negative.to(torch.uint8) << 3)


_HALF_BITS = 0x3F000000  # fp32 bits of 0.5
_SIGN_BIT = -(1 << 31)  # bit 31 of an int32 (0x80000000)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of unpacked E2M1 codes (0..15), from the code's bits (no value table, so
    nothing is built on or copied from the host: CUDA-graph safe). A magnitude code c in
    2..7 is 2^((c >> 1) - 1) * (1 + (c & 1) / 2): fp32 bits (c << 22) + bits(0.5); code 1 is
    0.5 and code 0 is 0, i.e. c * bits(0.5); bit 3 is the fp32 sign (code 8 is -0.0)."""
    c = codes.to(torch.int32)
    mag = c & 7
    bits = torch.where(mag >= 2, (mag << 22) + _HALF_BITS, mag * _HALF_BITS)
    return torch.where((c & 8) != 0, bits | _SIGN_BIT, bits).view(torch.float32)


def sign_bit(x: torch.Tensor) -> torch.Tensor:
    """True where the fp32 sign bit is set (so -0.0 keeps its sign, as torchao does)."""
    return x.view(torch.int32) < 0


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., K] into uint8 [..., ceil(K/2)]: element 2i low nibble, 2i+1 high."""
    k = codes.shape[-1]
    if k % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    c = codes.view(*codes.shape[:-1], -1, 2)
    return (c[..., 0] | (c[..., 1] << 4)).contiguous()


def unpack_fp4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of pack_fp4: uint8 [..., ceil(K/2)] -> codes [..., K]."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)[..., :k]
