"""The CUTLASS prefill GEMM as a function API: weights prepared once, y = Q(x) W_hat^T (+ bias).

Two kernels (`cutlass_ops`), both computing acc = sum_c sigma_a[i,c] sigma_b[j,c]
(A_c B_c^T)[i,j] with sigma = fp32(1/F) per 128-K chunk (paper section 4.3.2;
docs/numerics.md, "Kernel numerics and error bounds"):

- sm_90a (H100/H200, no FP4 tensor cores): operands re-encoded as FP8 per (row, chunk)
  (`fp8_chunks`); activations in one Triton kernel straight from x (`act_fp8`) where
  the format has one, else the Triton act-quant and the torch encoder.
- sm_100a (B200): native block-scaled FP4 MMA; one launch per 128-K chunk with MBS, one
  launch over the whole K without (`mxfp4-16`, `mxfp4-16-oas`).

Every step inside the prefill ops is CUDA-graph safe: fixed shapes, no host sync, nothing
allocated on or copied from the CPU (tests/backends/test_graph_guard_fake_cuda.py runs them
under a fake CUDA device and fails on any of those). The sm_90a exact fallback is part of that:
activation rows with an inexact FP8 chunk (rare: a chunk whose block exponents span more than
14 binades) are found with `nonzero_static` (at most VLLM_MXPLUS_SM90_FALLBACK_ROWS = 64 rows
per call) and recomputed from a two-operand split (`split_fp8_chunks`; from x, one Triton
kernel `act_fp8_split_rows`) by the same kernel, high and low operands stacked in one launch;
a row the split cannot make exact (a NaN block, a span over 28 binades) or past that capacity
gets NaN (its scales are poisoned before the GEMM), never a silently wrong number. Weight rows
with an inexact chunk are known at load and recomputed against the spec's x_hat.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from vllm_mxplus import settings
from vllm_mxplus.backends.cutlass import act_fp8
from vllm_mxplus.backends.cutlass.act_fp8 import act_fp8_split_rows
from vllm_mxplus.backends.cutlass.fp8_chunks import (
    BLOCK,
    CHUNK,
    Fp8ChunkLayout,
    ceil_to,
    encode_fp8_chunks,
    pad_last,
    pad_rows,
    split_fp8_chunks,
)
from vllm_mxplus.backends.cutlass.ops import (
    bias_f32,
    fp4_mbs_gemm,
    fp8_chunk_gemm,
    pack_scales_sm100,
    sigma_chunks,
)
from vllm_mxplus.backends.library import op_name
from vllm_mxplus.backends.triton.ops import act_quant_op
from vllm_mxplus.formats import QuantizedTensor, fake_quantize, get_format
from vllm_mxplus.formats.e2m1 import unpack_fp4
from vllm_mxplus.formats.mx import dequantize_mbs

# rows_split(idx) -> (fp8 [2R, Kp], scale [Kp/128, 2R], exact rows [R]): activation rows idx
# split into a high operand (rows [0, R)) and a low one (rows [R, 2R)), `split_fp8_chunks`
RowsSplit = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _prefill_op(name: str, impl: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`impl` as the opaque custom op vllm_mxplus::<name>, with its fake: [M, n] in
    `out_dtype`, M the rows of the first argument (each prefill op's activation rows)."""
    op = torch.library.custom_op(op_name(name), impl, mutates_args=())
    sig = inspect.signature(impl)

    @op.register_fake
    def _(*args, **kwargs):
        bound = sig.bind(*args, **kwargs).arguments
        rows = next(iter(bound.values()))
        return rows.new_empty((rows.shape[0], bound["n"]), dtype=bound["out_dtype"])

    return op


class Sm90Weight(NamedTuple):
    """The weight arguments of the sm_90a ops, in their order."""

    fp8: torch.Tensor  # float8_e4m3fn [Np, Kp]
    scale: torch.Tensor  # fp32 [Kp/128, Np]
    fallback_idx: torch.Tensor | None  # rows with an inexact chunk (known at load)
    fallback_w: torch.Tensor | None  # their exact fp32 W_hat rows


@dataclass
class PreparedWeight:
    """A weight [N, K] in the kernel's runtime layout (built once at load)."""

    arch: str
    n: int
    k: int
    use_mbs: bool = True  # False: neither operand has MBS (sm_100a: one full-K launch)
    layout: Fp8ChunkLayout | None = None  # sm90a
    codes: torch.Tensor | None = None  # sm100a: [Np, Kp/2]
    sf: torch.Tensor | None = None  # sm100a: packed per chunk (or for the whole K)
    sigma: torch.Tensor | None = None  # sm100a: [Kp/128, Np] fp32 (empty without MBS)
    fallback_idx: torch.Tensor | None = None  # sm90a: rows with an inexact chunk
    fallback_w: torch.Tensor | None = None  # their exact fp32 W_hat rows

    def sm90_operands(self) -> Sm90Weight:
        """The sm_90a ops' weight arguments (w_fp8, w_scale, fallback_idx, fallback_w)."""
        assert self.layout is not None, "sm90_operands of a weight not prepared for sm90a"
        return Sm90Weight(self.layout.fp8, self.layout.scale, self.fallback_idx, self.fallback_w)


def prepare_weight(
    qweight: QuantizedTensor, arch: str, activation_mbs: bool = True
) -> PreparedWeight:
    """QuantizedTensor [N, K] (E8M0 block 16, optional MBS) -> PreparedWeight for `arch`.
    activation_mbs: whether the activations will carry MBS bytes (sm_100a packs the weight
    scales per 128-K chunk then, else for one full-K launch)."""
    n, k = qweight.shape
    npad, kp = ceil_to(n, 8), ceil_to(k, CHUNK)
    codes = pad_rows(qweight.codes, npad)
    scales = pad_rows(qweight.scales, npad)
    mbs = None if qweight.mbs is None else pad_rows(qweight.mbs, npad)
    use_mbs = mbs is not None or activation_mbs
    if arch == "sm90a":
        lay = encode_fp8_chunks(codes, scales, mbs, k)
        bad = (~lay.exact_rows[:n]).nonzero().flatten()  # at load: a host sync is fine here
        w_bad = qweight.dequantize(torch.float32)[bad] if bad.numel() else None
        return PreparedWeight(arch, n, k, use_mbs, layout=lay, fallback_idx=bad, fallback_w=w_bad)
    if arch == "sm100a":
        dev = codes.device
        return PreparedWeight(
            arch,
            n,
            k,
            use_mbs,
            codes=pad_last(codes, kp // 2).contiguous(),
            sf=pack_scales_sm100(scales, kp, CHUNK if use_mbs else kp),
            sigma=(
                sigma_chunks(mbs, npad, k, dev)
                if use_mbs
                else torch.empty(0, dtype=torch.float32, device=dev)
            ),
        )
    raise ValueError(f"unknown arch {arch!r} (expected 'sm90a' or 'sm100a')")


# ----------------------------------------------------------------------------- sm_90a
def _sm90_gemm(
    xl: Fp8ChunkLayout,
    rows_split: RowsSplit,
    x_hat_all: Callable[[], torch.Tensor],
    w: Sm90Weight,
    bias: torch.Tensor | None,
    n: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """The sm_90a GEMM on an activation layout with both exact fallbacks (module docstring).
    rows_split(idx) gives the two-operand split of activation rows idx (`RowsSplit`); x_hat_all()
    the spec's fp32 x_hat of every row (used only when the weight has inexact rows).

    Two GEMM launches per call: all rows, then the fallback rows' high and low operands
    stacked as one [2 * cap, Kp] operand (fp32 out; high + bias, then + low, in fp32)."""
    m = xl.fp8.shape[0]
    b32 = bias_f32(bias, w.fp8.shape[0])
    nan = float("nan")  # a Python scalar: no tensor built on (or copied from) the host
    bad = ~xl.exact_rows  # [M]
    cap = min(settings.sm90_fallback_rows(), m)
    lost = bad
    if cap:
        found = torch.nonzero_static(bad, size=cap, fill_value=-1)[:, 0]  # no host sync
        valid = found >= 0
        slot = torch.where(valid, found, m)  # row m: a spare slot
        patched = torch.zeros(m + 1, dtype=torch.bool, device=bad.device)
        lost = bad & ~patched.index_fill_(0, slot, True)[:m]
    # rows that stay inexact come out NaN: poison their scales ([nc, M], cheap) up front
    scale = torch.where(lost[None, :], nan, xl.scale)
    y = fp8_chunk_gemm(xl.fp8, scale, w.fp8, w.scale, b32, out_dtype)
    y = y[:, :n].contiguous() if y.shape[1] != n else y
    if cap:
        # unused slots repeat the first found row (or row 0 when none) and write exactly what
        # that row gets, so duplicate indices in index_put_ agree
        idx = torch.where(valid, found, found[:1].clamp(min=0))
        fp8_2, scale_2, exact = rows_split(idx)
        v2 = fp8_chunk_gemm(fp8_2, scale_2, w.fp8, w.scale, None, torch.float32)[:, :n]
        hi = v2[:cap] if b32 is None else v2[:cap] + b32[:n]
        v = torch.where(exact[:, None], hi + v2[cap:], nan)
        v = torch.where(valid[:, None], v, v[:1])
        v = torch.where(valid[:1, None], v.to(y.dtype), y[idx])  # none found: a no-op write
        y.index_put_((idx,), v)
    if w.fallback_idx is not None and w.fallback_w is not None and w.fallback_idx.numel():
        cols = F.linear(x_hat_all(), w.fallback_w)  # static (known at load): no sync
        if b32 is not None:
            cols = cols + b32[w.fallback_idx]
        y[:, w.fallback_idx] = cols.to(y.dtype)
    return y


def _stacked_split(
    codes: torch.Tensor, scales: torch.Tensor, mbs: torch.Tensor | None, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`split_fp8_chunks` of quantized rows, its two operands stacked (`RowsSplit`)."""
    hi, lo, exact = split_fp8_chunks(codes, scales, mbs, k)
    return torch.cat([hi.fp8, lo.fp8]), torch.cat([hi.scale, lo.scale], dim=1), exact


def _codes_x_hat(
    x_codes: torch.Tensor, x_scales: torch.Tensor, x_mbs: torch.Tensor | None, k: int
) -> torch.Tensor:
    """The spec's fp32 x_hat [M, K] from codes / E8M0 scales / MBS bytes (F = 1 without)."""
    kp = ceil_to(k, CHUNK)
    c = F.pad(unpack_fp4(x_codes, k), (0, kp - k))
    s = pad_last(x_scales, kp // BLOCK)
    mb = (
        pad_last(x_mbs, kp // CHUNK)
        if x_mbs is not None
        else x_codes.new_zeros((x_codes.shape[0], kp // CHUNK))
    )
    return dequantize_mbs(c, s, mb, BLOCK)[:, :k]


def prefill_sm90_impl(
    x_codes: torch.Tensor,
    x_scales: torch.Tensor,
    x_mbs: torch.Tensor | None,
    k: int,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    fallback_idx: torch.Tensor | None,
    fallback_w: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """From quantized activations: re-encode them in torch (`encode_fp8_chunks`), GEMM."""
    return _sm90_gemm(
        encode_fp8_chunks(x_codes, x_scales, x_mbs, k),
        lambda idx: _stacked_split(
            x_codes[idx], x_scales[idx], None if x_mbs is None else x_mbs[idx], k
        ),
        lambda: _codes_x_hat(x_codes, x_scales, x_mbs, k),
        Sm90Weight(w_fp8, w_scale, fallback_idx, fallback_w),
        bias,
        n,
        out_dtype,
    )


_prefill_sm90 = _prefill_op("cutlass_prefill_sm90", prefill_sm90_impl)


def prefill_sm90_fused_impl(
    x: torch.Tensor,
    fmt: str,
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    x_ref: torch.Tensor,
    x_mbs: torch.Tensor,
    x_exact: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    fallback_idx: torch.Tensor | None,
    fallback_w: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """From activation rows x [M, K] and their fused FP8 layout (`act_fp8`): GEMM;
    inexact rows are re-quantized from x and split in one Triton kernel
    (`act_fp8_split_rows`, bit for bit `split_fp8_chunks` of `formats.quantize(x[idx])`)."""

    xl = Fp8ChunkLayout(
        fp8=x_fp8, scale=x_scale, ref=x_ref, mbs=x_mbs, exact=x_exact, k=x.shape[-1]
    )
    w = Sm90Weight(w_fp8, w_scale, fallback_idx, fallback_w)
    return _sm90_gemm(
        xl,
        lambda idx: act_fp8_split_rows(x, fmt, idx),
        lambda: fake_quantize(x, fmt),
        w,
        bias,
        n,
        out_dtype,
    )


_prefill_sm90_fused = _prefill_op("cutlass_prefill_sm90_fused", prefill_sm90_fused_impl)


# ----------------------------------------------------------------------------- sm_100a
def prefill_sm100_impl(
    x_codes: torch.Tensor,
    x_scales: torch.Tensor,
    x_mbs: torch.Tensor | None,
    k: int,
    w_codes: torch.Tensor,
    w_sf: torch.Tensor,
    w_sigma: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    use_mbs: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    kp = ceil_to(k, CHUNK)
    m = x_codes.shape[0]
    sig = sigma_chunks(x_mbs, m, k, x_codes.device) if use_mbs else w_sigma
    y = fp4_mbs_gemm(
        pad_last(x_codes, kp // 2).contiguous(),
        pack_scales_sm100(x_scales, kp, CHUNK if use_mbs else kp),
        w_codes,
        w_sf,
        sig,
        w_sigma,
        bias_f32(bias, w_codes.shape[0]),
        use_mbs,
        out_dtype,
    )
    return y[:, :n].contiguous() if y.shape[1] != n else y


_prefill_sm100 = _prefill_op("cutlass_prefill_sm100", prefill_sm100_impl)


# ----------------------------------------------------------------------------- API
def prefill_gemm(
    x_codes: torch.Tensor,
    x_scales: torch.Tensor,
    x_mbs: torch.Tensor | None,
    k: int,
    w: PreparedWeight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """y [M, N] = x_hat W_hat^T (+ bias) in out_dtype from quantized activations (codes /
    E8M0 scales / MBS bytes, [M, ...]) and a prepared weight. One opaque custom op per arch,
    so torch.compile never traces into the fallback."""
    if x_mbs is not None and not w.use_mbs:
        raise ValueError(
            "prefill_gemm: activations carry MBS bytes but the weight was prepared "
            "without MBS (prepare_weight(..., activation_mbs=True))"
        )
    if w.arch == "sm90a":
        return torch.ops.vllm_mxplus.cutlass_prefill_sm90(
            x_codes, x_scales, x_mbs, k, *w.sm90_operands(), bias, w.n, out_dtype
        )
    return torch.ops.vllm_mxplus.cutlass_prefill_sm100(
        x_codes, x_scales, x_mbs, k, w.codes, w.sf, w.sigma, bias, w.n, w.use_mbs, out_dtype
    )


def prefill_gemm_from_x(
    x: torch.Tensor,
    fmt: str,
    w: PreparedWeight,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """y [M, N] = Q(x) W_hat^T (+ bias) from activation rows x [M, K] (bf16/fp16/fp32).

    sm_90a with an activation format of the fused kernel (`act_fp8.supports`): one
    Triton kernel writes the FP8 layout straight from x, then the GEMM op. Otherwise: the
    Triton act-quant, then `prefill_gemm`. Same numbers either way."""

    if w.arch == "sm90a" and act_fp8.supports(fmt):
        xl = act_fp8.act_quant_fp8_chunks_op(x, fmt, CHUNK)
        return torch.ops.vllm_mxplus.cutlass_prefill_sm90_fused(
            x, fmt, *xl.fields(), *w.sm90_operands(), bias, w.n, out_dtype
        )

    codes, scales, mbs, _ = act_quant_op(x, fmt, macro_block=CHUNK)
    return prefill_gemm(
        codes, scales, mbs if get_format(fmt).mbs else None, x.shape[-1], w, bias, out_dtype
    )
