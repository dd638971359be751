"""Calibrated quantization of one weight: input-weighted RTN (`rtn-aware`) and GPTQ.

GPTQ (Frantar et al. 2022; the IST-DASLab reference): columns are quantized in natural order
along K; each column's rounding error, divided by the diagonal of the upper Cholesky factor
of H^-1, is spread over the not-yet-quantized columns, within a lazy block of 128 columns at
once and over the rest of the matrix after each block. H = E[x x^T] of the layer's inputs (as
served: activations already fake-quantized), damped by 1% of its mean diagonal. A group's
parameters (block scales, MBS byte, MX+ block-max index) are chosen when GPTQ reaches the
group's first column, from the error-updated weights (group_params.py), so the output is an
exact encoding of the format (docs/numerics.md, "Formats and schemes").

With H = I no error is propagated (H^-1 is diagonal), so GPTQ returns the RTN result of the
same parameter rule, bit for bit (tests/checkpoint/test_gptq.py).
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.nn.functional as F

from vllm_mxplus.formats import QuantizedTensor
from vllm_mxplus.checkpoint.group_params import (
    GroupParams,
    empty_params,
    group_width,
    nvfp4_weight_global,
    padded_k,
    quantize_columns,
    set_group,
    spec_params,
    to_quantized_tensor,
    weighted_params,
)
from vllm_mxplus.formats import get_format

Rule = Literal["spec", "weighted"]
LAZY_BLOCK = 128  # GPTQ's lazy batch; a multiple of every group width (16, 32, 128)
DAMP = 0.01  # fraction of the mean Hessian diagonal added to the diagonal


def _global(fmt: str, w: torch.Tensor) -> Optional[torch.Tensor]:
    return nvfp4_weight_global(w) if get_format(fmt).scale_rule == "e4m3" else None


def _choose(rule: Rule, fmt: str, w: torch.Tensor, d: torch.Tensor,
            g: Optional[torch.Tensor]) -> GroupParams:
    if rule == "spec":
        return spec_params(fmt, w, g)
    return weighted_params(fmt, w, d, g)


def _check(w: torch.Tensor, what: str) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(f"{what}: calibrated methods take a 2-D weight, got shape {tuple(w.shape)}")
    w = w.to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{what}: the weight holds NaN/Inf; calibrated methods need finite "
                         "weights (use --method rtn)")
    return w


def rtn_aware(w: torch.Tensor, d: torch.Tensor, fmt: str, rule: Rule = "weighted",
              name: str = "weight") -> QuantizedTensor:
    """RTN with the group parameters chosen by `rule` (weighted by d = E[x^2] [K])."""
    w = _check(w, name)
    n, k = w.shape
    kp = padded_k(fmt, k)
    wp = F.pad(w, (0, kp - k))
    dp = F.pad(d.to(torch.float32), (0, kp - k))
    p = _choose(rule, fmt, wp, dp, _global(fmt, w))
    codes, _ = quantize_columns(fmt, wp, p, 0)
    return to_quantized_tensor(fmt, codes, p, (n, k))


def gptq(w: torch.Tensor, h: torch.Tensor, fmt: str, rule: Rule = "weighted",
         name: str = "weight", damp: float = DAMP) -> QuantizedTensor:
    """GPTQ of w [N, K] under Hessian h [K, K] (any positive scale), natural column order."""
    w = _check(w, name)
    n, k = w.shape
    if h.shape != (k, k):
        raise ValueError(f"{name}: Hessian shape {tuple(h.shape)} does not match K = {k}")
    g = _global(fmt, w)  # fixed from the original weight
    kp = padded_k(fmt, k)
    gw = group_width(fmt)
    h = h.to(torch.float64).clone()
    d_orig = torch.diagonal(h).clone()
    dead = d_orig == 0
    h[dead, dead] = 1.0
    wq = F.pad(w.masked_fill(dead[None, :], 0.0), (0, kp - k))
    h = F.pad(h, (0, kp - k, 0, kp - k))
    h[torch.arange(k, kp), torch.arange(k, kp)] = 1.0  # padding columns: zero, independent
    d = F.pad(d_orig, (0, kp - k)).to(torch.float32)
    h += damp * torch.diagonal(h)[:k].mean() * torch.eye(kp, dtype=h.dtype)
    hinv = _inverse_cholesky_upper(h, name).to(torch.float32)

    p = empty_params(fmt, n, kp, g)
    codes = torch.zeros(n, kp, dtype=torch.uint8)
    for i1 in range(0, kp, LAZY_BLOCK):
        i2 = min(i1 + LAZY_BLOCK, kp)
        w1 = wq[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % gw == 0:
                set_group(p, fmt, col, _choose(rule, fmt, w1[:, i : i + gw], d[col : col + gw], g))
            c, q = quantize_columns(fmt, w1[:, i : i + 1], p, col)
            codes[:, col] = c[:, 0]
            e = (w1[:, i] - q[:, 0]) / hinv1[i, i]
            w1[:, i:] -= e[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = e
        wq[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    return to_quantized_tensor(fmt, codes, p, (n, k))


def _inverse_cholesky_upper(h: torch.Tensor, name: str) -> torch.Tensor:
    """Upper Cholesky factor of H^-1 (float64: the only step that needs it)."""
    try:
        lower = torch.linalg.cholesky(h)
        hinv = torch.cholesky_inverse(lower)
        return torch.linalg.cholesky(hinv, upper=True)
    except RuntimeError:
        raise ValueError(f"{name}: the damped Hessian is not positive definite "
                         "(too few calibration tokens? raise --nsamples)") from None
