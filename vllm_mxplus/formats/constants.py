"""Numeric constants of the formats, in one place (docs/numerics.md).

Every other module (formats, kernels' Python wrappers, checkpoint, integration) imports them
from here; a value torch can derive is derived from `torch.finfo`, its value in a comment.
Triton kernels wrap the ones they need in `tl.constexpr` next to their use.
"""

from __future__ import annotations

import torch

# E2M1 elements (docs/numerics.md, "E2M1 elements")
E2M1_MAX = 6.0  # largest E2M1 magnitude

# E8M0 block scales (docs/numerics.md, "E8M0 block scales")
E8M0_BIAS = 127  # X = 2^(code - 127)
E8M0_NAN = 255  # the NaN code; also the code of a block holding NaN or +-Inf
FP32_MANTISSA_BITS = 23
FLOOR_MANTISSA = 0x400000  # fp32 mantissa bits of 1.5: `floor` rule, d = 1 above it
OAS_MANTISSA = 0x600000  # fp32 mantissa bits of 1.75: `oas` rule, d = 1 above it

# Block sizes
MX_BLOCK = 32  # OCP MX v1.0 block (mxfp4-ocp, mxplus)
SMALL_BLOCK = 16  # the paper's block (mxfp4-16*, MBS formats) and NVFP4's
MACRO_BLOCK = 128  # paper section 4.3: 1x128 macro blocks (8 sub-blocks of 16)

# MBS (docs/numerics.md, "Macro Block Scaling")
MBS_DENOM = 256  # F = 1 + m / 256
MBS_STATIC_MASK = 0x007F8000  # the 8 leading mantissa bits of fp32(6 / a)
MBS_STATIC_SHIFT = 15

# NVFP4 (docs/numerics.md, "NVFP4")
F8E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0

# MX+ (docs/numerics.md, "MX+")
NO_BLOCK_MAX = 255  # block_max_index of a block without a block-max element


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints."""
    return -(-a // b)
