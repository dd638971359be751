"""A format's group parameters (block scales, MBS bytes, MX+ block-max index, NVFP4 global
scale) and the element encoding under GIVEN parameters: the one pair every quantizer uses
(`formats.quantize`, the calibrated methods, the evaluation's activation options).

    p = choose_params(fmt, x, macro_block=...)            # the spec's choice (= quantize)
    p = choose_params(fmt, x, macro_block=..., weights=d)  # input-weighted (calibration)
    p = choose_params(fmt, x, macro_block=..., mbs=m)      # given MBS bytes, spec scales
    codes = encode(fmt, x, p)                              # elements under p, whole tensor
    codes, x_hat = quantize_columns(fmt, x, p, col0)       # a column slab (GPTQ)

The spec's choice is exactly the parameters `formats.quantize` picks; the input-weighted
choice is the encoding, among those the format allows, that
minimises sum_k d_k (w_k - w_hat_k)^2 over each group, d_k = E[x_k^2] (the diagonal of the
layer's input Hessian). What moves per format (docs/numerics.md, "Formats and schemes"):

* E8M0 block scales (mxfp4-ocp, mxfp4-16*, mxplus, both MBS formats): each block's exponent
  among the spec rule's choice and its two neighbours (ties keep the spec's choice);
* mxfp4-mbs-d: the macro block's byte m, exhaustive over all 256 with the blocks' OAS
  exponents (ties to the smaller m, like the spec's MBS-D), then the exponents as above: one
  round of coordinate descent. mxfp4-mbs-s keeps the static byte of the spec;
  the macro block is the checkpoint's (`--macro-block N`, any positive multiple of the block
  size; docs/numerics.md, "Macro Block Scaling"): one byte per N columns, N = 128 by default;
* nvfp4: each E4M3 block scale among the spec's code and its +-4 neighbouring codes, the
  fp32 global scale fixed (from the original weight by the plugin's rule, or the one the
  caller's checkpoint layout stores: gptq.py's `global_scale`).

`quantize_columns` then rounds elements to nearest (ties to even code) under the given
parameters with the very fp32 operations of `formats` (docs/numerics.md, "E2M1 elements",
"Macro Block Scaling"), so every result is an exact encoding: dequantizing it and quantizing
again with the same parameters returns the same codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_mxplus.formats.constants import (
    E8M0_NAN,
    NO_BLOCK_MAX,
    ceil_div,
)
from vllm_mxplus.formats.e2m1 import (
    e2m1_decode,
    e2m1_magnitude_code,
    e2m1_round,
    sign_bit,
)
from vllm_mxplus.formats.e8m0 import e8m0_block_scale, e8m0_reciprocal, e8m0_to_float
from vllm_mxplus.formats.mbs import mbs_static
from vllm_mxplus.formats.mbs_search import mbs_dynamic
from vllm_mxplus.formats.mx import apply_macro, encode_e8m0_blocks, mbs_factor
from vllm_mxplus.formats.mxplus import encode_mxplus_blocks, mxplus_block_max_index
from vllm_mxplus.formats.nvfp4 import encode_nvfp4_blocks, nvfp4_block_scales, nvfp4_global_scale
from vllm_mxplus.formats.schemes import FormatSpec, as_format

E4M3_MAX_CODE = 126  # uint8 bits of float8_e4m3fn 448.0; 127 is NaN
E4M3_SEARCH = 4  # nvfp4: codes c0 - 4 .. c0 + 4 (one code = 1/8 of a binade)


@dataclass
class GroupParams:
    """Parameters of a padded weight [N, Kp] (Kp a multiple of FormatSpec.group_size).

    scales: uint8 E8M0 codes, or float8_e4m3fn (nvfp4), [N, Kp/block].
    mbs: uint8 [N, Kp/macro_block] (MBS formats). bm_index: uint8 [N, Kp/32] (mxplus; 255 =
    none). global_scale: fp32 [] (nvfp4). macro_block: elements per MBS byte (MBS formats;
    docs/numerics.md, "Macro Block Scaling").
    """

    scales: torch.Tensor
    mbs: torch.Tensor | None = None
    bm_index: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    macro_block: int = field(kw_only=True)


def padded_k(fmt: str | FormatSpec, k: int, macro_block: int) -> int:
    gw = as_format(fmt).group_size(macro_block)
    return ceil_div(k, gw) * gw


def empty_params(
    fmt: str | FormatSpec, n: int, kp: int, global_scale: torch.Tensor | None, macro_block: int
) -> GroupParams:
    """Parameters to be filled group by group (gptq): zero scales, no block max."""
    spec = as_format(fmt)
    nb = kp // spec.block_size
    if spec.has_global_scale:
        scales = torch.zeros(n, nb, dtype=torch.float8_e4m3fn)
    else:
        scales = torch.zeros(n, nb, dtype=torch.uint8)
    mbs = torch.zeros(n, kp // macro_block, dtype=torch.uint8) if spec.mbs else None
    bm = torch.full((n, nb), NO_BLOCK_MAX, dtype=torch.uint8) if spec.block_max_mantissa else None
    return GroupParams(scales, mbs, bm, global_scale, macro_block=macro_block)


def set_group(p: GroupParams, fmt: str | FormatSpec, col0: int, g: GroupParams) -> None:
    """Copy the parameters g of the group slab starting at column col0 into p."""
    spec = as_format(fmt)
    b0 = col0 // spec.block_size
    p.scales[:, b0 : b0 + g.scales.shape[1]] = g.scales
    if p.mbs is not None:
        assert g.mbs is not None  # same format: the group has MBS bytes too
        assert g.macro_block == p.macro_block, "group and weight differ in macro block"
        m0 = col0 // p.macro_block
        p.mbs[:, m0 : m0 + g.mbs.shape[1]] = g.mbs
    if p.bm_index is not None:
        assert g.bm_index is not None
        p.bm_index[:, b0 : b0 + g.bm_index.shape[1]] = g.bm_index


def nvfp4_weight_global(w: torch.Tensor) -> torch.Tensor:
    """The nvfp4 global scale of the ORIGINAL weight (kept fixed by the calibrated methods)."""
    return nvfp4_global_scale(w.to(torch.float32), per_row=False)


def choose_params(
    fmt: str | FormatSpec,
    w: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    *,
    macro_block: int,
    weights: torch.Tensor | None = None,
    mbs: torch.Tensor | None = None,
) -> GroupParams:
    """The group parameters of fp32 w [..., Kp] (Kp whole groups) for a format.

    weights None: the spec's choice, exactly what `formats.quantize` picks; weights d [Kp]
    (>= 0, w 2-D and finite): the input-weighted choice (module docstring). mbs: given MBS
    bytes [..., Kp/macro_block] (an MBS format; block scales then by the spec's rule).
    global_scale: NVFP4's fp32 global scale ([] or [..., 1]); None computes the spec's per
    tensor (`nvfp4_global_scale`)."""
    spec = as_format(fmt)
    if spec.has_global_scale and global_scale is None:
        global_scale = nvfp4_global_scale(w, per_row=False)
    if weights is not None:
        return _weighted_params(spec, w, weights, global_scale, macro_block=macro_block)
    return _spec_params(spec, w, global_scale, macro_block=macro_block, mbs=mbs)


def _spec_params(
    spec: FormatSpec,
    w: torch.Tensor,
    global_scale: torch.Tensor | None,
    *,
    macro_block: int,
    mbs: torch.Tensor | None = None,
) -> GroupParams:
    if spec.has_global_scale:
        assert global_scale is not None  # choose_params supplies it
        s = nvfp4_block_scales(w, global_scale)
        return GroupParams(s, global_scale=global_scale, macro_block=macro_block)
    if spec.block_max_mantissa:
        s = _e8m0_scales(w, spec.block_size, spec.scale_rule)
        return GroupParams(s, bm_index=mxplus_block_max_index(w, s), macro_block=macro_block)
    if spec.mbs:
        m = mbs
        if m is None:
            m = mbs_static(w, macro_block) if spec.mbs == "static" else mbs_dynamic(w, macro_block)
        y = apply_macro(w, mbs_factor(m), "mul")
        return GroupParams(
            _e8m0_scales(y, spec.block_size, spec.scale_rule), mbs=m, macro_block=macro_block
        )
    return GroupParams(_e8m0_scales(w, spec.block_size, spec.scale_rule), macro_block=macro_block)


def _e8m0_scales(y: torch.Tensor, block: int, rule: str) -> torch.Tensor:
    return e8m0_block_scale(y.reshape(*y.shape[:-1], -1, block).abs().amax(-1), rule)


def encode(fmt: str | FormatSpec, x: torch.Tensor, p: GroupParams) -> torch.Tensor:
    """Unpacked E2M1 codes [..., Kp] of fp32 x [..., Kp] under the parameters p, the whole
    tensor at once: round to nearest, ties to the even code (docs/numerics.md, "E2M1
    elements"); NaN/Inf blocks get code 0 (their scale carries the NaN)."""
    spec = as_format(fmt)
    if spec.has_global_scale:
        assert p.global_scale is not None  # NVFP4 parameters carry the global scale
        return encode_nvfp4_blocks(x, p.scales, p.global_scale)
    if spec.block_max_mantissa:
        assert p.bm_index is not None  # MX+ parameters carry the block-max index
        return encode_mxplus_blocks(x, p.scales, p.bm_index)
    if spec.mbs:
        assert p.mbs is not None  # MBS parameters carry the bytes
        x = apply_macro(x, mbs_factor(p.mbs), "mul")
    return encode_e8m0_blocks(x, p.scales, spec.block_size)


# --- element quantization under given parameters ---------------------------------------


def quantize_columns(
    fmt: str | FormatSpec, w: torch.Tensor, p: GroupParams, col0: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, w_hat fp32) of fp32 columns w [N, c] = columns col0.. of the weight.

    The parameters of every block the columns touch must already be in p.
    """
    spec = as_format(fmt)
    n, c = w.shape
    cols = torch.arange(col0, col0 + c)
    blk = cols // spec.block_size
    neg = sign_bit(w).to(torch.uint8) << 3
    if spec.has_global_scale:
        sf = p.scales[:, blk].to(torch.float32)
        g = p.global_scale
        assert g is not None  # nvfp4 parameters carry the global scale
        zero = (sf == 0) | ~torch.isfinite(sf)
        denom = torch.where(zero, torch.ones_like(sf), sf * g)
        codes = e2m1_magnitude_code(w.abs() / denom) | neg
        codes = torch.where(zero, torch.zeros_like(codes), codes)
        return codes, (e2m1_decode(codes) * sf) * g
    sc = p.scales[:, blk]
    if spec.mbs:
        assert p.mbs is not None  # MBS formats' parameters carry the bytes
        f = mbs_factor(p.mbs[:, cols // p.macro_block])
        y = w * f
    else:
        y = w
    v = y.abs() * e8m0_reciprocal(sc)
    codes = e2m1_magnitude_code(v) | neg
    is_nan = sc == E8M0_NAN
    codes = torch.where(is_nan, torch.zeros_like(codes), codes)
    x = e8m0_to_float(sc)
    if spec.block_max_mantissa:
        assert p.bm_index is not None  # MX+ parameters carry the block-max index
        is_bm = p.bm_index[:, blk].long() == (cols % spec.block_size)
        j = torch.round(2.0 * v - 8.0).clamp(0, 7).to(torch.uint8)
        codes = torch.where(is_bm & ~is_nan, j | neg, codes)
        mag = 4.0 + 0.5 * (codes & 0x7).to(torch.float32)
        bm_val = torch.where((codes & 0x8) > 0, -mag, mag) * x
        return codes, torch.where(is_bm, bm_val, e2m1_decode(codes) * x)
    w_hat = e2m1_decode(codes) * x
    if spec.mbs:
        w_hat = w_hat / f
    return codes, w_hat


# --- the input-weighted choice ------------------------------------------------------------


def _weighted_params(
    spec: FormatSpec,
    w: torch.Tensor,
    d: torch.Tensor,
    global_scale: torch.Tensor | None,
    *,
    macro_block: int,
) -> GroupParams:
    """Input-weighted parameters for fp32 w [N, Kp] (whole groups, finite), d [Kp] >= 0."""
    fmt = spec
    base = (
        _spec_params(spec, w, global_scale, macro_block=macro_block)
        if spec.mbs != "dynamic"
        else None
    )
    if spec.has_global_scale:
        assert base is not None  # nvfp4 has no MBS
        return GroupParams(
            _weighted_e4m3(spec, w, d, base), global_scale=global_scale, macro_block=macro_block
        )
    if spec.mbs == "dynamic":
        m = mbs_dynamic(w, macro_block, spec.block_size, weights=d)
        base = GroupParams(
            _e8m0_scales(apply_macro(w, mbs_factor(m), "mul"), spec.block_size, spec.scale_rule),
            mbs=m,
            macro_block=macro_block,
        )
    assert base is not None
    return _weighted_e8m0(fmt, w, d, base)


def _values(fmt: str | FormatSpec, w: torch.Tensor, p: GroupParams) -> torch.Tensor:
    """quantize_columns(fmt, w, p, 0)[1] by a shorter path (value rounding, no codes), for
    the formats without a block-max element; the same fp32 operations."""
    spec = as_format(fmt)
    if spec.block_max_mantissa:
        return quantize_columns(fmt, w, p, 0)[1]
    n = w.shape[0]
    wb = w.reshape(n, -1, spec.block_size)
    if spec.has_global_scale:
        assert p.global_scale is not None
        sf = p.scales.to(torch.float32)[..., None]
        zero = (sf == 0) | ~torch.isfinite(sf)
        denom = torch.where(zero, torch.ones_like(sf), sf * p.global_scale)
        q = torch.copysign(e2m1_round(wb.abs() / denom), wb)
        return torch.where(zero, torch.zeros_like(q), (q * sf) * p.global_scale).reshape(w.shape)
    if spec.mbs:
        assert p.mbs is not None
        f = mbs_factor(p.mbs)[..., None]
        y = (w.reshape(n, -1, p.macro_block) * f).reshape(wb.shape)
    else:
        y = wb
    q = torch.copysign(e2m1_round(y.abs() * e8m0_reciprocal(p.scales)[..., None]), y)
    q = q * e8m0_to_float(p.scales)[..., None]
    if spec.mbs:
        q = q.reshape(n, -1, p.macro_block) / f
    return q.reshape(w.shape)


def _block_err(
    fmt: str | FormatSpec, w: torch.Tensor, d: torch.Tensor, p: GroupParams
) -> torch.Tensor:
    """sum_k d_k (w_k - w_hat_k)^2 per block [N, nb] (fp64 sums of fp32 terms)."""
    block = as_format(fmt).block_size
    w_hat = _values(fmt, w, p)
    e = (w - w_hat).square() * d
    return e.reshape(w.shape[0], -1, block).sum(-1, dtype=torch.float64)


def _weighted_e8m0(
    fmt: str | FormatSpec, w: torch.Tensor, d: torch.Tensor, base: GroupParams
) -> GroupParams:
    """Each block's E8M0 exponent among the base choice and its two neighbours."""
    spec = as_format(fmt)
    c0 = base.scales
    movable = (c0 != E8M0_NAN) & (w.reshape(w.shape[0], -1, spec.block_size) != 0).any(-1)
    best = base.scales.clone()
    best_bm = None if base.bm_index is None else base.bm_index.clone()
    best_err = _block_err(fmt, w, d, base)
    for delta in (-1, 1):
        c = (c0.to(torch.int32) + delta).clamp(0, E8M0_NAN - 1).to(torch.uint8)
        c = torch.where(movable, c, c0)
        bm = _mxplus_bm(w, c) if spec.block_max_mantissa else None
        cand = GroupParams(c, base.mbs, bm, macro_block=base.macro_block)
        err = _block_err(fmt, w, d, cand)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, c, best)
        if bm is not None:
            assert best_bm is not None  # MX+: the base choice has a block-max index too
            best_bm = torch.where(better, bm, best_bm)
    return GroupParams(best, base.mbs, best_bm, macro_block=base.macro_block)


def _mxplus_bm(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MX+ block-max index for given scales, by the spec's rule (scaled max >= 4, else none)."""
    wb = w.reshape(w.shape[0], -1, 32)
    idx = wb.abs().argmax(-1, keepdim=True)
    vmax = wb.gather(-1, idx).abs() * e8m0_reciprocal(scale)[..., None]
    has = (vmax >= 4.0) & (scale != E8M0_NAN)[..., None]
    return torch.where(has, idx, torch.full_like(idx, NO_BLOCK_MAX)).squeeze(-1).to(torch.uint8)


def _weighted_e4m3(
    spec: FormatSpec, w: torch.Tensor, d: torch.Tensor, base: GroupParams
) -> torch.Tensor:
    """Each nvfp4 block's E4M3 scale among the spec's code and its +-E4M3_SEARCH neighbours."""
    c0 = base.scales.view(torch.uint8).to(torch.int32)
    movable = (c0 > 0) & (c0 <= E4M3_MAX_CODE)
    best = c0.clone()
    best_err = _block_err(spec, w, d, base)
    for delta in [s * k for k in range(1, E4M3_SEARCH + 1) for s in (-1, 1)]:
        c = torch.where(movable, (c0 + delta).clamp(1, E4M3_MAX_CODE), c0)
        cand = GroupParams(
            c.to(torch.uint8).view(torch.float8_e4m3fn),
            global_scale=base.global_scale,
            macro_block=base.macro_block,
        )
        err = _block_err(spec, w, d, cand)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, c, best)
    return best.to(torch.uint8).view(torch.float8_e4m3fn)
