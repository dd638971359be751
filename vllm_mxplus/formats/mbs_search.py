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

On a GPU the same search runs densely (`dense=True`): every element is carried through the
step search with a zero weight where it cannot step (instead of gathering the few that can
with `nonzero`), every macro block's near-tied candidates are re-scored together, and the
constants are built on the device, so a tensor is one pass of kernels with no host sync per
chunk. The one host sync per tensor is the question whether any macro block needs the
definition itself (outside the safe range, or more than MAX_RESCORE tied candidates), asked
once at the end (tests/formats/test_mbs_dense.py: the dense pass runs
under the fake-CUDA capture guard, and equals the brute force).
"""

from __future__ import annotations

import torch

from vllm_mxplus.formats.constants import OAS_MANTISSA
from vllm_mxplus.formats.e2m1 import E2M1_THRESHOLDS, E2M1_TIE_ROUNDS_UP, E2M1_VALUES
from vllm_mxplus.formats.e8m0 import float_exponent_mantissa, pow2_f32
from vllm_mxplus.formats.mbs import mbs_dynamic_bruteforce, mbs_sse

N_CAND = 256
SAFE_MIN = 2.0**-100
SAFE_MAX = 2.0**100
MAX_RESCORE = 8  # exact re-scoring of up to this many near-tied candidates per macro block
CHUNK_ELEMS = (
    1 << 17
)  # ~0.5 MB fp32 per temporary: stays in cache, measured ~1.7x faster than 1 << 19
# The dense pass's chunk: ~200 bytes of temporaries per element (the difference arrays, the
# per-element steps, the re-scoring of MAX_RESCORE candidates): ~0.8 GB per chunk.
DENSE_CHUNK_ELEMS = 1 << 22


def _device_constant(values: list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small constant tensor built on the device by fills (no host-to-device copy)."""
    return torch.stack([torch.full((), v, dtype=dtype, device=device) for v in values])


def _strict_threshold_values() -> list[float]:
    """E2M1 thresholds as strict ones (v >= t equals v > prev_float(t) for the tie-up ones),
    plus a sentinel that is never crossed; computed on the host."""
    t = torch.tensor(E2M1_THRESHOLDS, dtype=torch.float32)
    up = torch.tensor(E2M1_TIE_ROUNDS_UP)
    t = torch.where(up, torch.nextafter(t, torch.tensor(0.0)), t)
    return t.tolist() + [3.0e38]


STRICT_THRESHOLDS = _strict_threshold_values()


def _code(u: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude code (int64) as the count of strict thresholds exceeded."""
    c = (u > STRICT_THRESHOLDS[0]).to(torch.uint8)
    for t in STRICT_THRESHOLDS[1:7]:
        c += u > t
    return c.long()


def _take(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """t[idx] for 1-D t: index_select is several times faster than advanced indexing."""
    return t.index_select(0, idx)


def _at(t: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
    """t[sel] for 1-D t, or t itself when sel is None (the dense form: every element)."""
    return t if sel is None else _take(t, sel)


def _first_true(u: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Smallest m in [0, 256] with fp32(u * F_m) > t, for fp32 u > 0 and t (int64).

    The real crossing is estimated in fp32 (error << 1 in m); the predicate is then
    checked exactly at the two integers around it. The predicate is monotone in m and
    is false one step below / true two steps above floor(estimate), because F_m changes
    by 1/256 per step, far more than one fp32 rounding.
    """
    mt = torch.floor(((t / u - 1.0) * 256.0).clamp(-8.0, 1e4))
    # first = mt + [not P(mt)] + [not P(mt + 1)], with F_m = (m + 256) / 256 exact in fp32
    first = mt + (u * ((mt + 256.0) * 0.00390625) <= t) + (u * ((mt + 257.0) * 0.00390625) <= t)
    return first.clamp(0.0, float(N_CAND)).to(torch.int64)


def _approx_sse(
    xm: torch.Tensor, block: int, dm: torch.Tensor | None = None, dense: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(SSE, error bound), each float64 [n, 256], for macro blocks xm fp32 [n, L]; with
    weights dm [n, L] >= 0 the weighted SSE sum_k d_k (x_k - x_hat_k)^2 (bound not computed:
    zeros), which uses the exact quotient value X / F for x_hat.

    Per block and scale option k (X_k = 2^(s0 + k), used for m in [0, m*) when k = 0
    and [m*, 256) when k = 1), A(m) = sum |x| value X and B(m) = sum (value X)^2 are built
    from difference arrays: the m = 0 sums, plus one step per element where its E2M1 code
    rises (at most two per option, found by _first_true on the few elements that can
    reach the next threshold; with dense, every element, weighted by whether it can).
    """
    n, length = xm.shape
    dev = xm.device
    nb = length // block
    ax = xm.reshape(n, nb, block).abs()
    a = ax.amax(-1)
    a_safe = torch.where(a > 0, a, torch.ones_like(a))
    e, man = float_exponent_mantissa(a_safe)
    d = (man > OAS_MANTISSA).to(torch.int32)
    s0 = e - 2 + d
    m_star = _first_true(a_safe, pow2_f32(e + d) * 1.75).flatten()  # scale rises by one here

    thr = _device_constant(STRICT_THRESHOLDS, torch.float32, dev)
    vals = _device_constant([*E2M1_VALUES, 6.0, 6.0], torch.float64, dev)
    vals2 = (vals * vals).float()  # multiples of 1/4 up to 36: exact in fp32
    dvals = vals[1:] - vals[:-1]  # value step when the code rises from c to c + 1
    dvals2 = vals2[1:] - vals2[:-1]
    width = N_CAND + 1
    diff_a = torch.zeros(n * width, dtype=torch.float64, device=dev)
    diff_b = torch.zeros(n * width, dtype=torch.float64, device=dev)
    macro_of_block = torch.arange(n * nb, device=dev) // nb * width
    pos_star = macro_of_block + m_star  # [n*nb] flat position of m* per block
    pos_end = macro_of_block + N_CAND  # the unused slot 256 of each macro block
    axf = ax.flatten()
    ax64 = axf.double()
    d64 = None if dm is None else dm.double().flatten()
    if d64 is not None:
        ax64 = ax64 * d64

    for k in (0, 1):
        xk = pow2_f32(s0 + k).double().flatten()  # [n*nb] block scale X of this option
        u = (ax * pow2_f32(-(s0 + k))[..., None]).flatten()  # exact scaled magnitudes, m = 0
        c0 = _code(u)  # E2M1 code at m = 0
        # sums at m = 0 per block
        s_a = (ax64 * _take(vals, c0)).view(-1, block).sum(-1) * xk
        if d64 is None:
            s_b = _take(vals2, c0).view(-1, block).sum(-1).double() * (xk * xk)
        else:
            s_b = (d64 * _take(vals2, c0)).view(-1, block).sum(-1) * (xk * xk)
        step_a = torch.zeros_like(s_a)
        step_b = torch.zeros_like(s_b)
        for level in (0, 1):
            c = (c0 + level).clamp(max=7)
            t = _take(thr, c)
            can = u * 2.0 > t  # only these can cross t for F < 2
            sel: torch.Tensor | None = None  # dense: every element, no gather
            gate: torch.Tensor | None = None
            if dense:  # its steps weighted 0 where it cannot cross
                gate = can.double()
            else:
                sel = can.nonzero().squeeze(1)
                if sel.numel() == 0:
                    continue
            b = _first_true(_at(u, sel), _at(t, sel))
            blk = (torch.arange(u.numel(), device=dev) if sel is None else sel) // block
            cs = _at(c, sel)
            xb = _take(xk, blk)
            w_a = _at(ax64, sel) * _take(dvals, cs) * xb
            if d64 is None:
                w_b = _take(dvals2, cs).double() * (xb * xb)
            else:
                w_b = _at(d64, sel) * _take(dvals2, cs) * (xb * xb)
            if gate is not None:
                w_a, w_b = w_a * gate, w_b * gate
            ms = _take(m_star, blk)
            if k == 0:  # steps before m* only, each undone at m*; others go to slot 256
                before = b < ms
                pos = torch.where(before, _take(macro_of_block, blk) + b, _take(pos_end, blk))
                step_a.index_add_(0, blk, w_a * before)
                step_b.index_add_(0, blk, w_b * before)
            else:  # a step at or before m* is already in effect at m*
                pos = _take(macro_of_block, blk) + torch.maximum(b, ms)
            diff_a.index_add_(0, pos, w_a)
            diff_b.index_add_(0, pos, w_b)
        if k == 0:  # option 0 holds on [0, m*)
            diff_a.index_add_(0, macro_of_block, s_a)
            diff_b.index_add_(0, macro_of_block, s_b)
            diff_a.index_add_(0, pos_star, -(s_a + step_a))
            diff_b.index_add_(0, pos_star, -(s_b + step_b))
        else:  # option 1 holds on [m*, 256)
            diff_a.index_add_(0, pos_star, s_a)
            diff_b.index_add_(0, pos_star, s_b)

    big_a = diff_a.view(n, width).cumsum(1)[:, :N_CAND]
    big_b = diff_b.view(n, width).cumsum(1)[:, :N_CAND]
    f = 1.0 + torch.arange(N_CAND, dtype=torch.float64, device=dev) / 256.0
    if dm is not None:
        energy = (xm.double().square() * dm.double()).sum(-1, keepdim=True)
        return energy - 2.0 * big_a / f + big_b / (f * f), torch.zeros_like(big_a)
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


def _pick_dense(xm: torch.Tensor, macro: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes int64 [n], needs the definition bool [n]) for safe macro blocks xm [n, macro],
    without a host sync: every block's candidates within the bound are re-scored exactly
    (up to MAX_RESCORE, in increasing m, so argmin's first minimum is the smaller m)."""
    n = xm.shape[0]
    sse, tol = _approx_sse(xm, block, dense=True)
    best_hi = (sse + tol).amin(-1, keepdim=True)
    cand = (sse - tol) <= best_hi
    idx = torch.arange(N_CAND, device=xm.device)
    order = torch.where(cand, idx, N_CAND + idx).sort(-1).values[:, :MAX_RESCORE]
    xs = xm[:, None, :].expand(n, MAX_RESCORE, macro).reshape(-1, macro)
    ms = order.clamp(max=N_CAND - 1).reshape(-1, 1).to(torch.uint8)
    exact = mbs_sse(xs, ms, macro, block).view(n, MAX_RESCORE)
    exact = torch.where(order < N_CAND, exact, torch.full_like(exact, float("inf")))
    return order.gather(1, exact.argmin(-1, keepdim=True)).squeeze(-1), cand.sum(-1) > MAX_RESCORE


def _block_kinds(xm: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(fast, slow) bool [n] for macro blocks xm [n, macro]: finite, not all zero, and every
    block absmax in the safe range (the search), or out of it (the definition). The rest
    (all zero, or holding NaN / Inf) get byte 0."""
    a = xm.reshape(xm.shape[0], -1, block).abs().amax(-1)
    live = torch.isfinite(a).all(-1) & (a > 0).any(-1)
    in_range = ((a == 0) | ((a >= SAFE_MIN) & (a <= SAFE_MAX))).all(-1)
    return live & in_range, live & ~in_range


def mbs_dynamic_dense(
    xm: torch.Tensor, macro: int, block: int = 16, dm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sync-free pass over macro blocks xm fp32 [n, macro] (weights dm [n, macro] or
    None): (bytes int64 [n], bool [n] marking the blocks whose byte must come from the
    definition instead: outside the safe range, or more than MAX_RESCORE near-tied candidates).
    All-zero and non-finite blocks get 0, as from the definition. Chunks of DENSE_CHUNK_ELEMS,
    each a fixed sequence of kernels."""
    fast, need = _block_kinds(xm, block)
    # blocks off the fast path become zeros, so that no NaN or huge value reaches an index
    xs = torch.where(fast[:, None], xm, torch.zeros((), dtype=xm.dtype, device=xm.device))
    out = torch.zeros(xm.shape[0], dtype=torch.int64, device=xm.device)
    step = max(1, DENSE_CHUNK_ELEMS // macro)
    for i in range(0, xm.shape[0], step):
        rows = slice(i, i + step)
        if dm is None:
            m, many = _pick_dense(xs[rows], macro, block)
            need[rows] |= many & fast[rows]
        else:
            m = _approx_sse(xs[rows], block, dm[rows], dense=True)[0].argmin(-1)
        out[rows] = torch.where(fast[rows], m, 0)
    return out, need


def mbs_dynamic(
    x: torch.Tensor,
    macro: int,
    block: int = 16,
    weights: torch.Tensor | None = None,
    dense: bool | None = None,
) -> torch.Tensor:
    """MBS-D bytes (uint8 [..., nM]) for fp32 x [..., nM*macro]; equals the brute force.

    weights: d [nM*macro] >= 0 per column (an input second moment, shared by all rows): the
    input-weighted byte argmin_m sum_k d_k (x_k - x_hat_k)^2 instead (calibrated
    quantization; x_hat as the exact quotient, ties to the smaller m). Macro blocks outside the
    safe exponent range take the unweighted byte.

    dense: the GPU form (one pass of kernels, one host sync per tensor); default: on any
    device but the CPU, where the gathered form is faster."""
    lead = x.shape[:-1]
    xm = x.reshape(-1, macro)
    dm = None
    if weights is not None:
        nm = weights.numel() // macro
        dm = weights.to(torch.float32).reshape(1, nm, macro).expand(xm.shape[0] // nm, nm, macro)
        dm = dm.reshape(-1, macro)
    if dense is None:
        dense = x.device.type != "cpu"
    if dense:
        out, need = mbs_dynamic_dense(xm, macro, block, dm)
        if bool(need.any()):  # the one host sync per tensor
            rows = need.nonzero().squeeze(-1)
            out[rows] = mbs_dynamic_bruteforce(xm[rows], macro, block).squeeze(-1).long()
        return out.to(torch.uint8).reshape(*lead, -1)
    out = torch.zeros(xm.shape[0], dtype=torch.int64, device=x.device)
    fast, slow = _block_kinds(xm, block)
    fast_rows = fast.nonzero().squeeze(-1)
    slow_rows = slow.nonzero().squeeze(-1)
    step = max(1, CHUNK_ELEMS // macro)
    for i in range(0, fast_rows.numel(), step):
        rows = fast_rows[i : i + step]
        if dm is None:
            out[rows] = _pick(xm[rows], macro, block)
        else:
            out[rows] = _approx_sse(xm[rows], block, dm[rows])[0].argmin(-1)
    if slow_rows.numel():
        out[slow_rows] = mbs_dynamic_bruteforce(xm[slow_rows], macro, block).squeeze(-1).long()
    return out.to(torch.uint8).reshape(*lead, -1)
