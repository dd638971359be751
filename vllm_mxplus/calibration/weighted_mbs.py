"""Input-weighted MBS-D byte: argmin over all 256 m of sum_k d_k (x_k - x_hat_k)^2.

The same one-pass evaluation of all 256 candidates as the spec's exact search
(formats/mbs_search.py, docs/numerics.md "Macro Block Scaling"), with every element's
contribution multiplied by its weight d_k = E[x_k^2]: per block and scale option the sums
A(m) = sum d |x| value X and B(m) = sum d (value X)^2 change only where an element's E2M1 code
steps, so difference arrays give WSSE(m) = sum d x^2 - 2 A(m) / F_m + B(m) / F_m^2 for all m.
The objective uses the exact quotient value X / F for x_hat instead of its fp32 rounding, which
can only reorder candidates whose errors agree to ~2^-23 relative; ties go to the smaller m.
Macro blocks outside the safe exponent range (see mbs_search) fall back to the spec's MBS-D.
"""

from __future__ import annotations

import torch

from vllm_mxplus.formats.constants import MACRO_BLOCK, MBS_DENOM, OAS_MANTISSA, SMALL_BLOCK
from vllm_mxplus.formats.e2m1 import E2M1_VALUES
from vllm_mxplus.formats.e8m0 import float_exponent_mantissa, pow2_f32
from vllm_mxplus.formats.mbs_search import (
    SAFE_MAX,
    SAFE_MIN,
    _code,
    _first_true,
    _strict_thresholds,
    _take,
    mbs_dynamic,
)

CHUNK_ELEMS = 1 << 17  # macro blocks per pass ~ 0.5 MB fp32 per temporary (as mbs_search)


def _weighted_sse(xm: torch.Tensor, dm: torch.Tensor) -> torch.Tensor:
    """Weighted SSE float64 [n, 256] for macro blocks xm fp32 [n, L], weights dm [n, L]."""
    block = SMALL_BLOCK
    n, length = xm.shape
    dev = xm.device
    nb = length // block
    ax = xm.reshape(n, nb, block).abs()
    a = ax.amax(-1)
    a_safe = torch.where(a > 0, a, torch.ones_like(a))
    e, man = float_exponent_mantissa(a_safe)
    dup = (man > OAS_MANTISSA).to(torch.int32)
    s0 = e - 2 + dup
    m_star = _first_true(a_safe, pow2_f32(e + dup) * 1.75).flatten()

    thr = _strict_thresholds(dev)
    vals = torch.tensor(E2M1_VALUES + (6.0, 6.0), dtype=torch.float64, device=dev)
    vals2 = vals * vals
    dvals = vals[1:] - vals[:-1]
    dvals2 = vals2[1:] - vals2[:-1]
    width = MBS_DENOM + 1
    diff_a = torch.zeros(n * width, dtype=torch.float64, device=dev)
    diff_b = torch.zeros(n * width, dtype=torch.float64, device=dev)
    macro_of_block = torch.arange(n, device=dev).repeat_interleave(nb) * width
    pos_star = macro_of_block + m_star
    pos_end = macro_of_block + MBS_DENOM
    d64 = dm.double().flatten()
    axd = ax.flatten().double() * d64

    for k in (0, 1):
        xk = pow2_f32(s0 + k).double().flatten()
        u = (ax * pow2_f32(-(s0 + k))[..., None]).flatten()
        c0 = _code(u, thr)
        s_a = (axd * _take(vals, c0)).view(-1, block).sum(-1) * xk
        s_b = (d64 * _take(vals2, c0)).view(-1, block).sum(-1) * (xk * xk)
        step_a = torch.zeros_like(s_a)
        step_b = torch.zeros_like(s_b)
        for level in (0, 1):
            c = (c0 + level).clamp(max=7)
            t = _take(thr, c)
            sel = (u * 2.0 > t).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            b = _first_true(_take(u, sel), _take(t, sel))
            blk = sel // block
            cs = _take(c, sel)
            xb = _take(xk, blk)
            w_a = _take(axd, sel) * _take(dvals, cs) * xb
            w_b = _take(d64, sel) * _take(dvals2, cs) * (xb * xb)
            ms = _take(m_star, blk)
            if k == 0:
                before = b < ms
                pos = torch.where(before, _take(macro_of_block, blk) + b, _take(pos_end, blk))
                step_a.index_add_(0, blk, w_a * before)
                step_b.index_add_(0, blk, w_b * before)
            else:
                pos = _take(macro_of_block, blk) + torch.maximum(b, ms)
            diff_a.index_add_(0, pos, w_a)
            diff_b.index_add_(0, pos, w_b)
        if k == 0:
            diff_a.index_add_(0, macro_of_block, s_a)
            diff_b.index_add_(0, macro_of_block, s_b)
            diff_a.index_add_(0, pos_star, -(s_a + step_a))
            diff_b.index_add_(0, pos_star, -(s_b + step_b))
        else:
            diff_a.index_add_(0, pos_star, s_a)
            diff_b.index_add_(0, pos_star, s_b)

    big_a = diff_a.view(n, width).cumsum(1)[:, :MBS_DENOM]
    big_b = diff_b.view(n, width).cumsum(1)[:, :MBS_DENOM]
    f = 1.0 + torch.arange(MBS_DENOM, dtype=torch.float64, device=dev) / MBS_DENOM
    energy = (xm.double().square() * dm.double()).sum(-1, keepdim=True)
    return energy - 2.0 * big_a / f + big_b / (f * f)


def weighted_mbs_dynamic(
    w: torch.Tensor, d: torch.Tensor, macro_block: int = MACRO_BLOCK
) -> torch.Tensor:
    """Weighted MBS-D bytes uint8 [N, Kp/macro_block] for finite fp32 w [N, Kp] (Kp whole
    macro blocks of macro_block elements, a multiple of the 16-element block), weights
    d [Kp] >= 0."""
    n, kp = w.shape
    nm = kp // macro_block
    xm = w.reshape(-1, macro_block)
    dm = (
        d.to(torch.float32)
        .reshape(1, nm, macro_block)
        .expand(n, nm, macro_block)
        .reshape(-1, macro_block)
    )
    out = torch.zeros(xm.shape[0], dtype=torch.int64, device=w.device)
    a = xm.reshape(xm.shape[0], -1, SMALL_BLOCK).abs().amax(-1)
    nonzero = (a > 0).any(-1)
    in_range = ((a == 0) | ((a >= SAFE_MIN) & (a <= SAFE_MAX))).all(-1)
    fast = (nonzero & in_range).nonzero().squeeze(-1)
    slow = (nonzero & ~in_range).nonzero().squeeze(-1)
    step = max(1, CHUNK_ELEMS // macro_block)
    for i in range(0, fast.numel(), step):
        rows = fast[i : i + step]
        out[rows] = _weighted_sse(xm[rows], dm[rows]).argmin(-1)
    if slow.numel():  # tiny or huge magnitudes: the spec's unweighted byte
        out[slow] = mbs_dynamic(xm[slow], macro_block).squeeze(-1).long()
    return out.to(torch.uint8).reshape(n, nm)
