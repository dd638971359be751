"""Grouped MoE expert GEMMs on the decode GEMM's word path: the E8M0 experts' fast kernel.

`moe_gemm` runs every expert format through `mx_gemm`'s kernel, which dequantizes the
activation tile and the weight tile one code at a time in every program. Where the E8M0
formats take the decode GEMM's x_hat word path (`decode_gemm.takes_x_hat` for both stems'
K), the experts run `_decode_gemm_kernel` in its MOE mode instead: the activation rows are
quantized once by `act_quant_hat` (codes, scales, MBS bytes and x_hat, the bf16 values in
the dots' word order), each row tile of `moe_align`'s sorted (token, slot) pairs gathers its
x_hat rows (the pair's token for w13, the pair's own row for w2) and the MBS bytes of those
rows, and reads its own expert's packed weight rows as the decode GEMM reads a linear's
(int32 words of 8 codes, two values per 32-bit register, the E8M0 scale folded where every
code of the stem is <= 128: `decode_gemm.small_weight_scales`, checked at load).

Same values and products as `decode_gemm` on each pair's row (a permuted order of K inside
each scale block; MBS partials scaled per macro block by sigma_x * sigma_w): the bound of
docs/numerics.md, "Kernel numerics and error bounds", holds unchanged. Row tiles of 16, 32
or 64 pairs (`moe_gemm.moe_block_m`: 64 where the active experts get about 64 pairs or more,
on sm_90 and later: `decode_gemm.sm90_or_later`), 128 weight rows and 128 K elements per step, 4 warps,
two pipeline stages above 16 rows (`decode_gemm.gpu_launch_options`). Capturable in a CUDA
graph: torch ops and one launch per stem, shapes from the input shapes, no host sync.
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.library import op_name
from vllm_mxplus.backends.triton.decode_gemm import (
    GPU_BLOCK_K,
    MAX_TILE_OFFSET,
    check_block_size,
    launch_decode,
    reads_x_hat,
    step_tile,
    sub_blocks,
    takes_x_hat,
)
from vllm_mxplus.backends.triton.expert_weights import PackedExpertWeights
from vllm_mxplus.backends.triton.gemm_launch import SplitK, check_gemm_args, codes_aligned
from vllm_mxplus.backends.triton.launch import check_available, interpreting, triton
from vllm_mxplus.backends.triton.x_hat import HAT_DTYPE, hat_cols


def rows_addressable(rows: int, k: int) -> bool:
    """Whether every element of an x_hat of `rows` rows for K = k lies within 32-bit offsets
    of its base (the kernel gathers rows with 32-bit offsets; the MBS bytes are smaller)."""
    return rows * hat_cols(k) < MAX_TILE_OFFSET


def moe_takes_hat(w13: PackedExpertWeights, w2: PackedExpertWeights, macro_block: int,
                  has_mbs: bool, pairs: int = 0) -> bool:  # fmt: skip
    """Whether both stems of E8M0 experts (the caller checks the format) run on the decode
    kernel for `pairs` (token, slot) pairs: K steps of whole x_hat chunks (`takes_x_hat`),
    each inside one macro block (no operand rows per macro block, `decode_gemm.sub_blocks`:
    the grouped rows are pairs), on weight code rows that vectorize (`codes_aligned`; the
    activation rows the quantizers write always do), and x_hat rows addressable in 32 bits
    (`rows_addressable`)."""
    return sub_blocks(macro_block, has_mbs, GPU_BLOCK_K) == 1 and all(
        takes_x_hat(w.k) and codes_aligned(w.k, w.codes) and rows_addressable(pairs, w.k)
        for w in (w13, w2)
    )


def moe_decode_gemm(
    x_hat: torch.Tensor,
    x_mbs: torch.Tensor | None,
    w: tuple,
    pairs: torch.Tensor,
    tile_expert: torch.Tensor,
    *,
    experts: int,
    n: int,
    k: int,
    num_pairs: int,
    topk: int,
    out_dtype: torch.dtype,
    block_size: int,
    macro_block: int,
    block_m: int,
    w_small_scales: bool = False,
) -> torch.Tensor:
    """out [num_pairs, n]: row p = x_hat[p // topk] @ W_hat[expert of p]^T for every pair in
    a tile of `moe_align(..., block_m)`, 0 for the others (pairs of other ranks' experts).

    x_hat: `act_quant_hat`'s bf16 [rows, hat_cols(k)] of the activation rows (one per token
    with topk > 1, per pair with topk 1); x_mbs: their MBS bytes [rows, ceil(k / macro)] or
    None; w: the E8M0 experts' (codes, scales, MBS bytes or None), `experts` x n rows
    stacked (`PackedExpertWeights`). w_small_scales: every weight scale code is <= 128
    (`small_weight_scales`, checked at load)."""
    codes, scales, extra = w
    has_mbs = x_mbs is not None or extra is not None
    check_gemm_args("moe_decode_gemm", out_dtype, macro_block, has_mbs)
    check_block_size("moe_decode_gemm", block_size)
    if x_hat.dtype != HAT_DTYPE or x_hat.dim() != 2 or x_hat.shape[1] != hat_cols(k):
        raise ValueError(
            f"moe_decode_gemm: x_hat must be {HAT_DTYPE} [rows, {hat_cols(k)}] "
            f"(`act_quant_hat` of K = {k}), got {x_hat.dtype} {tuple(x_hat.shape)}"
        )
    x_hat = x_hat.contiguous()  # rows_addressable counts whole rows of hat_cols(k)
    if not rows_addressable(x_hat.shape[0], k):
        raise ValueError(
            f"moe_decode_gemm: x_hat of {x_hat.shape[0]} rows is too large for 32-bit "
            "offsets (`moe_takes_hat` keeps such calls on moe_gemm)"
        )
    check_available(codes)
    interp = interpreting()
    out = torch.zeros(
        (num_pairs, n), dtype=torch.float32 if interp else out_dtype, device=codes.device
    )
    if num_pairs == 0 or n == 0:
        return out.to(out_dtype)
    block_n, block_k = step_tile(k, codes, codes, macro_block, has_mbs)
    if not reads_x_hat(k, codes, codes, block_k) or sub_blocks(macro_block, has_mbs, block_k) > 1:
        raise ValueError(
            f"moe_decode_gemm: K = {k} with macro block {macro_block} does not take the x_hat "
            "word path (`moe_takes_hat`); use moe_gemm"
        )
    sk = SplitK(split=1, k_per_split=k, out=out, bias=None)
    x_ops = (x_hat, x_hat, x_mbs)  # x's codes and scales are not read on the x_hat path
    grid = (triton.cdiv(n, block_n), 1, tile_expert.shape[0])
    launch_decode(
        grid, x_ops, w, sk, x_hat, (pairs, tile_expert, experts, topk), K=k, bs=block_size,
        macro_block=macro_block, tile=(block_m, block_n, block_k), words=True,
        w_fold=w_small_scales, even=n % block_n == 0 and k % block_k == 0,
    )  # fmt: skip
    return out.to(out_dtype)


#: `moe_decode_gemm` as a custom op (traceable): w the stacked expert operands (codes,
#: scales, MBS bytes or None) of `experts` x n rows; the keyword arguments are its own.
MOE_DECODE_SCHEMA = (
    "(Tensor x_hat, Tensor? x_mbs, Tensor?[] w, Tensor pairs, Tensor tile_expert, "
    "SymInt experts, SymInt n, SymInt k, *, SymInt num_pairs, SymInt topk, "
    "ScalarType out_dtype, SymInt block_size, SymInt macro_block, SymInt block_m, "
    "bool w_small_scales) -> Tensor"
)


@torch.library.custom_op(
    op_name("triton_moe_decode_gemm"), mutates_args=(), schema=MOE_DECODE_SCHEMA
)
def moe_decode_gemm_op(x_hat, x_mbs, w, pairs, tile_expert, experts, n, k, **kw):
    """`moe_decode_gemm` on an operand list (w of `experts` x n rows)."""
    return moe_decode_gemm(
        x_hat, x_mbs, tuple(w), pairs, tile_expert, experts=experts, n=n, k=k, **kw
    )


@moe_decode_gemm_op.register_fake
def _moe_decode_gemm_fake(x_hat, x_mbs, w, pairs, tile_expert, experts, n, k, *, num_pairs,
                          out_dtype, **_kw):  # fmt: skip
    return w[0].new_empty((num_pairs, n), dtype=out_dtype)


__all__ = ["moe_decode_gemm", "moe_decode_gemm_op", "moe_takes_hat"]
