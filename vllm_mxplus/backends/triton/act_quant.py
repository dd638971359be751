"""Fused Triton activation quantizer: bf16/fp16/fp32 [M, K] -> packed E2M1 codes, scales, MBS.

Bit-exact to `vllm_mxplus.formats.quantize(x, fmt)` (docs/numerics.md, "E8M0 block scales",
"Macro Block Scaling" and "NVFP4"), with the nvfp4
global scale taken per row (`per_row=True`), as the activation path requires.

- E8M0 formats (`mxfp4-mbs-s`, `mxfp4-16-oas`, `mxfp4-16`, `mxfp4-ocp`): one program per
  (row tile, K tile), one read of x and one write of each output. The K tile is a whole
  number of macro blocks, so MBS-S (paper eq. 3) never crosses programs.
- `nvfp4` (baseline): one program per row tile; the per-row amax needs a first sweep over the
  row, so x is read twice (the second read mostly hits L2).

Numerics that the GPU could get wrong and how they are avoided:
- fp32 `/` in Triton lowers to an approximate division; 6/a and the nvfp4 divisions use
  `tl.math.div_rn` (IEEE round to nearest), as the reference does.
- `max` reductions on the GPU drop NaN; block and macro-block maxima of |x| are taken on
  the bits (`nan_max`: for fp32 >= 0 the int32 order, NaN above +inf), so a block holding
  NaN or Inf has a non-finite absmax, which every rule below treats as "non-finite".
- Scale exponents and 2^k factors come from integer bit manipulation, never libdevice (whose
  FTZ reflection would flush fp32 subnormals).
- Row offsets are 64-bit: row * stride wraps in int32 once M*K >= 2^31 (131k tokens at
  K = 16384), and a wrapped offset reads another tensor's memory without any error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_mxplus.backends.triton.gemm_blocks import (
    e2m1_value,
    e4m3_value,
    e8m0_value,
    launch_dependents,
    mbs_sigma,
)
from vllm_mxplus.backends.triton.launch import (
    check_available,
    hw_e2m1,
    interpreting,
    launch,
    pdl_launch,
    tl,
    triton,
)
from vllm_mxplus.backends.triton.quant_blocks import (
    MANTISSA_THRESHOLD,
    NVFP4_BLOCK,
    NVFP4_GLOBAL_DIV,
    e2m1_packed_hw,
    e8m0_block_quant_abs,
    e8m0_block_scaled,
    load_f32,
    load_row_tile,
    mbs_static_scale,
    nvfp4_block_quant,
    store_codes_and_scales,
    store_row_tile,
)
from vllm_mxplus.backends.triton.x_hat import HAT_CHUNK, HAT_DTYPE, hat_cols
from vllm_mxplus.formats import FORMATS, get_format
from vllm_mxplus.formats.constants import ceil_div
from vllm_mxplus.formats.schemes import FormatSpec


def takes(spec: FormatSpec) -> bool:
    """Whether `act_quant` quantizes activations of this format: E8M0 block scales at block 16
    or 32 (OCP, floor or OAS rule) with no MBS or MBS-S, or NVFP4 (per-row global scale).
    MX+ has its own kernel (`act_quant_plus`); MBS-D is a weight-only search."""
    if spec.has_global_scale:
        return True
    return (
        spec.scale_is_e8m0
        and spec.block_size in (16, 32)
        and not spec.block_max_mantissa
        and spec.mbs in (None, "static")
    )


SUPPORTED_FORMATS = tuple(name for name, spec in FORMATS.items() if takes(spec))
#: MBS macro blocks the E8M0 kernel tiles (a power of two: tiles reshape into macro blocks;
#: at most GPU_TILE_ELEMS wide, so one program's tile stays in registers). Under 128 a tile
#: holds more macro blocks (a 4 x 512 tile: 64 of 32), each with its own absmax and one IEEE
#: division 6 / a (docs/numerics.md, "Macro Block Scaling").
SUPPORTED_MACRO_BLOCKS = (16, 32, 64, 128, 256, 512, 1024, 2048)
# elements per program on the GPU (~64 per thread: per-program costs spread; counted on
# sm_100 with the E2M1 conversion, MBS-S: 4096 (8 rows) 0.80 warp-instructions per element,
# 8192 (16 rows) 0.72; sm_90 1.12 -> 1.04); NVFP4's kernel, which holds its row tile across
# two sweeps, 4096 (16 rows spilled on sm_100)
GPU_TILE_ELEMS = 8192
NVFP4_TILE_ELEMS = 4096
GPU_BLOCK_K = 512
# the E8M0 kernel's HW_E2M1: 0, its own rounding (`e2m1_magnitude_code`); HW_E2M1_GPU, the
# GPU's E2M1 conversion (`launch.hw_e2m1`: sm_100 and later, the codes only, not x_hat);
# HW_E2M1_EMULATED, that path with the conversion done by the same rounding (the
# interpreter's tests of the path, which runs no PTX)
HW_E2M1_GPU = 1
HW_E2M1_EMULATED = 2
_HW_E2M1_GPU = tl.constexpr(HW_E2M1_GPU)  # read inside the kernel


# ----------------------------------------------------------------------------- E8M0 kernel
@triton.jit
def _mx_act_quant_kernel(
    x_ptr, codes_ptr, scales_ptr, mbs_ptr, hat_ptr, sigma_ptr,
    M, K, stride_xm, stride_cm, stride_sm, stride_mm, stride_hm, stride_gm,
    BLOCK: tl.constexpr, MANT_THRESHOLD: tl.constexpr, HAS_MBS: tl.constexpr, MACRO: tl.constexpr,
    HAT: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    TRIGGER: tl.constexpr, HW_E2M1: tl.constexpr,
):  # fmt: skip
    # the kernel after it (the decode GEMM, the FP4 pipeline's relative scales) may start its
    # programs, which wait for this one (`launch.pdl_launch`); a no-op before any other kernel
    if TRIGGER:
        launch_dependents()
    pid_k = tl.program_id(1)
    # pack_fp4 pads with code 0 too, so the zeros past K are invisible.
    offs_m, _, mask_m, x = load_row_tile(x_ptr, M, K, stride_xm, BF16_BITS, BLOCK_M, BLOCK_K)

    if HAS_MBS:
        NM: tl.constexpr = BLOCK_K // MACRO
        # |fp32(x F)| = fp32(|x| F) (NaN stays NaN), and x F has x's sign (F >= 1): the block
        # quantizer gets both from x, without y = x F itself
        m, f, _ = mbs_static_scale(x, BLOCK_M, NM, MACRO)
        ay = tl.reshape(
            tl.reshape(tl.abs(x), (BLOCK_M, NM, MACRO)) * f[:, :, None], (BLOCK_M, BLOCK_K)
        )
        store_row_tile(
            mbs_ptr, m.to(tl.uint8), offs_m, mask_m, stride_mm, pid_k, tl.cdiv(K, MACRO), NM
        )
        if HAT:  # the decode GEMM's sigma = fp32(1 / F) per macro block (IEEE division)
            sigma = mbs_sigma(f, True, False)
            store_row_tile(
                sigma_ptr, sigma, offs_m, mask_m, stride_gm, pid_k, tl.cdiv(K, MACRO), NM
            )
    else:
        ay = tl.abs(x)

    NB: tl.constexpr = BLOCK_K // BLOCK
    if HW_E2M1:  # the GPU's E2M1 conversion rounds (`e2m1_packed_hw`; HW_E2M1_GPU)
        tl.static_assert(not HAT, "x_hat is built from the codes (`e8m0_block_quant_abs`)")
        code, v = e8m0_block_scaled(x, ay, MANT_THRESHOLD, BLOCK_M, NB, BLOCK)
        codes = e2m1_packed_hw(v, BLOCK_M, BLOCK_K, HW_E2M1 == _HW_E2M1_GPU)
    else:
        code, mag, neg = e8m0_block_quant_abs(x, ay, MANT_THRESHOLD, BLOCK_M, NB, BLOCK)
        codes = mag | (neg << 3)
    store_codes_and_scales(
        codes_ptr, scales_ptr, codes, code, offs_m, mask_m, stride_cm, stride_sm,
        pid_k, K, BLOCK, BLOCK_M, BLOCK_K,
    )  # fmt: skip
    if HAT:  # x_hat in the decode GEMM's word order (`x_hat`): BLOCK_K whole chunks
        v = e2m1_value(mag | (neg << 3)) * e8m0_value(code)[:, :, None]
        store_hat(hat_ptr, v, offs_m, mask_m, stride_hm, pid_k, K, BLOCK_M, BLOCK_K)


@triton.jit
def store_hat(hat_ptr, v, offs_m, mask_m, stride_hm, tile, K, BLOCK_M: tl.constexpr,
               BLOCK_K: tl.constexpr):  # fmt: skip
    """Store the values v [BLOCK_M, NB, BLOCK] (fp32, exact in bf16) of K tile `tile` (whole
    HAT_CHUNKs) as bf16 in `x_hat`'s word order."""
    v = tl.reshape(v, (BLOCK_M, BLOCK_K // 128, 16, 2, 4))
    v = tl.reshape(tl.permute(v, (0, 1, 4, 2, 3)), (BLOCK_M, BLOCK_K))
    # bf16 = fp32's top half: v is exact in bf16, so the truncation is the value (the
    # interpreter's fp32 -> bf16 conversion loses bf16 subnormals)
    v = (v.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    store_row_tile(hat_ptr, v, offs_m, mask_m, stride_hm, tile, tl.cdiv(K, 128) * 128, BLOCK_K)


# ----------------------------------------------------------------------------- NVFP4 kernel
@triton.jit
def _nvfp4_act_quant_kernel(
    x_ptr, codes_ptr, scales_ptr, gs_ptr, hat_ptr,  # gs: out, the rows' fp32 global scales
    M, K, stride_xm, stride_cm, stride_sm, stride_hm,
    HAT: tl.constexpr, BF16_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    NB: tl.constexpr = BLOCK_K // NVFP4_BLOCK
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_m = offs_m.to(tl.int64)  # 64-bit row offsets (module docstring)
    row = x_ptr + offs_m[:, None] * stride_xm

    # sweep 1: per-row amax over finite |x| (nvfp4_global_scale with per_row=True)
    amax = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = load_f32(row + offs_k[None, :], mask_m[:, None] & (offs_k[None, :] < K), BF16_BITS)
        ax = tl.abs(x)
        ax = tl.where(ax < float("inf"), ax, 0.0)  # drops NaN and Inf
        amax = tl.maximum(amax, tl.max(ax, axis=1))
    g = tl.math.div_rn(amax, tl.full(amax.shape, NVFP4_GLOBAL_DIV, tl.float32))
    tl.store(gs_ptr + offs_m, g, mask=mask_m)

    # sweep 2: block scales and codes
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = load_f32(row + offs_k[None, :], mask_m[:, None] & (offs_k[None, :] < K), BF16_BITS)
        sbyte, c = nvfp4_block_quant(x, g, BLOCK_M, NB, NVFP4_BLOCK)
        store_codes_and_scales(
            codes_ptr, scales_ptr, c, sbyte, offs_m, mask_m, stride_cm, stride_sm,
            k0 // BLOCK_K, K, NVFP4_BLOCK, BLOCK_M, BLOCK_K,
        )  # fmt: skip
        if HAT:  # x_hat = value * s without the global scale (the GEMM applies g_x g_w)
            v = e2m1_value(c) * e4m3_value(sbyte)[:, :, None]
            store_hat(hat_ptr, v, offs_m, mask_m, stride_hm, k0 // BLOCK_K, K, BLOCK_M, BLOCK_K)


# ----------------------------------------------------------------------------- launcher
def tile_sizes(m: int, k: int, unit: int, elems: int = GPU_TILE_ELEMS) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K): BLOCK_K a power of two >= unit (a macro block never crosses
    programs). The interpreter pays per program, so it gets large tiles; the GPU gets
    ~`elems` elements per program (memory-bound): up to `elems` / 512 rows x 512 columns, and
    fewer rows when the unit (a macro block up to 2048) is wider."""
    kp2 = max(unit, triton.next_power_of_2(k))
    if interpreting():
        return min(64, triton.next_power_of_2(m)), max(unit, min(kp2, 4096))
    block_k = max(unit, min(kp2, GPU_BLOCK_K))
    return min(triton.next_power_of_2(m), max(1, elems // block_k)), block_k


def check_act_input(
    x: torch.Tensor,
    fmt: str,
    kernel_takes: Callable[[FormatSpec], bool],
    who: str,
    kernel: str = "Triton kernel",
) -> FormatSpec:
    """fmt's FormatSpec; a ValueError naming `who` for an unknown format, one its `kernel`
    does not take (`kernel_takes(spec)` false), or rows x not of a float dtype or with an
    empty last dim."""
    spec = get_format(fmt)
    if not kernel_takes(spec):
        supported = ", ".join(n for n, s in FORMATS.items() if kernel_takes(s))
        raise ValueError(f"{who}: format {fmt!r} has no {kernel}; supported: {supported}")
    check_act_rows(x, who)
    return spec


def check_act_rows(x: torch.Tensor, who: str) -> None:
    """A ValueError naming `who` when rows x are not of a float dtype or have an empty last
    dim."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{who}: unsupported dtype {x.dtype} (bf16, fp16 or fp32)")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{who}: cannot quantize shape {tuple(x.shape)}: empty last dim")


def act_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """x [..., K] as rows [M, K] with unit column stride, the kernel argument for them (bf16
    as its int16 bits: `load_f32` widens them exactly), and whether x is bf16."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    bf16 = x2.dtype == torch.bfloat16
    return x2, (x2.view(torch.int16) if bf16 else x2), bf16


def launch_row_tiles(
    kernel: Any,
    rows: tuple[torch.Tensor, torch.Tensor, bool],
    unit: int,
    outputs: tuple[torch.Tensor, ...],
    *inputs: torch.Tensor,
    **constexprs: Any,
) -> None:
    """Launch an activation kernel over (row tile, K tile) programs of the `act_rows` rows
    [M, K] (tiles of `tile_sizes(M, K, unit)`; nothing for M = 0), the kernel taking
    (x, *inputs, *outputs, M, K, x's row stride, the outputs' row strides, constexprs...,
    BF16_BITS, BLOCK_M, BLOCK_K)."""
    x2, x_arg, bf16 = rows
    m, k = x2.shape
    if not m:
        return
    block_m, block_k = tile_sizes(m, k, unit)
    launch(
        kernel,
        (triton.cdiv(m, block_m), triton.cdiv(k, block_k)),
        x_arg,
        *inputs,
        *outputs,
        m,
        k,
        x2.stride(0),
        *(t.stride(0) for t in outputs),
        **constexprs,
        BF16_BITS=bf16,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
    )


def e2m1_rounding(device: torch.device, hat: bool) -> int:
    """The E8M0 kernel's HW_E2M1 for a launch on `device`: HW_E2M1_GPU where the GPU has the
    E2M1 conversion (`launch.hw_e2m1`) and the launch writes no x_hat, else 0."""
    return HW_E2M1_GPU if not hat and hw_e2m1(device) else 0


def check_tileable_macro_block(macro_block: int, who: str) -> None:
    """Raise a ValueError naming `who` when the kernels cannot tile this macro block."""
    if macro_block not in SUPPORTED_MACRO_BLOCKS:
        # the kernel reshapes tiles into macro blocks (a power of two) held in registers
        raise ValueError(
            f"{who}: macro_block must be one of {SUPPORTED_MACRO_BLOCKS} (a power of two: "
            f"the kernel's tiles hold whole macro blocks), got {macro_block}"
        )


def act_quant(
    x: torch.Tensor, fmt: str, *, macro_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Quantize activations x [..., K] (bf16/fp16/fp32) along K in one fused kernel.

    Returns (codes uint8 [..., ceil(K/2)], scales [..., ceil(K/block)] (uint8 E8M0, or
    float8_e4m3fn for nvfp4), mbs uint8 [..., ceil(K/macro_block)] or None, global_scale fp32
    [..., 1] (nvfp4, per row) or None) -- the fields of `formats.quantize(x, fmt,
    per_row=True)`, bit for bit.
    """
    codes, scales, mbs, gs, _, _ = _act_quant(x, fmt, macro_block, hat=False)
    return codes, scales, mbs, gs


def act_quant_hat(
    x: torch.Tensor, fmt: str, *, macro_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor,
           torch.Tensor | None]:  # fmt: skip
    """`act_quant` that also writes x_hat for the decode GEMM: (codes, scales, mbs or None,
    global_scale or None, x_hat bf16 [M, hat_cols(K)] in `x_hat`'s word order, sigma or None),
    all from the same kernel. Rows x [M, K] (2-D). E8M0 formats: x_hat = value * 2^(e - 127)
    (the MBS factor left to the GEMM, which scales its partial sums by sigma = fp32(1 / F),
    fp32 [M, ceil(K/macro_block)], given here with MBS); NVFP4: x_hat = value * s, the E4M3
    scale without the row's global scale (the GEMM multiplies its sums by g_x * g_w); exact
    in bf16 alike. MX+ has its own (`act_quant_plus.act_quant_mxplus_hat`;
    `ops.act_quant_hat_op` takes both)."""
    if x.dim() != 2:
        raise ValueError(f"act_quant_hat: x must be [M, K], got shape {tuple(x.shape)}")
    codes, scales, mbs, gs, hat, sigma = _act_quant(x, fmt, macro_block, hat=True)
    assert hat is not None
    return codes, scales, mbs, gs, hat, sigma


def _act_quant(
    x: torch.Tensor, fmt: str, macro_block: int, hat: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None,
           torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    spec = check_act_input(x, fmt, takes, "act_quant")
    if spec.mbs:
        check_tileable_macro_block(macro_block, "act_quant")
    check_available(x)

    lead, k = x.shape[:-1], x.shape[-1]
    rows = act_rows(x)
    x2, x_arg, bf16_bits = rows
    m = x2.shape[0]
    codes = torch.empty((m, ceil_div(k, 2)), dtype=torch.uint8, device=x.device)
    nb = ceil_div(k, spec.block_size)
    mbs = gs = x_hat = sigma = None
    if hat:
        x_hat = torch.empty((m, hat_cols(k)), dtype=HAT_DTYPE, device=x.device)

    if spec.has_global_scale:
        scales = torch.empty((m, nb), dtype=torch.float8_e4m3fn, device=x.device)
        gs = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        if m:
            # x_hat: K tiles of whole chunks
            block_m, block_k = tile_sizes(
                m, k, HAT_CHUNK if hat else spec.block_size, NVFP4_TILE_ELEMS
            )
            launch(
                _nvfp4_act_quant_kernel,
                (triton.cdiv(m, block_m),),
                x_arg,
                codes,
                scales.view(torch.uint8),
                gs,
                x_hat if x_hat is not None else gs,  # never touched when HAT is False
                m,
                k,
                x2.stride(0),
                codes.stride(0),
                scales.stride(0),
                x_hat.stride(0) if x_hat is not None else 0,
                HAT=hat,
                BF16_BITS=bf16_bits,
                BLOCK_M=block_m,
                BLOCK_K=block_k,
            )
        gs = gs.reshape(*lead, 1)
    else:
        scales = torch.empty((m, nb), dtype=torch.uint8, device=x.device)
        unit = spec.group_size(macro_block)
        if spec.mbs:
            mbs = torch.empty((m, ceil_div(k, macro_block)), dtype=torch.uint8, device=x.device)
            if hat:
                sigma = torch.empty(mbs.shape, dtype=torch.float32, device=x.device)
        mbs_arg = mbs if mbs is not None else scales  # never touched when HAS_MBS is False
        hat_arg = x_hat if x_hat is not None else scales  # never touched when HAT is False
        sigma_arg = sigma if sigma is not None else scales  # touched with HAT and HAS_MBS only
        launch_row_tiles(
            _mx_act_quant_kernel,
            rows,
            max(unit, HAT_CHUNK if hat else 32),  # x_hat: tiles of whole chunks
            (codes, scales, mbs_arg, hat_arg, sigma_arg),
            BLOCK=spec.block_size,
            MANT_THRESHOLD=MANTISSA_THRESHOLD[spec.scale_rule],
            HAS_MBS=bool(spec.mbs),
            MACRO=macro_block,
            HAT=hat,
            TRIGGER=pdl_launch(x.device),
            HW_E2M1=e2m1_rounding(x.device, hat),
        )
        if mbs is not None:
            mbs = mbs.reshape(*lead, mbs.shape[-1])
    return (
        codes.reshape(*lead, codes.shape[-1]),
        scales.reshape(*lead, nb),
        mbs,
        gs,
        x_hat,
        sigma,
    )
