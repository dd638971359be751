"""The Triton kernels as torch custom ops, so torch.compile and CUDA graphs can trace them.

  torch.ops.vllm_mxplus.triton_act_quant(x, fmt, macro_block) -> (codes, scales, mbs, global_scale)
  torch.ops.vllm_mxplus.triton_act_quant_hat(x, fmt, macro_block)
      -> (codes, scales, mbs or MX+ block-max indices, global_scale, x_hat, sigma)
  torch.ops.vllm_mxplus.triton_decode_gemm(x_codes, x_scales, x_mbs, w_codes, w_scales, w_mbs,
                                           K, bias=None, out_dtype=bf16, block_size=None,
                                           macro_block=128, *, block_n=None, split_k=None) -> y

A custom op returns tensors only, so absent outputs (mbs without MBS, global_scale outside
nvfp4) come back as empty tensors with a last dim of 0; the Python wrappers below map them
to None. The fake (meta) implementations give every output's shape and dtype from the
inputs alone, which is what torch.compile needs.
"""

from __future__ import annotations

import inspect

import torch

from vllm_mxplus.backends.library import op_name
from vllm_mxplus.backends.triton.act_quant import act_quant, act_quant_hat
from vllm_mxplus.backends.triton.act_quant_plus import act_quant_mxplus_hat
from vllm_mxplus.backends.triton.decode_gemm import decode_gemm
from vllm_mxplus.backends.triton.x_hat import HAT_DTYPE, hat_cols
from vllm_mxplus.formats import get_format
from vllm_mxplus.formats.constants import MX_BLOCK, ceil_div


def _act_quant_shapes(x: torch.Tensor, fmt: str, macro_block: int):
    spec = get_format(fmt)
    lead, k = tuple(x.shape[:-1]), x.shape[-1]
    scale_dtype = spec.scale_dtype
    return (
        ((*lead, ceil_div(k, 2)), torch.uint8),
        ((*lead, ceil_div(k, spec.block_size)), scale_dtype),
        ((*lead, ceil_div(k, macro_block) if spec.mbs else 0), torch.uint8),
        ((*lead, 1 if spec.has_global_scale else 0), torch.float32),
    )


@torch.library.custom_op(op_name("triton_act_quant"), mutates_args=())
def _act_quant_op(
    x: torch.Tensor, fmt: str, macro_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, scales, mbs, gs = act_quant(x, fmt, macro_block=macro_block)
    (_, _, (mbs_shape, _), (gs_shape, _)) = _act_quant_shapes(x, fmt, macro_block)
    if mbs is None:
        mbs = torch.empty(mbs_shape, dtype=torch.uint8, device=x.device)
    if gs is None:
        gs = torch.empty(gs_shape, dtype=torch.float32, device=x.device)
    return codes, scales, mbs, gs


@_act_quant_op.register_fake
def _act_quant_fake(x: torch.Tensor, fmt: str, macro_block: int):
    return tuple(
        x.new_empty(shape, dtype=dtype) for shape, dtype in _act_quant_shapes(x, fmt, macro_block)
    )


def _act_quant_hat_shapes(x: torch.Tensor, fmt: str, macro_block: int):
    """`_act_quant_shapes` with x_hat's and the sigmas' (the MBS bytes' shape in fp32); the
    extra bytes are MX+'s block-max indices for MX+."""
    codes, scales, mbs, gs = _act_quant_shapes(x, fmt, macro_block)
    sigma = (mbs[0], torch.float32)
    if get_format(fmt).block_max_mantissa:
        mbs = ((x.shape[0], ceil_div(x.shape[-1], MX_BLOCK)), torch.uint8)
    return codes, scales, mbs, gs, ((x.shape[0], hat_cols(x.shape[-1])), HAT_DTYPE), sigma


@torch.library.custom_op(op_name("triton_act_quant_hat"), mutates_args=())
def _act_quant_hat_op(
    x: torch.Tensor, fmt: str, macro_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    extra: torch.Tensor | None
    gs: torch.Tensor | None
    sigma: torch.Tensor | None
    if get_format(fmt).block_max_mantissa:  # MX+: its own quantizer; extra = block-max indices
        codes, scales, extra, x_hat = act_quant_mxplus_hat(x)
        gs = sigma = None
    else:
        codes, scales, extra, gs, x_hat, sigma = act_quant_hat(x, fmt, macro_block=macro_block)
    (_, _, (extra_shape, _), (gs_shape, _), _, (sigma_shape, _)) = _act_quant_hat_shapes(
        x, fmt, macro_block
    )
    if extra is None:
        extra = torch.empty(extra_shape, dtype=torch.uint8, device=x.device)
    if gs is None:
        gs = torch.empty(gs_shape, dtype=torch.float32, device=x.device)
    if sigma is None:
        sigma = torch.empty(sigma_shape, dtype=torch.float32, device=x.device)
    return codes, scales, extra, gs, x_hat, sigma


@_act_quant_hat_op.register_fake
def _act_quant_hat_fake(x: torch.Tensor, fmt: str, macro_block: int):
    shapes = _act_quant_hat_shapes(x, fmt, macro_block)
    return tuple(x.new_empty(shape, dtype=dtype) for shape, dtype in shapes)


#: `decode_gemm` itself as a custom op (traceable): one signature, defaults included.
decode_gemm_op = torch.library.custom_op(
    op_name("triton_decode_gemm"), decode_gemm, mutates_args=()
)
_DECODE_GEMM_SIGNATURE = inspect.signature(decode_gemm)


@decode_gemm_op.register_fake
def _decode_gemm_fake(*args, **kwargs):
    """[M, N] in out_dtype: x codes [M, K/2], weight codes [N, K/2]."""
    call = _DECODE_GEMM_SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    xc, wc = call.arguments["x_codes"], call.arguments["w_codes"]
    return xc.new_empty((xc.shape[0], wc.shape[0]), dtype=call.arguments["out_dtype"])


def act_quant_op(
    x: torch.Tensor, fmt: str, *, macro_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`triton_act_quant.act_quant` through the custom op (traceable); same return values."""
    spec = get_format(fmt)
    codes, scales, mbs, gs = torch.ops.vllm_mxplus.triton_act_quant(x, fmt, macro_block)
    return codes, scales, mbs if spec.mbs else None, gs if spec.has_global_scale else None


def act_quant_hat_op(
    x: torch.Tensor, fmt: str, *, macro_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor,
           torch.Tensor | None]:  # fmt: skip
    """`act_quant.act_quant_hat` through the custom op (traceable); same return values. MX+
    too (`act_quant_plus.act_quant_mxplus_hat`: its block-max indices in the third place)."""
    spec = get_format(fmt)
    codes, scales, extra, gs, x_hat, sigma = torch.ops.vllm_mxplus.triton_act_quant_hat(
        x, fmt, macro_block
    )
    return (
        codes,
        scales,
        extra if spec.mbs or spec.block_max_mantissa else None,
        gs if spec.has_global_scale else None,
        x_hat,
        sigma if spec.mbs else None,
    )
