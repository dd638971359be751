"""Calibrated quantization of one weight: input-weighted RTN (`rtn-aware`) and GPTQ.

GPTQ (Frantar et al. 2022; the IST-DASLab reference): columns are quantized in natural order
along K; each column's rounding error, divided by the diagonal of the upper Cholesky factor
of H^-1, is spread over the not-yet-quantized columns, within a lazy block of 128 columns at
once and over the rest of the matrix after each block. H = E[x x^T] of the layer's inputs (as
served: activations already fake-quantized), damped by 1% of its mean diagonal. A group's
parameters (block scales, MBS byte, MX+ block-max index) are chosen when GPTQ reaches the
group's first column, from the error-updated weights (formats/params.py), so the output is an
exact encoding of the format (docs/numerics.md, "Formats and schemes").

With H = I no error is propagated (H^-1 is diagonal), so GPTQ returns the RTN result of the
same parameter rule, bit for bit (tests/calibration/test_calibration_gptq.py).

MBS formats take the checkpoint's macro block (`macro_block`, one MBS byte per that many
columns; docs/numerics.md, "Macro Block Scaling"): it is the group whose parameters are chosen
together, and the lazy batch is the smallest multiple of it of at least LAZY_BLOCK columns.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from vllm_mxplus.formats import QuantizedTensor, get_format, to_quantized_tensor
from vllm_mxplus.formats.constants import ceil_div
from vllm_mxplus.formats.e2m1 import e2m1_round
from vllm_mxplus.formats.e8m0 import e8m0_reciprocal, e8m0_to_float
from vllm_mxplus.formats.mx import mbs_factor
from vllm_mxplus.formats.params import (
    GroupParams,
    choose_params,
    empty_params,
    nvfp4_weight_global,
    padded_k,
    quantize_columns,
    set_group,
)

Rule = Literal["spec", "weighted"]
LAZY_BLOCK = 128  # GPTQ's lazy batch, rounded up to a multiple of the group width (_lazy)
DAMP = 0.01  # fraction of the mean Hessian diagonal added to the diagonal


def _global(
    fmt: str, w: torch.Tensor, given: torch.Tensor | None, name: str
) -> torch.Tensor | None:
    """The fixed nvfp4 global scale: the caller's `given` (a checkpoint layout's own rule,
    e.g. ct_format.py's power of two per fused layer), else the plugin's rule on the original
    weight (nvfp4_weight_global); None for the formats without one."""
    if not get_format(fmt).has_global_scale:
        if given is not None:
            raise ValueError(f"{name}: {fmt} has no global scale, yet one was given")
        return None
    if given is None:
        return nvfp4_weight_global(w)
    g = given.to(torch.float32).reshape(())
    if not (bool(torch.isfinite(g)) and bool(g > 0)):
        raise ValueError(f"{name}: the given nvfp4 global scale {float(g)} is not positive")
    return g


def _choose(
    rule: Rule,
    fmt: str,
    w: torch.Tensor,
    d: torch.Tensor,
    g: torch.Tensor | None,
    macro_block: int,
) -> GroupParams:
    weights = None if rule == "spec" else d
    return choose_params(fmt, w, g, macro_block=macro_block, weights=weights)


def _lazy(gw: int) -> int:
    """GPTQ's lazy batch: LAZY_BLOCK columns rounded up to whole groups of gw columns, so a
    group's columns (whose parameters are chosen at its first) lie in one batch; 128 for
    every group width that divides it (16, 32, 64, 128)."""
    return ceil_div(LAZY_BLOCK, gw) * gw


def check_weight(w: torch.Tensor, what: str) -> torch.Tensor:
    if w.dim() != 2:
        raise ValueError(
            f"{what}: calibrated methods take a 2-D weight, got shape {tuple(w.shape)}"
        )
    w = w.to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError(
            f"{what}: the weight holds NaN/Inf; calibrated methods need finite "
            "weights (use --method rtn)"
        )
    return w


def rtn_aware(
    w: torch.Tensor,
    d: torch.Tensor,
    fmt: str,
    rule: Rule = "weighted",
    name: str = "weight",
    *,
    macro_block: int,
    global_scale: torch.Tensor | None = None,
) -> QuantizedTensor:
    """RTN with the group parameters chosen by `rule` (weighted by d = E[x^2] [K]); MBS
    formats: one byte per `macro_block` columns. global_scale: nvfp4's fixed global scale
    (default: the plugin's rule on w, nvfp4_weight_global)."""
    w = check_weight(w, name)
    n, k = w.shape
    kp = padded_k(fmt, k, macro_block)
    wp = F.pad(w, (0, kp - k))
    dp = F.pad(d.to(torch.float32), (0, kp - k))
    p = _choose(rule, fmt, wp, dp, _global(fmt, w, global_scale, name), macro_block)
    codes, _ = quantize_columns(fmt, wp, p, 0)
    return to_quantized_tensor(fmt, codes, p, (n, k))


def prepare_hessian(
    h: torch.Tensor, k: int, name: str = "weight", damp: float = DAMP
) -> tuple[torch.Tensor, torch.Tensor]:
    """(upper Cholesky factor of the damped H^-1 padded to whole groups fp32, dead columns).

    Depends on H only: linears that share their input (q/k/v, gate/up) compute it once.
    """
    if h.shape != (k, k):
        raise ValueError(f"{name}: Hessian shape {tuple(h.shape)} does not match K = {k}")
    h = h.to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype)
    return _inverse_cholesky_upper(h, name).to(torch.float32), dead


def gptq(
    w: torch.Tensor,
    h: torch.Tensor,
    fmt: str,
    rule: Rule = "weighted",
    name: str = "weight",
    damp: float = DAMP,
    prepared: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    macro_block: int,
    global_scale: torch.Tensor | None = None,
) -> QuantizedTensor:
    """GPTQ of w [N, K] under Hessian h [K, K] (any positive scale), natural column order.

    prepared: prepare_hessian(h, K) when the caller already has it. macro_block: MBS formats'
    elements per MBS byte (a positive multiple of the block size; the caller checks it).
    global_scale: nvfp4's global scale, fixed for the whole run (default: the plugin's rule
    on the original w, nvfp4_weight_global).
    """
    w = check_weight(w, name)
    n, k = w.shape
    hinv, dead = prepared if prepared is not None else prepare_hessian(h, k, name, damp)
    d_diag = torch.diagonal(h).to(torch.float32)
    g = _global(fmt, w, global_scale, name)  # fixed: from the original weight, or given
    kp = padded_k(fmt, k, macro_block)
    gw = get_format(fmt).group_size(macro_block)
    lazy = _lazy(gw)
    # padding columns are zero and independent (identity in H^-1): they quantize to 0
    hinv = F.pad(hinv, (0, kp - k, 0, kp - k))
    hinv[torch.arange(k, kp), torch.arange(k, kp)] = 1.0
    d = F.pad(d_diag, (0, kp - k))
    # transposed ([K, N]): one column of W is one contiguous row here
    wt = F.pad(w.masked_fill(dead[None, :], 0.0), (0, kp - k)).t().contiguous()
    qt = torch.empty_like(wt)
    p = empty_params(fmt, n, kp, g, macro_block)
    for i1 in range(0, kp, lazy):
        i2 = min(i1 + lazy, kp)
        w1 = wt[i1:i2].clone()
        err1 = torch.empty_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % gw == 0:
                slab = w1[i : i + gw].t().contiguous()
                set_group(p, fmt, col, _choose(rule, fmt, slab, d[col : col + gw], g, macro_block))
                cq = _ColumnQuantizer(fmt, p, col, gw)
            q = cq(w1[i], col)
            qt[col] = q
            e = (w1[i] - q) / hinv1[i, i]
            w1[i + 1 :].sub_(torch.outer(hinv1[i, i + 1 :], e))
            err1[i] = e
        wt[i2:].sub_(hinv[i1:i2, i2:].t() @ err1)
    w_hat = qt.t()
    codes, again = quantize_columns(fmt, w_hat, p, 0)
    if not torch.equal(again, w_hat):  # the fast column path must be the spec's rounding
        raise RuntimeError(
            f"{name}: GPTQ column quantizer disagrees with the format's "
            "rounding (a bug; please report it)"
        )
    return to_quantized_tensor(fmt, codes, p, (n, k))


class _ColumnQuantizer:
    """Round one column to its group's grid with the parameters gathered once per group.

    Same fp32 operations as formats.params.quantize_columns (checked after the run): E8M0
    y = fp32(w F), v = |y| 2^-s, x_hat = (value X) / F; nvfp4 v = |w| / (s g), x_hat = value s g.
    """

    def __init__(self, fmt: str, p: GroupParams, col0: int, width: int):
        spec = get_format(fmt)
        self.fmt, self.p, self.generic = fmt, p, spec.block_max_mantissa
        blk = torch.arange(col0, col0 + width) // spec.block_size
        self.col0 = col0
        self.f: torch.Tensor | None = None
        if spec.has_global_scale:
            g = p.global_scale
            assert g is not None  # nvfp4 parameters carry the global scale
            sf = p.scales[:, blk].to(torch.float32).t().contiguous()  # [width, N]
            self.zero = (sf == 0) | ~torch.isfinite(sf)
            self.div_in = torch.where(self.zero, torch.ones_like(sf), sf * g)
            self.sf, self.g = sf, g
            self.nv = True
            return
        self.nv = False
        sc = p.scales[:, blk].t().contiguous()
        self.recip = e8m0_reciprocal(sc)
        self.x = e8m0_to_float(sc)
        if spec.mbs:
            assert p.mbs is not None  # MBS formats' parameters carry the bytes
            self.f = mbs_factor(p.mbs[:, col0 // p.macro_block]).expand(width, -1)

    def __call__(self, w: torch.Tensor, col: int) -> torch.Tensor:
        i = col - self.col0
        if self.generic:  # MX+: the block-max element has its own grid
            return quantize_columns(self.fmt, w[:, None], self.p, col)[1][:, 0]
        if self.nv:
            v = w.abs() / self.div_in[i]
            q = torch.copysign(e2m1_round(v), w)
            return torch.where(self.zero[i], torch.zeros_like(q), (q * self.sf[i]) * self.g)
        y = w if self.f is None else w * self.f[i]
        q = torch.copysign(e2m1_round(y.abs() * self.recip[i]), y) * self.x[i]
        return q if self.f is None else q / self.f[i]


def split_rows(q: QuantizedTensor, rows: list[int]) -> list[QuantizedTensor]:
    """A weight quantized as the row concatenation of several (gptq_fused) back into its parts.

    Every stored tensor of the E8M0 formats is per row, so each part is exactly what the part
    quantized alone would give; nvfp4's per-tensor global scale is not, hence not fused.
    """
    if q.global_scale is not None:
        raise ValueError("split_rows: a weight with a global scale cannot be split by rows")
    out, r0 = [], 0
    for r in rows:
        sl = slice(r0, r0 + r)
        out.append(
            QuantizedTensor(
                codes=q.codes[sl].contiguous(),
                scales=q.scales[sl].contiguous(),
                spec=q.spec,
                shape=torch.Size((r, q.shape[-1])),
                mbs=None if q.mbs is None else q.mbs[sl].contiguous(),
                block_max_index=None
                if q.block_max_index is None
                else q.block_max_index[sl].contiguous(),
                macro_block=q.macro_block,
            )
        )
        r0 += r
    return out


def can_fuse_rows(fmt: str) -> bool:
    """Whether linears sharing H can run as one GPTQ over their stacked rows: GPTQ, the group
    parameters and the rounding are row by row, except nvfp4's per-tensor global scale."""
    return not get_format(fmt).has_global_scale


def _inverse_cholesky_upper(h: torch.Tensor, name: str) -> torch.Tensor:
    """Upper Cholesky factor of H^-1 (float64: the only step that needs it)."""
    try:
        lower = torch.linalg.cholesky(h)
        hinv = torch.cholesky_inverse(lower)
        return torch.linalg.cholesky(hinv, upper=True)
    except RuntimeError:
        raise ValueError(
            f"{name}: the damped Hessian is not positive definite "
            "(too few calibration tokens? raise --nsamples)"
        ) from None
