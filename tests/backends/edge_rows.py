"""Rows every CPU kernel test feeds its activation quantizer: zeros, NaN, Inf, -0.0."""

from __future__ import annotations

import torch


def edge_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows 0-3 and 6 of x [>= 7, K] in place: a zero prefix, a NaN, -Inf and -0.0, an
    all-zero row, alternating signs. Each test adds its format's own rows 4, 5, 7, ..."""
    k = x.shape[-1]
    x[0, : min(k, 5)] = 0.0
    x[1, k // 2] = float("nan")
    x[2, 0] = -float("inf")
    x[2, -1] = -0.0
    x[3] = 0.0
    x[6, :: max(k // 3, 1)] = -x[6, :: max(k // 3, 1)]
    return x
