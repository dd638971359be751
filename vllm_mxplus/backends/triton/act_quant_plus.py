"""Fused Triton activation quantizers the GEMM of `mx_gemm` needs beyond `act_quant`:

- `mxplus`: codes, E8M0 scales (`ocp`, block 32) and block-max indices, bit-exact to
  `formats.quantize(x, "mxplus")` (docs/numerics.md, "MX+"): the block max is the FIRST index
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

from vllm_mxplus.backends.triton.act_quant import check_act_input, tile_sizes
from vllm_mxplus.backends.triton.launch import ceil_div, check_available, launch, tl, triton
from vllm_mxplus.backends.triton.quant_blocks import (
    E2M1_MAX,
    F8E4M3_MAX,
    e2m1_magnitude_code,
    e4m3_round,
    e8m0_block_quant,
    e8m0_reciprocal,
    load_f32,
    load_row_tile,
    pack_nibbles,
)
from vllm_mxplus.backends.triton.quant_blocks import (
    NO_THRESHOLD as _NO_THRESHOLD,
)
from vllm_mxplus.formats.constants import MX_BLOCK, NO_BLOCK_MAX

MXPLUS_BLOCK = tl.constexpr(MX_BLOCK)  # 32
NO_BM = tl.constexpr(NO_BLOCK_MAX)  # 255
OCP_RULE = tl.constexpr(_NO_THRESHOLD)  # the `ocp` rule: d is always 0
RNE_ROUNDER = tl.constexpr(8388608.0)  # 2^23: (t + 2^23) - 2^23 rounds t in [0, 2^22) to even


@triton.jit
def _mxplus_act_quant_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    bm_ptr,
    M,
    K,
    stride_xm,
    stride_cm,
    stride_sm,
    stride_bm,
    BF16_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
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
    packed = pack_nibbles(tl.reshape(c, (BLOCK_M, BLOCK_K)), BLOCK_M, BLOCK_K)

    offs_c = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(
        codes_ptr + offs_m[:, None] * stride_cm + offs_c[None, :],
        packed,
        mask=mask_m[:, None] & (offs_c[None, :] < tl.cdiv(K, 2)),
    )
    offs_s = pid_k * NB + tl.arange(0, NB)
    smask = mask_m[:, None] & (offs_s[None, :] < tl.cdiv(K, MXPLUS_BLOCK))
    tl.store(scales_ptr + offs_m[:, None] * stride_sm + offs_s[None, :], code.to(tl.uint8), smask)
    tl.store(
        bm_ptr + offs_m[:, None] * stride_bm + offs_s[None, :],
        tl.where(has_bm, idx, NO_BM).to(tl.uint8),
        smask,
    )


@triton.jit
def _nvfp4_given_act_quant_kernel(
    x_ptr,
    g_ptr,
    codes_ptr,
    scales_ptr,
    M,
    K,
    stride_xm,
    stride_cm,
    stride_sm,
    BF16_BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The second sweep of act_quant's NVFP4 kernel, with g read per row instead of computed."""
    BLOCK: tl.constexpr = 16
    NB: tl.constexpr = BLOCK_K // BLOCK
    pid_k = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_m = offs_m.to(tl.int64)  # 64-bit row offsets
    g = tl.load(g_ptr + offs_m, mask=mask_m, other=0.0)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    x = load_f32(
        x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
        mask_m[:, None] & (offs_k[None, :] < K),
        BF16_BITS,
    )
    xb = tl.reshape(x, (BLOCK_M, NB, BLOCK))
    ax = tl.abs(xb)
    has_nan = tl.max((ax != ax).to(tl.int32), axis=2) > 0
    bmax = tl.max(tl.where(ax == ax, ax, 0.0), axis=2)
    nonfinite = has_nan | (bmax == float("inf"))
    bmax = tl.where(nonfinite, 0.0, bmax)
    gb = tl.broadcast_to(g[:, None], bmax.shape)
    s32 = tl.math.div_rn(
        tl.math.div_rn(bmax, tl.full(bmax.shape, E2M1_MAX, tl.float32)),
        tl.where(gb > 0.0, gb, 1.0),
    )
    s32 = tl.where(gb > 0.0, s32, 0.0)
    s32 = tl.where(nonfinite, float("nan"), s32)
    s32 = tl.where(s32 > F8E4M3_MAX, F8E4M3_MAX, s32)
    sbyte, sf = e4m3_round(s32)
    zero = (sf == 0.0) | (sf != sf)
    denom = tl.where(zero, 1.0, sf * gb)
    v = tl.math.div_rn(ax, tl.broadcast_to(denom[:, :, None], ax.shape))
    neg = (xb.to(tl.int32, bitcast=True) < 0).to(tl.int32)
    c = tl.where(zero[:, :, None], 0, e2m1_magnitude_code(v) | (neg << 3))
    packed = pack_nibbles(tl.reshape(c, (BLOCK_M, BLOCK_K)), BLOCK_M, BLOCK_K)
    offs_c = pid_k * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    tl.store(
        codes_ptr + offs_m[:, None] * stride_cm + offs_c[None, :],
        packed,
        mask=mask_m[:, None] & (offs_c[None, :] < tl.cdiv(K, 2)),
    )
    offs_s = pid_k * NB + tl.arange(0, NB)
    tl.store(
        scales_ptr + offs_m[:, None] * stride_sm + offs_s[None, :],
        sbyte.to(tl.uint8),
        mask=mask_m[:, None] & (offs_s[None, :] < tl.cdiv(K, BLOCK)),
    )


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """x as [M, K] row-major, the kernel argument (bf16 as int16 bits), and whether bf16."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    bf16 = x2.dtype == torch.bfloat16
    return x2, (x2.view(torch.int16) if bf16 else x2), bf16


def act_quant_mxplus(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MX+ activations x [..., K] -> (codes uint8 [..., ceil(K/2)], E8M0 scales uint8
    [..., ceil(K/32)], block-max indices uint8 [..., ceil(K/32)]): the fields of
    `formats.quantize(x, "mxplus")`, bit for bit."""
    check_act_input(x, "mxplus", ("mxplus",), "act_quant_mxplus")
    check_available(x)
    lead, k = x.shape[:-1], x.shape[-1]
    x2, x_arg, bf16 = _rows(x)
    m, nb = x2.shape[0], ceil_div(k, MX_BLOCK)
    codes = torch.empty((m, ceil_div(k, 2)), dtype=torch.uint8, device=x.device)
    scales = torch.empty((m, nb), dtype=torch.uint8, device=x.device)
    bm = torch.empty((m, nb), dtype=torch.uint8, device=x.device)
    if m:
        block_m, block_k = tile_sizes(m, k, MX_BLOCK)
        launch(
            _mxplus_act_quant_kernel,
            (triton.cdiv(m, block_m), triton.cdiv(k, block_k)),
            x_arg,
            codes,
            scales,
            bm,
            m,
            k,
            x2.stride(0),
            codes.stride(0),
            scales.stride(0),
            bm.stride(0),
            BF16_BITS=bf16,
            BLOCK_M=block_m,
            BLOCK_K=block_k,
        )
    return codes.reshape(*lead, -1), scales.reshape(*lead, nb), bm.reshape(*lead, nb)


def act_quant_nvfp4_given(
    x: torch.Tensor, global_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 activations x [..., K] with given per-row global scales [..., 1] (fp32) ->
    (codes uint8 [..., ceil(K/2)], float8_e4m3fn scales [..., ceil(K/16)]): bit for bit
    `formats.nvfp4.quantize_nvfp4_given(x, global_scale)`, packed."""
    check_act_input(x, "nvfp4", ("nvfp4",), "act_quant_nvfp4_given")
    check_available(x)
    lead, k = x.shape[:-1], x.shape[-1]
    x2, x_arg, bf16 = _rows(x)
    m, nb = x2.shape[0], ceil_div(k, 16)
    g = global_scale.reshape(-1).to(torch.float32)
    if g.numel() != m:
        raise ValueError(f"act_quant_nvfp4_given: {g.numel()} global scales for {m} rows")
    codes = torch.empty((m, ceil_div(k, 2)), dtype=torch.uint8, device=x.device)
    scales = torch.empty((m, nb), dtype=torch.float8_e4m3fn, device=x.device)
    if m:
        block_m, block_k = tile_sizes(m, k, 16)
        launch(
            _nvfp4_given_act_quant_kernel,
            (triton.cdiv(m, block_m), triton.cdiv(k, block_k)),
            x_arg,
            g,
            codes,
            scales.view(torch.uint8),
            m,
            k,
            x2.stride(0),
            codes.stride(0),
            scales.stride(0),
            BF16_BITS=bf16,
            BLOCK_M=block_m,
            BLOCK_K=block_k,
        )
    return codes.reshape(*lead, -1), scales.reshape(*lead, nb)
