"""Fused Triton activation quantizers the GEMM of `mx_gemm` needs beyond `act_quant`:

- `mxplus`: codes, E8M0 scales (`ocp`, block 32) and block-max indices, bit-exact to
  `formats.quantize` of the MX+ format (docs/numerics.md, "MX+"): the block max is the FIRST index
  of the largest |x|; its scaled magnitude v in [4, 8) is stored as j = round_half_even(2v - 8)
  clamped to 0..7, with the element's sign; a block without one (all zero, NaN / Inf, or a
  scaled max under 4) gets index 255 (`NO_BLOCK_MAX`).
- `nvfp4` with GIVEN per-row global scales (row-parallel shards under tensor parallelism
  quantize with the whole row's scale): bit-exact to `formats.nvfp4.quantize_nvfp4_given`.

Same numerics rules as `act_quant` (integer bit manipulation for exponents, `div_rn` for
divisions, NaN mapped to +inf before max reductions, 64-bit row offsets).
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.triton.act_quant import (
    act_rows,
    check_act_rows,
    launch_row_tiles,
    store_hat,
)
from vllm_mxplus.backends.triton.gemm_blocks import e2m1_value, e8m0_value
from vllm_mxplus.backends.triton.launch import check_available, tl, triton
from vllm_mxplus.backends.triton.quant_blocks import (
    NO_THRESHOLD as _NO_THRESHOLD,
)
from vllm_mxplus.backends.triton.quant_blocks import (
    NVFP4_BLOCK,
    e8m0_block_quant,
    e8m0_reciprocal,
    load_row_tile,
    nvfp4_block_quant,
    store_codes_and_scales,
    store_row_tile,
)
from vllm_mxplus.backends.triton.x_hat import HAT_CHUNK, HAT_DTYPE, hat_cols
from vllm_mxplus.formats.constants import MX_BLOCK, NO_BLOCK_MAX, ceil_div

MXPLUS_BLOCK = tl.constexpr(MX_BLOCK)  # 32
NO_BM = tl.constexpr(NO_BLOCK_MAX)  # 255
OCP_RULE = tl.constexpr(_NO_THRESHOLD)  # the `ocp` rule: d is always 0
RNE_ROUNDER = tl.constexpr(8388608.0)  # 2^23: (t + 2^23) - 2^23 rounds t in [0, 2^22) to even


@triton.jit
def _mxplus_act_quant_kernel(
    x_ptr, codes_ptr, scales_ptr, bm_ptr, hat_ptr,
    M, K, stride_xm, stride_cm, stride_sm, stride_bm, stride_hm,
    HAT: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_k = tl.program_id(1)
    offs_m, _, mask_m, x = load_row_tile(x_ptr, M, K, stride_xm, BF16_BITS, BLOCK_M, BLOCK_K)
    NB: tl.constexpr = BLOCK_K // MXPLUS_BLOCK
    code, mag, neg = e8m0_block_quant(x, OCP_RULE, BLOCK_M, NB, MXPLUS_BLOCK)
    ax = tl.reshape(tl.abs(x), (BLOCK_M, NB, MXPLUS_BLOCK))
    idx = tl.argmax(ax, axis=2, tie_break_left=True)  # the first largest |x|
    vmax = tl.max(ax, axis=2) * e8m0_reciprocal(code)
    has_bm = (vmax >= 4.0) & (code != 255)
    t = tl.minimum(tl.maximum(2.0 * tl.where(has_bm, vmax, 4.0) - 8.0, 0.0), 7.5)
    j = ((t + RNE_ROUNDER) - RNE_ROUNDER).to(tl.int32)  # round half to even, exact
    j = tl.minimum(j, 7)
    i_e = tl.arange(0, MXPLUS_BLOCK)
    at_bm = (i_e[None, None, :] == idx[:, :, None]) & has_bm[:, :, None]
    c = tl.where(at_bm, j[:, :, None], mag) | (neg << 3)
    store_codes_and_scales(
        codes_ptr, scales_ptr, c, code, offs_m, mask_m, stride_cm, stride_sm,
        pid_k, K, MXPLUS_BLOCK, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    bm = tl.where(has_bm, idx, NO_BM).to(tl.uint8)
    store_row_tile(bm_ptr, bm, offs_m, mask_m, stride_bm, pid_k, tl.cdiv(K, MXPLUS_BLOCK), NB)
    if HAT:  # x_hat (`x_hat`): plain E2M1 values, the block max +-(8 + j) / 2, times 2^(e - 127)
        plain = e2m1_value(c)
        bmv = (8 + j[:, :, None]).to(tl.float32) * 0.5
        v = tl.where(at_bm, tl.where(neg != 0, -bmv, bmv), plain) * e8m0_value(code)[:, :, None]
        store_hat(hat_ptr, v, offs_m, mask_m, stride_hm, pid_k, K, BLOCK_M, BLOCK_K)


@triton.jit
def _nvfp4_given_act_quant_kernel(
    x_ptr, g_ptr, codes_ptr, scales_ptr,  # g: the rows' given fp32 global scales
    M, K, stride_xm, stride_cm, stride_sm,
    BF16_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The second sweep of act_quant's NVFP4 kernel, with g read per row instead of computed."""
    pid_k = tl.program_id(1)
    offs_m, _, mask_m, x = load_row_tile(x_ptr, M, K, stride_xm, BF16_BITS, BLOCK_M, BLOCK_K)
    g = tl.load(g_ptr + offs_m, mask=mask_m, other=0.0)
    sbyte, c = nvfp4_block_quant(x, g, BLOCK_M, BLOCK_K // NVFP4_BLOCK, NVFP4_BLOCK)
    store_codes_and_scales(
        codes_ptr, scales_ptr, c, sbyte, offs_m, mask_m, stride_cm, stride_sm,
        pid_k, K, NVFP4_BLOCK, BLOCK_M, BLOCK_K,
    )  # fmt: skip


def act_quant_mxplus(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MX+ activations x [..., K] -> (codes uint8 [..., ceil(K/2)], E8M0 scales uint8
    [..., ceil(K/32)], block-max indices uint8 [..., ceil(K/32)]): the fields of
    `formats.quantize` of the MX+ format, bit for bit."""
    codes, scales, bm, _ = _act_quant_mxplus(x, hat=False)
    return codes, scales, bm


def act_quant_mxplus_hat(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`act_quant_mxplus` of rows x [M, K] that also writes x_hat for the decode GEMM (bf16
    [M, hat_cols(K)] in `x_hat`'s word order: the spec's values, the block max's 4 significant
    bits included, exact in bf16), from the same kernel."""
    codes, scales, bm, hat = _act_quant_mxplus(x, hat=True)
    assert hat is not None
    return codes, scales, bm, hat


def _act_quant_mxplus(
    x: torch.Tensor, hat: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    check_act_rows(x, "act_quant_mxplus")
    check_available(x)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = act_rows(x)
    m, nb = rows[0].shape[0], ceil_div(k, MX_BLOCK)
    codes = torch.empty((m, ceil_div(k, 2)), dtype=torch.uint8, device=x.device)
    scales = torch.empty((m, nb), dtype=torch.uint8, device=x.device)
    bm = torch.empty((m, nb), dtype=torch.uint8, device=x.device)
    x_hat = torch.empty((m, hat_cols(k)), dtype=HAT_DTYPE, device=x.device) if hat else None
    launch_row_tiles(
        _mxplus_act_quant_kernel,
        rows,
        HAT_CHUNK if hat else MX_BLOCK,  # x_hat: tiles of whole chunks
        (codes, scales, bm, x_hat if x_hat is not None else bm),  # never touched without HAT
        HAT=hat,
    )
    return codes.reshape(*lead, -1), scales.reshape(*lead, nb), bm.reshape(*lead, nb), x_hat


def act_quant_nvfp4_given(
    x: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 activations x [..., K] with given per-row global scales [..., 1] (fp32) ->
    (codes uint8 [..., ceil(K/2)], float8_e4m3fn scales [..., ceil(K/16)]): bit for bit
    `formats.nvfp4.quantize_nvfp4_given(x, global_scale)`, packed."""
    check_act_rows(x, "act_quant_nvfp4_given")
    check_available(x)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = act_rows(x)
    m, nb = rows[0].shape[0], ceil_div(k, NVFP4_BLOCK)
    g = global_scale.reshape(-1).to(torch.float32)
    if g.numel() != m:
        raise ValueError(f"act_quant_nvfp4_given: {g.numel()} global scales for {m} rows")
    codes = torch.empty((m, ceil_div(k, 2)), dtype=torch.uint8, device=x.device)
    scales = torch.empty((m, nb), dtype=torch.float8_e4m3fn, device=x.device)
    outputs = (codes, scales.view(torch.uint8))
    launch_row_tiles(_nvfp4_given_act_quant_kernel, rows, NVFP4_BLOCK, outputs, g)
    return codes.reshape(*lead, -1), scales.reshape(*lead, nb)
