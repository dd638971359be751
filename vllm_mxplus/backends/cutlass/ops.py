"""The CUTLASS kernels as torch custom ops (fake implementations for torch.compile), and the
small operand helpers they need. One op per kernel; the prefill logic is in `cutlass_gemm`.

  torch.ops.vllm_mxplus.cutlass_fp8_chunk_gemm(a_fp8, a_scale, b_fp8, b_scale, bias, out_dtype)
      sm_90a: [M, N] = sum_c a_scale[c, :, None] b_scale[c, None, :] (A_c B_c^T) + bias
  torch.ops.vllm_mxplus.cutlass_fp4_mbs_gemm(a_codes, a_sf, b_codes, b_sf, sigma_a, sigma_b,
                                             bias, use_mbs, out_dtype)
      sm_100a: block-scaled FP4, MBS per 128-K chunk (use_mbs) or one full-K launch

Both produce the model's dtype: the sm_90a epilogue writes bf16 for bf16 and fp32 otherwise
(fp16 is then one rounding of the fp32 result, as on the decode path); sm_100a sums in fp32.
Bias is taken in fp32, so an fp16 or fp32 bias is never rounded to bf16.
"""

from __future__ import annotations

from types import ModuleType

import torch

from vllm_mxplus.backends.cutlass.build import load_extension
from vllm_mxplus.backends.cutlass.fp8_chunks import BLOCK, CHUNK, ceil_to, pad_last, pad_rows
from vllm_mxplus.backends.library import op_name
from vllm_mxplus.formats.mx import mbs_factor

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _ext() -> ModuleType:
    """The loaded extension; an error naming why when it is not built or does not load."""
    ext = load_extension()
    if ext is None:
        from vllm_mxplus.backends.cutlass import build

        raise RuntimeError(f"CUTLASS extension unavailable: {build._EXT_ERROR}")
    return ext


def _check_out_dtype(out_dtype: torch.dtype) -> None:
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"CUTLASS prefill: out_dtype must be bf16, fp16 or fp32, got {out_dtype}")


def bias_f32(bias: torch.Tensor | None, npad: int) -> torch.Tensor | None:
    """bias [N] -> fp32 [npad] (zeros past N), contiguous: what both kernels read."""
    if bias is None:
        return None
    return torch.nn.functional.pad(bias.to(torch.float32), (0, npad - bias.shape[0])).contiguous()


@torch.library.custom_op(op_name("cutlass_fp8_chunk_gemm"), mutates_args=())
def fp8_chunk_gemm(
    a_fp8: torch.Tensor,
    a_scale: torch.Tensor,
    b_fp8: torch.Tensor,
    b_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """sm_90a: out_dtype [M, N] = sum_c a_scale[c,:,None] b_scale[c,None,:] (A_c B_c^T) + bias
    (bias fp32 [N] or None)."""
    _check_out_dtype(out_dtype)
    kernel_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    out = a_fp8.new_empty((a_fp8.shape[0], b_fp8.shape[0]), dtype=kernel_dtype)
    _ext().sm90_fp8_chunk_gemm(a_fp8, a_scale, b_fp8, b_scale, bias, out)
    return out if kernel_dtype == out_dtype else out.to(out_dtype)


@fp8_chunk_gemm.register_fake
def _(a_fp8, a_scale, b_fp8, b_scale, bias, out_dtype):
    _check_out_dtype(out_dtype)
    return a_fp8.new_empty((a_fp8.shape[0], b_fp8.shape[0]), dtype=out_dtype)


@torch.library.custom_op(op_name("cutlass_fp4_mbs_gemm"), mutates_args=())
def fp4_mbs_gemm(
    a_codes: torch.Tensor,
    a_sf: torch.Tensor,
    b_codes: torch.Tensor,
    b_sf: torch.Tensor,
    sigma_a: torch.Tensor,
    sigma_b: torch.Tensor,
    bias: torch.Tensor | None,
    use_mbs: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """sm_100a: out_dtype [M, N]; a_sf / b_sf packed by pack_scales_sm100 (chunk 128 when
    use_mbs, else the whole K: one launch); sigma_* fp32 [K/128, ceil4(rows)] from
    sigma_chunks (read only when use_mbs); bias fp32 [N] or None."""
    _check_out_dtype(out_dtype)
    acc = _ext().sm100_fp4_mbs_gemm(a_codes, a_sf, b_codes, b_sf, sigma_a, sigma_b, use_mbs)
    if bias is not None:
        acc = acc + bias
    return acc.to(out_dtype)


@fp4_mbs_gemm.register_fake
def _(a_codes, a_sf, b_codes, b_sf, sigma_a, sigma_b, bias, use_mbs, out_dtype):
    _check_out_dtype(out_dtype)
    return a_codes.new_empty((a_codes.shape[0], b_codes.shape[0]), dtype=out_dtype)


def sigma_chunks(
    mbs: torch.Tensor | None, rows: int, k: int, device: torch.device | None = None
) -> torch.Tensor:
    """fp32(1/F) per (chunk, row) as [Kp/128, ceil4(rows)] (16-byte aligned chunk rows), on
    mbs's device (or `device` when mbs is None: F = 1, built there, never copied)."""
    nc = ceil_to(k, CHUNK) // CHUNK
    if mbs is None:
        return torch.ones((nc, ceil_to(rows, 4)), dtype=torch.float32, device=device)
    m = pad_rows(pad_last(mbs, nc), ceil_to(rows, 4))
    return (1.0 / mbs_factor(m)).t().contiguous()


def pack_scales_sm100(scales: torch.Tensor, k: int, chunk_k: int = CHUNK) -> torch.Tensor:
    """Row-major E8M0 [R, K/16] -> CUTLASS's interleaved SF layout, chunk by chunk (CUDA);
    chunk_k = K packs the whole K as one chunk (the no-MBS single launch)."""
    return _ext().sm100_pack_scales(pad_last(scales, k // BLOCK).contiguous(), k, chunk_k)
