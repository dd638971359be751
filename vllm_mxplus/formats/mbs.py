"""Macro Block Scaling: the static byte (paper eq. 3) and the exact dynamic search (§4.3.3).

MBS-S: a = absmax of the macro block, r = fp32(6 / a), m = (bits(r) & 0x007F8000) >> 15.
MBS-D: m = argmin over all 256 bytes of the macro block's SSE sum (x - x_hat)^2, ties to the
smaller m. `mbs_dynamic` returns exactly that argmin (see mbs_search.py for how it avoids
evaluating all 256 candidates); `mbs_dynamic_bruteforce` is the definition, kept for tests
and for the rare macro blocks the fast search hands back.
"""

from __future__ import annotations

import torch

from vllm_mxplus.formats.constants import E2M1_MAX, MBS_STATIC_MASK, MBS_STATIC_SHIFT
from vllm_mxplus.formats.mx import dequantize_mbs, quantize_mbs


def mbs_static(x: torch.Tensor, macro: int) -> torch.Tensor:
    """MBS-S bytes (uint8 [..., nM]) for fp32 x [..., nM*macro].

    a = 0 gives m = 0 (6/0 = inf has no mantissa bits). A macro block whose absmax is NaN
    or Inf also gets m = 0 (its NaN/Inf sub-blocks are NaN whatever m is); for Inf this is
    what eq. 3 gives anyway (6/inf = 0), for NaN it avoids depending on a NaN payload.
    """
    a = x.reshape(*x.shape[:-1], -1, macro).abs().amax(-1)
    r = torch.full_like(a, E2M1_MAX) / a
    m = (r.view(torch.int32) & MBS_STATIC_MASK) >> MBS_STATIC_SHIFT
    m = torch.where(torch.isfinite(a), m, torch.zeros_like(m))
    return m.to(torch.uint8)


def mbs_sse(x: torch.Tensor, m: torch.Tensor, macro: int, block: int = 16) -> torch.Tensor:
    """Exact float64 SSE per macro block of MBS+OAS quantization of x with bytes m."""
    codes, scale = quantize_mbs(x, m, block)
    err = x.double() - dequantize_mbs(codes, scale, m, block).double()
    return err.square().reshape(*x.shape[:-1], -1, macro).sum(-1)


def mbs_dynamic_bruteforce(x: torch.Tensor, macro: int, block: int = 16) -> torch.Tensor:
    """MBS-D by definition: all 256 candidates, strict improvement only (ties -> smaller m).

    A macro block whose SSE is NaN for every m (it holds NaN or Inf) gets m = 0.
    """
    shape = (*x.shape[:-1], x.shape[-1] // macro)
    best_m = torch.zeros(shape, dtype=torch.uint8, device=x.device)
    best = torch.full(shape, float("inf"), dtype=torch.float64, device=x.device)
    for cand in range(256):
        m = torch.full(shape, cand, dtype=torch.uint8, device=x.device)
        sse = mbs_sse(x, m, macro, block)
        better = sse < best
        best = torch.where(better, sse, best)
        best_m = torch.where(better, m, best_m)
    return best_m
