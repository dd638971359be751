"""Exact MBS-D search without evaluating 256 quantizations per macro block.

The definition (mbs.mbs_dynamic_bruteforce) quantizes every macro block 256 times. Here the
same argmin comes from one pass, using two facts about y = fp32(x * F_m), F_m = 1 + m/256:

1. A block's scale exponent is piecewise constant in m with at most one step: with OAS it
   rises by one exactly when fp32(a * F_m) exceeds the next 1.75 * 2^k above the block
   absmax a. That step m* is found exactly (a few fp32 products around the real crossing).
2. Each element's E2M1 code is a step function of m with at most two steps inside [0, 256)
   (F spans less than one octave and consecutive E2M1 thresholds are >= 1.4x apart); each
   step is also located exactly with fp32 products.

With the codes fixed, SSE(m) = sum x^2 - 2 A(m) / F_m + B(m) / F_m^2 where
A = sum |x| * value * X and B = sum (value * X)^2 change only at those steps: difference
arrays over m plus a cumulative sum give all 256 SSEs in float64. The only gap to the
definition is the fp32 rounding of x_hat = value * X / F, bounded per candidate (Cauchy-
Schwarz); candidates whose SSE intervals overlap the best one are re-scored exactly with
the definition. Macro blocks outside the safe exponent range (|a| < 2^-100 or > 2^100, so
no E8M0 clamping or fp32 overflow can occur) go to the brute force. The result equals the
brute force's argmin, ties to the smaller m (tests/formats/test_mbs.py checks this).
"""

from __future__ import annotations

import torch

from vllm_mxplus.formats.e2m1 import (
    E2M1_THRESHOLDS,
    E2M1_TIE_ROUNDS_UP,
    E2M1_VALUES,
    e2m1_magnitude_code,
)
from vllm_mxplus.formats.e8m0 import float_exponent_mantissa, pow2_f32
from vllm_mxplus.formats.mbs import mbs_dynamic_bruteforce, mbs_sse

N_CAND = 256
SAFE_MIN = 2.0**-100
SAFE_MAX = 2.0**100
MAX_RESCORE = 8  # exact re-scoring of up to this many near-tied candidates per macro block
CHUNK_ELEMS = 1 << 19
OAS_MANTISSA = 0x600000


def _first_true(u: torch.Tensor, t: torch.Tensor, strict: torch.Tensor) -> torch.Tensor:
    """Smallest m in [0, 256] with fp32(u * F_m) > t (strict) or >= t, for u, t fp32.

    The real crossing is estimated in fp32 (error << 1 in m); the predicate is then
    checked exactly at the two integers around it. The predicate is monotone in m and
    is false two steps below / true one step above the estimate, because F_m changes by
    1/256 per step, far more than one fp32 rounding.
    """
    r = ((t / u - 1.0) * 256.0).nan_to_num(nan=1e4, posinf=1e4).clamp(-8.0, 1e4)
    mt = torch.where(strict, torch.floor(r) + 1.0, torch.ceil(r))

    def pred(m: torch.Tensor) -> torch.Tensor:
        y = u * ((m + 256.0) / 256.0)
        return torch.where(strict, y > t, y >= t)

    first = mt - 1.0 + (~pred(mt - 1.0)).float() + (~pred(mt)).float()
    return first.clamp(0.0, float(N_CAND)).to(torch.int64)


def _approx_sse(xm: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(SSE, error bound), each float64 [n, 256], for macro blocks xm fp32 [n, L]."""
    n, length = xm.shape
    dev = xm.device
    nb = length // block
    ax = xm.reshape(n, nb, block).abs()
    a = ax.amax(-1)
    a_safe = torch.where(a > 0, a, torch.ones_like(a))
    e, man = float_exponent_mantissa(a_safe)
    d = (man > OAS_MANTISSA).to(torch.int32)
    s0 = e - 2 + d
    big_t = pow2_f32(e + d) * 1.75
    m_star = _first_true(a_safe, big_t, torch.ones_like(a, dtype=torch.bool))  # [n, nb]

    thr = torch.tensor(E2M1_THRESHOLDS + (1e30,), device=dev)
    tie_up = torch.tensor(E2M1_TIE_ROUNDS_UP + (True,), device=dev)
    vals = torch.tensor(E2M1_VALUES + (6.0, 6.0), dtype=torch.float64, device=dev)

    diff = torch.zeros(n * (N_CAND + 1), 2, dtype=torch.float64, device=dev)
    row = torch.arange(n, device=dev)[:, None]  # [n, 1]
    ax64 = ax.double()

    for k in (0, 1):
        xk = pow2_f32(s0 + k)  # [n, nb] block scale X for this option
        u = ax * pow2_f32(-(s0 + k))[..., None]  # exact scaled magnitudes at m = 0
        c0 = e2m1_magnitude_code(u).long()
        b1 = _first_true(u, thr[c0], ~tie_up[c0])
        b2 = _first_true(u, thr[(c0 + 1).clamp(max=7)], ~tie_up[(c0 + 1).clamp(max=7)])
        b1 = torch.where(c0 < 7, b1, N_CAND)
        b2 = torch.where(c0 < 6, b2, N_CAND)
        if k == 0:
            lo, hi = torch.zeros_like(m_star), m_star
        else:
            lo, hi = m_star, torch.full_like(m_star, N_CAND)
        active = lo < hi  # [n, nb]
        lo_e, hi_e = lo[..., None], hi[..., None]

        def code_at(m: torch.Tensor) -> torch.Tensor:
            return c0 + (m >= b1).long() + (m >= b2).long()

        xk64 = xk.double()[..., None]

        def weights(c: torch.Tensor) -> torch.Tensor:
            q = vals[c] * xk64
            return torch.stack([ax64 * q, q * q], dim=-1)  # A and B terms

        w_start = weights(code_at(lo_e)).sum(2)  # [n, nb, 2]
        w_end = weights(code_at(hi_e - 1)).sum(2)
        act = active[..., None].double()
        diff.index_add_(0, (row * (N_CAND + 1) + lo).flatten(), (w_start * act).reshape(-1, 2))
        diff.index_add_(0, (row * (N_CAND + 1) + hi).flatten(), (-w_end * act).reshape(-1, 2))
        for b, c_before in ((b1, c0), (b2, c0 + 1)):
            inside = (b > lo_e) & (b < hi_e)
            if not bool(inside.any()):
                continue
            c_before = c_before.clamp(max=7)
            step = weights(c_before + 1) - weights(c_before)
            pos = (row[..., None] * (N_CAND + 1) + b)[inside]
            diff.index_add_(0, pos, step[inside])

    cum = diff.view(n, N_CAND + 1, 2).cumsum(1)[:, :N_CAND]
    big_a, big_b = cum[..., 0], cum[..., 1]
    f = 1.0 + torch.arange(N_CAND, dtype=torch.float64, device=dev) / 256.0
    energy = xm.double().square().sum(-1, keepdim=True)
    xhat_energy = big_b / (f * f)
    sse = energy - 2.0 * big_a / f + xhat_energy
    tol = 2.0**-22 * torch.sqrt(sse.clamp(min=0) * xhat_energy) + 2.0**-40 * (energy + xhat_energy)
    return sse, tol


def _pick(xm: torch.Tensor, macro: int, block: int) -> torch.Tensor:
    """Exact MBS-D bytes (int64 [n]) for safe, non-zero macro blocks xm [n, macro]."""
    sse, tol = _approx_sse(xm, block)
    best_hi = (sse + tol).amin(-1, keepdim=True)
    cand = (sse - tol) <= best_hi
    ncand = cand.sum(-1)
    idx = torch.arange(N_CAND, device=xm.device)
    result = torch.where(cand, idx, N_CAND).amin(-1)  # smallest candidate; final if unique

    multi = (ncand > 1) & (ncand <= MAX_RESCORE)
    if bool(multi.any()):
        rows = multi.nonzero().squeeze(-1)
        order = torch.where(cand[rows], idx, N_CAND + idx).sort(-1).values[:, :MAX_RESCORE]
        valid = order < N_CAND
        xs = xm[rows].repeat_interleave(MAX_RESCORE, 0)
        ms = order.clamp(max=N_CAND - 1).reshape(-1, 1).to(torch.uint8)
        exact = mbs_sse(xs, ms, macro, block).view(-1, MAX_RESCORE)
        exact = torch.where(valid, exact, torch.full_like(exact, float("inf")))
        result[rows] = order.gather(1, exact.argmin(-1, keepdim=True)).squeeze(-1)

    many = ncand > MAX_RESCORE
    if bool(many.any()):
        rows = many.nonzero().squeeze(-1)
        result[rows] = mbs_dynamic_bruteforce(xm[rows], macro, block).squeeze(-1).long()
    return result


def mbs_dynamic(x: torch.Tensor, macro: int, block: int = 16) -> torch.Tensor:
    """MBS-D bytes (uint8 [..., nM]) for fp32 x [..., nM*macro]; equals the brute force."""
    lead = x.shape[:-1]
    xm = x.reshape(-1, macro)
    out = torch.zeros(xm.shape[0], dtype=torch.int64, device=x.device)
    a = xm.reshape(xm.shape[0], -1, block).abs().amax(-1)
    finite = torch.isfinite(a).all(-1)
    nonzero = (a > 0).any(-1)
    in_range = ((a == 0) | ((a >= SAFE_MIN) & (a <= SAFE_MAX))).all(-1)
    fast_rows = (finite & nonzero & in_range).nonzero().squeeze(-1)
    slow_rows = (finite & nonzero & ~in_range).nonzero().squeeze(-1)
    step = max(1, CHUNK_ELEMS // macro)
    for i in range(0, fast_rows.numel(), step):
        rows = fast_rows[i : i + step]
        out[rows] = _pick(xm[rows], macro, block)
    if slow_rows.numel():
        out[slow_rows] = mbs_dynamic_bruteforce(xm[slow_rows], macro, block).squeeze(-1).long()
    return out.to(torch.uint8).reshape(*lead, -1)
