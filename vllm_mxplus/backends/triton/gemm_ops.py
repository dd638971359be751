"""The kernels of `mx_gemm` and `act_quant_plus` as torch custom ops (traceable by
torch.compile, opaque to CUDA graphs' Python):

  torch.ops.vllm_mxplus.triton_mx_gemm(xc, xs, xe, xg, wc, ws, we, wg, K, bias, out_dtype,
                                       fmt, block_size, macro_block) -> y [M, N]
  torch.ops.vllm_mxplus.triton_act_quant_mxplus(x) -> (codes, scales, block_max_index)
  torch.ops.vllm_mxplus.triton_act_quant_nvfp4_given(x, g) -> (codes, e4m3 scales)

The fake (meta) implementations give every output's shape and dtype from the inputs alone.
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.library import op_name
from vllm_mxplus.backends.triton.act_quant_plus import act_quant_mxplus, act_quant_nvfp4_given
from vllm_mxplus.backends.triton.mx_gemm import mx_gemm
from vllm_mxplus.backends.triton.ops import act_quant_op
from vllm_mxplus.formats import get_format
from vllm_mxplus.formats.constants import MX_BLOCK, ceil_div


@torch.library.custom_op(op_name("triton_mx_gemm"), mutates_args=())
def mx_gemm_op(
    x_codes: torch.Tensor,
    x_scales: torch.Tensor,
    x_extra: torch.Tensor | None,
    x_global: torch.Tensor | None,
    w_codes: torch.Tensor,
    w_scales: torch.Tensor,
    w_extra: torch.Tensor | None,
    w_global: torch.Tensor | None,
    K: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    fmt: str,
    block_size: int,
    macro_block: int,
) -> torch.Tensor:
    """`mx_gemm.mx_gemm` on (codes, scales, extra, global) operands; fmt 'e8m0' | 'nvfp4' |
    'mxplus'; extra: MBS bytes (or None) / MX+ block-max indices; global: NVFP4 fp32 scales."""
    return mx_gemm(
        (x_codes, x_scales, x_extra, x_global),
        (w_codes, w_scales, w_extra, w_global),
        K,
        bias,
        out_dtype,
        fmt=fmt,
        block_size=block_size,
        macro_block=macro_block,
    )


@mx_gemm_op.register_fake
def _mx_gemm_fake(xc, xs, xe, xg, wc, ws, we, wg, K, bias, out_dtype, fmt, bs, macro):
    return xc.new_empty((xc.shape[0], wc.shape[0]), dtype=out_dtype)


@torch.library.custom_op(op_name("triton_act_quant_mxplus"), mutates_args=())
def act_quant_mxplus_op(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return act_quant_mxplus(x)


@act_quant_mxplus_op.register_fake
def _act_quant_mxplus_fake(x: torch.Tensor):
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    nb = ceil_div(k, MX_BLOCK)
    return (
        x.new_empty((*lead, ceil_div(k, 2)), dtype=torch.uint8),
        x.new_empty((*lead, nb), dtype=torch.uint8),
        x.new_empty((*lead, nb), dtype=torch.uint8),
    )


@torch.library.custom_op(op_name("triton_act_quant_nvfp4_given"), mutates_args=())
def act_quant_nvfp4_given_op(
    x: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return act_quant_nvfp4_given(x, global_scale)


@act_quant_nvfp4_given_op.register_fake
def _act_quant_nvfp4_given_fake(x: torch.Tensor, global_scale: torch.Tensor):
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    return (
        x.new_empty((*lead, ceil_div(k, 2)), dtype=torch.uint8),
        x.new_empty((*lead, ceil_div(k, 16)), dtype=torch.float8_e4m3fn),
    )


def act_operands(
    x: torch.Tensor, fmt: str, macro_block: int, global_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Rows x [M, K] quantized by the fused Triton quantizer of activation format `fmt`, as
    the GEMM's x operand (codes, scales, extra, global): extra the MBS bytes (E8M0 + MBS) or
    the MX+ block-max indices, global the NVFP4 per-row scales (given ones when
    `global_scale` is passed: row-parallel shards under tensor parallelism)."""

    spec = get_format(fmt)
    if spec.block_max_mantissa:
        return (*act_quant_mxplus_op(x), None)
    if spec.has_global_scale and global_scale is not None:
        g = global_scale.reshape(-1, 1).to(torch.float32)
        return (*act_quant_nvfp4_given_op(x, g), None, g)
    codes, scales, mbs, gs = act_quant_op(x, fmt, macro_block=macro_block)
    return codes, scales, mbs, gs
