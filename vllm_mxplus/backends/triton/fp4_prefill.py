"""`triton-fp4-prefill`: prefill on Blackwell's block-scaled FP4 tensor cores (sm_100), every
E8M0 scheme (block 16 / 32, MBS at macro block 128 or none) and NVFP4, K a multiple of 128
(other layers: `triton-fp8-prefill`), no extension build.

Per call: the fused Triton act-quant (formats' codes, scales, MBS bytes), the activations'
E8M0 scales re-expressed per group (`fp4_rel_scales`), then one launch of `fp4_scaled_gemm`
(MBS applied per 128-K chunk inside it). The weight's scales are re-expressed once at load;
the weight stays packed: its UE4M3 bits (a byte per 16 weights; NVFP4's own scales where their
rows are aligned) and one fp32 factor per row and 128-K chunk (per row without MBS), about
0.09 bytes per weight besides the packed form the decode backend holds (0.66 in all with MBS).

Exact everywhere: activation rows the relative scales cannot hold (`fp4_rel_scales`: a
block more than 17 binades below its group's largest, values beyond about 2^+-55, a NaN
block) are listed on the device and recomputed by the Triton FP4 GEMM from the packed
operands (`mx_gemm_rows`: no host sync, work following their number), weight rows of that
kind are known at load and their output columns come from the same GEMM, as the sm_90
pipelines do (`cutlass.gemm`). Error bound: docs/numerics.md, "The block-scaled FP4 MMA on
sm_100".
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_mxplus.backends.base import Layer, LinearSpec, set_packed_buffers
from vllm_mxplus.backends.library import op_name
from vllm_mxplus.backends.triton import launch
from vllm_mxplus.backends.triton.decode_gemm import WIDE_BLOCK_MS
from vllm_mxplus.backends.triton.fp4_rel_scales import CHUNK, rel_scales, rel_scales_torch
from vllm_mxplus.backends.triton.fp4_scaled_gemm import (
    CAPABILITY_MAJOR,
    fp4_scaled_gemm,
    scale_bits_per_chunk,
)
from vllm_mxplus.backends.triton.gemm_ops import act_operands
from vllm_mxplus.backends.triton.linear import ATTRS, GLOBAL_ATTR, TritonDecodeBackend
from vllm_mxplus.backends.triton.mx_gemm import mx_gemm, mx_gemm_rows, operand_format
from vllm_mxplus.formats import QuantizedTensor, get_format

# the weight's operand for the FP4 MMA: codes are the packed ones (ATTRS[0])
FP4_ATTRS = ("mxplus_fp4_w_scales", "mxplus_fp4_w_factors", "mxplus_fp4_w_inexact")
# From the M where the decode GEMM takes its 64-row tile: one 128-row pass of the FP4 MMA
# (issue-bound by the MBS promotion) is estimated ahead of it there, behind the 32-row tile
# below (`benchmarks/gpu_static_model.py`, B200, Llama-3-8B's linears at M = 33-64 and
# 65-128: about 1.1 ms against 1.2 and 2.1 ms; docs/benchmarks.md); the decode GEMM serves
# below, and every M of layers this backend does not take.
FP4_PREFILL_MIN_M = WIDE_BLOCK_MS[0] + 1


def fp4_operand(
    codes: Tensor,
    scales: Tensor,
    extra: Tensor | None,
    g: Tensor | None,
    fmt: str,
    k: int,
    at_load: bool = False,
) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor]:
    """((codes, UE4M3 bits, factors), inexact rows bool [R]) of one packed operand of format
    `fmt` (formats' codes, scales, MBS bytes, NVFP4 global scales); at_load: the torch form of
    the relative scales (the weight's, on any device), else the Triton kernel (per call)."""
    spec = get_format(fmt)
    if spec.has_global_scale:
        if g is None:
            raise ValueError(f"fp4_operand: {fmt} needs its global scales")
        f = g.to(torch.float32).reshape(1, -1).expand(1, codes.shape[0]).contiguous()
        u = scale_bits_per_chunk(scales, k)
        # a NaN/Inf block's scale is E4M3's NaN (0x7F), which the MMA's UE4M3 need not keep:
        # such rows are the fallback's
        return (codes, u, f), ((u & 0x7F) == 0x7F).any(dim=1)
    mbs = extra if spec.mbs else None
    rel = rel_scales_torch if at_load else rel_scales
    u, f, bad = rel(scales, mbs, k, spec.block_size, per_chunk=spec.mbs is not None)
    return (codes, u, f), bad


def fp4_prefill_impl(
    x: Tensor,
    act_format: str,
    weight_format: str,
    macro_block: int,
    w_codes: Tensor,
    w_scales: Tensor,
    w_extra: Tensor | None,
    w_global: Tensor | None,
    w_u: Tensor,
    w_f: Tensor,
    w_inexact: Tensor,
    bias: Tensor | None,
    act_global: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """y [M, N] = Q(x) W_hat^T (+ bias) for rows x [M, K] (module docstring)."""
    k = x.shape[-1]
    x_ops = act_operands(x, act_format, macro_block, act_global)
    a, x_bad = fp4_operand(*x_ops, act_format, k)
    per_chunk = bool(get_format(weight_format).mbs)
    b32 = None if bias is None else bias.to(torch.float32)
    y = fp4_scaled_gemm(a, (w_codes, w_u, w_f), k, b32, out_dtype, per_chunk)
    fmt, bs = operand_format(weight_format)
    w_ops = (w_codes, w_scales, w_extra, w_global)
    # the rows the relative scales cannot hold, listed on the device
    y = mx_gemm_rows(
        y, x_bad, x_ops, w_ops, k, b32, fmt=fmt, block_size=bs, macro_block=macro_block
    )
    if w_inexact.numel():  # weight rows known at load: their output columns
        w_rows = tuple(None if t is None else t[w_inexact] for t in w_ops)
        b_rows = None if b32 is None else b32[w_inexact]
        y[:, w_inexact] = mx_gemm(
            x_ops, w_rows, k, b_rows, y.dtype, fmt=fmt, block_size=bs, macro_block=macro_block
        )
    return y


# the whole pipeline as one opaque custom op (torch.compile never traces into the fallback)
fp4_prefill_op = torch.library.custom_op(
    op_name("triton_fp4_prefill"), fp4_prefill_impl, mutates_args=()
)


@fp4_prefill_op.register_fake
def _fp4_prefill_fake(x, af, wf, macro, wc, *rest):
    out_dtype = rest[-1]
    return x.new_empty((x.shape[0], wc.shape[0]), dtype=out_dtype)


class TritonFp4PrefillBackend(TritonDecodeBackend):
    """M >= FP4_PREFILL_MIN_M on sm_100 (tcgen05's block-scaled FP4 MMA). Registered after
    `cutlass_prefill` (which takes M >= VLLM_MXPLUS_PREFILL_MIN_M where it is built and
    serves the layer) and before the decode backend (which serves the M below) and the
    FP8-chunk pipeline (`triton-fp8-prefill`); it shares the decode backend's packed buffers,
    which its exact fallback reads."""

    name = "triton-fp4-prefill"
    min_m: int = FP4_PREFILL_MIN_M
    max_m: int | None = None

    @classmethod
    def m_bounds(cls) -> tuple[int, int | None]:
        return cls.min_m, cls.max_m

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        if platform != "cuda" or capability is None or capability // 10 != CAPABILITY_MAJOR:
            return False, (
                f"needs CUDA capability 10.x (block-scaled FP4 tensor cores), got {platform} "
                f"{capability}"
            )
        return launch.is_available(torch.device("cuda"))

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        w, a = get_format(spec.weight_format), get_format(spec.activation_format)
        if spec.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False, f"output dtype {spec.out_dtype} (bf16, fp16 or fp32)"
        if spec.k % CHUNK:
            return False, f"K = {spec.k} is not whole {CHUNK}-element chunks (the MMA's K step)"
        if w.has_global_scale and a.has_global_scale:
            return True, ""
        if w.block_max_mantissa or a.block_max_mantissa:
            return False, "MX+ block maxima (the block-scaled MMA has no per-block extra)"
        if not (w.scale_is_e8m0 and a.scale_is_e8m0) or w.block_size != a.block_size:
            return False, f"{spec.weight_format} x {spec.activation_format}: not one E8M0 block"
        if w.block_size not in (16, 32):
            return False, f"block size {w.block_size} (16 or 32)"
        if bool(w.mbs) != bool(a.mbs):
            return False, "MBS on one operand only"
        if w.mbs and spec.macro_block != CHUNK:
            return False, f"macro block {spec.macro_block} (the MMA's 128-K step takes {CHUNK})"
        return True, ""

    def process_weights_after_loading(self, layer: Layer, qweight: QuantizedTensor) -> None:
        super().process_weights_after_loading(layer, qweight)
        codes, scales, extra = (getattr(layer, a) for a in ATTRS)
        g = getattr(layer, GLOBAL_ATTR, None)
        k = qweight.shape[-1]
        (_, u, f), bad = fp4_operand(codes, scales, extra, g, self.spec.weight_format, k, True)
        rows = bad.nonzero()[:, 0]  # at load: one host sync
        set_packed_buffers(layer, FP4_ATTRS, (u, f, rows))

    def apply(
        self, layer: Layer, x: Tensor, bias: Tensor | None, act_global_scale: Tensor | None = None
    ) -> Tensor:
        spec = self.spec
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.ops.vllm_mxplus.triton_fp4_prefill(
            x2,
            spec.activation_format,
            spec.weight_format,
            spec.macro_block,
            *(getattr(layer, a) for a in ATTRS),
            getattr(layer, GLOBAL_ATTR, None),
            *(getattr(layer, a) for a in FP4_ATTRS),
            bias,
            act_global_scale,
            spec.out_dtype,
        )
        return y.reshape(*x.shape[:-1], spec.n)
