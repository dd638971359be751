"""E8M0 block scales re-expressed for Blackwell's block-scaled FP4 MMA (`fp4_scaled_gemm`).

sm_100's `tcgen05.mma ... kind::mxf4nvf4.block_scale.scale_vec::4X` (Triton's `tl.dot_scaled`
with float8_e4m3 scales) multiplies E2M1 operands by one UE4M3 scale per 16 elements, and
UE4M3 holds the powers of two 2^-9 .. 2^8 only. The E8M0 formats' scales 2^(s - 127) reach
far wider, so each group G of a row (a 128-K chunk with MBS, whose factor changes per chunk
anyway; the whole row without MBS) is written relative to its largest code:

    ref_G = max of the group's codes s_b (16-blocks inside K; a block-32 scale covers two)
    u_b   = the UE4M3 bits of 2^(s_b - ref_G + 8), for s_b - ref_G >= -17; else 0
    f_G   = 2^(ref_G - 135) * sigma_G, sigma = fp32(1/F) of the chunk's MBS byte (1 without)

so that 2^(s_b - 127) = u_b * 2^(ref_G - 135) exactly, and the GEMM multiplies a group's
partial sum by f_G once (docs/numerics.md, "The block-scaled FP4 MMA on sm_100"). f_G is
exact: a power of two in [2^-63, 2^63] times sigma, a normal number. A row is *inexact* when
some group has ref_G outside [REF_MIN, REF_MAX] (values beyond about 2^+-55: the product of two
factors could leave fp32's normal range; a NaN block, code 255, is one) or a block below the
span (s_b - ref_G < -17, zero blocks included: their code 0 cannot tell a zero block from a
tiny one): the GEMM's result for that row is not used, and the exact Triton FP4 GEMM
recomputes it (`fp4_prefill`). Blocks past K, and the padding up to whole chunks, get u = 0.
"""

from __future__ import annotations

import torch

from vllm_mxplus.backends.triton.gemm_blocks import launch_dependents, mbs_sigma, wait_prior_grid
from vllm_mxplus.backends.triton.launch import (
    chained,
    check_available,
    interpreting,
    launch,
    tl,
    triton,
)
from vllm_mxplus.backends.triton.quant_blocks import mbs_factor
from vllm_mxplus.formats.constants import MACRO_BLOCK, MBS_DENOM, SMALL_BLOCK, ceil_div

CHUNK = MACRO_BLOCK  # 128 elements: the GEMM's K step and the MBS macro block it serves
BLOCKS_PER_CHUNK = CHUNK // SMALL_BLOCK  # 8 UE4M3 scales per chunk
# Globals read inside kernels must be tl.constexpr (Triton rejects plain globals).
SPAN = tl.constexpr(17)  # binades below a group's largest code that UE4M3 holds (2^-9 .. 2^8)
REL_BIAS = tl.constexpr(8)  # u_b = 2^(s_b - ref + REL_BIAS): the largest block at UE4M3's 2^8
REF_MIN = tl.constexpr(72)  # 2^(ref - 135) >= 2^-63
REF_MAX = tl.constexpr(198)  # 2^(ref - 135) <= 2^63
BLOCK_R = 32  # rows per program


@triton.jit
def rel_ue4m3_bits(d):
    """UE4M3 bits of 2^(d + REL_BIAS) for int32 d = s_b - ref (<= 0); 0 below the span.

    2^e for e = d + 8 in [-6, 8] is the normal number with exponent field e + 7; e = -7, -8,
    -9 are the subnormals 4, 2, 1 (units of 2^-9)."""
    e = d + REL_BIAS
    sub = 1 << tl.maximum(e + 9, 0)
    return tl.where(e >= -6, (e + 7) << 3, tl.where(e >= -9, sub, 0))


@triton.jit
def factor_bits(ref):
    """fp32 bits of 2^(ref - 127 - REL_BIAS), ref clamped to [REF_MIN, REF_MAX] (an inexact
    row's factor is never used): exponent field ref - REL_BIAS."""
    return (tl.minimum(tl.maximum(ref, REF_MIN), REF_MAX) - REL_BIAS) << 23


@triton.jit
def _rel_scales_kernel(
    s_ptr, m_ptr, u_ptr, f_ptr, bad_ptr,
    R, NB, NC,
    stride_s, stride_m, stride_u, stride_f,
    SUB: tl.constexpr, HAS_MBS: tl.constexpr, PER_CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr, NEWTON: tl.constexpr, PDL: tl.constexpr, TRIGGER: tl.constexpr,
):  # fmt: skip
    if PDL:  # launched early (`launch.pdl_launch`): nothing is read before the quantizer ends
        wait_prior_grid()
    if TRIGGER:  # the FP4 GEMM after it may start its programs (they wait for this one)
        launch_dependents()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live_r = rows < R
    r64 = rows.to(tl.int64)
    j = tl.arange(0, 8)
    bad = tl.zeros((BLOCK_R,), dtype=tl.int32)
    ref = tl.zeros((BLOCK_R,), dtype=tl.int32)
    if not PER_CHUNK:  # one group per row: its largest code first
        for c in range(0, NC):
            jb = c * 8 + j
            live = live_r[:, None] & (jb < NB)[None, :]
            s = tl.load(s_ptr + r64[:, None] * stride_s + (jb // SUB)[None, :], mask=live, other=0)
            ref = tl.maximum(ref, tl.max(s.to(tl.int32), axis=1))
    for c in range(0, NC):
        jb = c * 8 + j
        live = live_r[:, None] & (jb < NB)[None, :]
        s = tl.load(s_ptr + r64[:, None] * stride_s + (jb // SUB)[None, :], mask=live, other=0)
        s = s.to(tl.int32)
        if PER_CHUNK:
            ref = tl.max(s, axis=1)
        d = s - ref[:, None]
        u = tl.where(live, rel_ue4m3_bits(d), 0)
        tl.store(
            u_ptr + r64[:, None] * stride_u + jb[None, :], u.to(tl.uint8), mask=live_r[:, None]
        )
        bad |= tl.max((live & (d < -SPAN)).to(tl.int32), axis=1)
        if PER_CHUNK:
            bad |= ((ref < REF_MIN) | (ref > REF_MAX)).to(tl.int32)
            f = factor_bits(ref).to(tl.float32, bitcast=True)
            if HAS_MBS:
                m = tl.load(m_ptr + r64 * stride_m + c, mask=live_r, other=0)
                f = f * mbs_sigma(mbs_factor(m), HAS_MBS, NEWTON)
            tl.store(f_ptr + c * stride_f + rows, f, mask=live_r)
    if not PER_CHUNK:
        bad |= ((ref < REF_MIN) | (ref > REF_MAX)).to(tl.int32)
        f = factor_bits(ref).to(tl.float32, bitcast=True)
        tl.store(f_ptr + rows, f, mask=live_r)
    tl.store(bad_ptr + r64, bad.to(tl.int8), mask=live_r)


ROW_ALIGN = 64  # bytes: the start of every row of u and f


def aligned_rows(rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty [rows, cols] tensor whose rows start every ROW_ALIGN bytes (a view of wider
    storage): its row stride is divisible by 16, which Triton's loads specialize on."""
    per = ROW_ALIGN // dtype.itemsize
    return torch.empty((rows, ceil_div(cols, per) * per), dtype=dtype, device=device)[:, :cols]


def rel_scales(
    scales: torch.Tensor, mbs: torch.Tensor | None, k: int, block_size: int, per_chunk: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u uint8 [R, 8 * ceil(K/128)], f fp32 [groups, R], inexact bool [R]) of E8M0 scale
    codes [R, ceil(K/block_size)] (block 16 or 32) and MBS bytes [R, ceil(K/128)] or None
    (module docstring); groups = ceil(K/128) with per_chunk (MBS: required), 1 without. u and
    f are views of storage whose rows start on 64-byte boundaries (`aligned_rows`): the GEMM
    loads a chunk's scales and factors as whole vectors."""
    if scales.dim() != 2 or scales.dtype != torch.uint8:
        raise ValueError(f"rel_scales: scales must be uint8 [R, blocks], got {scales.dtype} "
                         f"{tuple(scales.shape)}")  # fmt: skip
    if block_size not in (16, 32) or scales.shape[1] != ceil_div(k, block_size):
        raise ValueError(f"rel_scales: block size {block_size} (16 or 32) with "
                         f"{scales.shape[1]} scales for K = {k}")  # fmt: skip
    nc = ceil_div(k, CHUNK)
    if mbs is not None and (not per_chunk or tuple(mbs.shape) != (scales.shape[0], nc)):
        raise ValueError(f"rel_scales: MBS bytes need per_chunk and shape [{scales.shape[0]}, "
                         f"{nc}], got {tuple(mbs.shape)}")  # fmt: skip
    check_available(scales)
    r = scales.shape[0]
    dev = scales.device
    u = aligned_rows(r, nc * BLOCKS_PER_CHUNK, torch.uint8, dev)
    f = aligned_rows(nc if per_chunk else 1, r, torch.float32, dev)
    bad = torch.empty((r,), dtype=torch.int8, device=dev)
    if r == 0:
        return u, f, bad.bool()
    scales = scales.contiguous()
    mbs = mbs.contiguous() if mbs is not None else None
    launch(
        _rel_scales_kernel,
        (triton.cdiv(r, BLOCK_R),),
        scales,
        mbs if mbs is not None else scales,  # not read without MBS
        u,
        f,
        bad,
        r,
        ceil_div(k, SMALL_BLOCK),
        nc,
        scales.stride(0),
        mbs.stride(0) if mbs is not None else 0,
        u.stride(0),
        f.stride(0),
        SUB=block_size // SMALL_BLOCK,
        HAS_MBS=mbs is not None,
        PER_CHUNK=per_chunk,
        BLOCK_R=BLOCK_R,
        NEWTON=not interpreting(),
        num_warps=4,
        **chained(dev),
    )
    return u, f, bad.view(torch.bool)


def rel_scales_torch(
    scales: torch.Tensor, mbs: torch.Tensor | None, k: int, block_size: int, per_chunk: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`rel_scales` in torch ops, on any device (the weight's, once at load, where no Triton
    kernel need run): the same bits, the same layout."""
    r, nb, nc = scales.shape[0], ceil_div(k, SMALL_BLOCK), ceil_div(k, CHUNK)
    s16 = scales.to(torch.int32).repeat_interleave(block_size // SMALL_BLOCK, dim=1)[:, :nb]
    s16 = torch.nn.functional.pad(s16, (0, nc * BLOCKS_PER_CHUNK - nb), value=-1)  # past K
    groups = s16.view(r, nc, BLOCKS_PER_CHUNK) if per_chunk else s16.view(r, 1, -1)
    live = groups >= 0
    ref = groups.max(dim=2).values.clamp(min=0)
    d = groups - ref[:, :, None]
    e = d + REL_BIAS.value
    bits = torch.where(e >= -6, (e + 7) << 3, torch.where(e >= -9, 1 << (e + 9).clamp(min=0), 0))
    bits = torch.where(live, bits, 0)
    u = aligned_rows(r, nc * BLOCKS_PER_CHUNK, torch.uint8, scales.device)
    u.copy_(bits.reshape(r, -1))
    out_of_range = (ref < REF_MIN.value) | (ref > REF_MAX.value)
    bad = out_of_range.any(dim=1) | (live & (d < -SPAN.value)).flatten(1).any(dim=1)
    pow2 = ((ref.clamp(REF_MIN.value, REF_MAX.value) - REL_BIAS.value) << 23).view(torch.float32)
    if mbs is not None:
        pow2 = pow2 * (1.0 / ((mbs.to(torch.float32) + MBS_DENOM) / MBS_DENOM))
    f = aligned_rows(pow2.shape[1], r, torch.float32, scales.device)
    f.copy_(pow2.T)
    return u, f, bad
