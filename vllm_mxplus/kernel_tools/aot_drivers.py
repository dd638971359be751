"""The input domains `mxplus kernels --aot` drives each Triton launcher over (see `aot.py`).

Each driver calls its launcher's Python wrapper on meta tensors for every format x dtype x
row count x K x macro block (x bias x split-K) the wrapper accepts; under
`triton_utils.capture_launches()` the wrapper records each launch with the GPU's tile
choices instead of running it. `quick` keeps a subset that still holds every divisibility
class (their register counts differ most).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _drive_act_quant(quick: bool) -> None:
    from vllm_mxplus.backends.triton import act_quant as aq
    from vllm_mxplus.formats import get_format

    dtypes = (
        (torch.bfloat16, torch.float32) if quick else (torch.bfloat16, torch.float16, torch.float32)
    )
    ms = (1, 64) if quick else (1, 2, 3, 4, 64)
    ks = (4096,) if quick else (16, 48, 64, 128, 256, 576, 4096, 4104)
    for fmt in aq.SUPPORTED_FORMATS:
        mbs = bool(get_format(fmt).mbs)
        macros: tuple[int, ...] = aq.SUPPORTED_MACRO_BLOCKS if mbs else (128,)
        if quick and mbs:
            # the default, the widest, and 32 (many macro blocks per tile) on the largest tile
            macros = (128, macros[-1])
            aq.act_quant(_meta((64, 4096), torch.bfloat16), fmt, macro_block=32)
        for dtype, m, k, macro in itertools.product(dtypes, ms, ks, macros):
            aq.act_quant(_meta((m, k), dtype), fmt, macro_block=macro)
        # the decode path's x_hat variant: decode row counts, K with a partial chunk or not
        for dtype, m, k in itertools.product(dtypes, (1, 16), (4096,) if quick else (576, 4096)):
            aq.act_quant_hat(_meta((m, k), dtype), fmt, macro_block=128)


def _drive_act_fp8(quick: bool) -> None:
    from vllm_mxplus.backends.cutlass import act_fp8 as af

    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    ms = (64,) if quick else (1, 2, 3, 4, 64)
    ks = (4096,) if quick else (128, 256, 576, 4096, 4104)
    for fmt, dtype, m, k in itertools.product(af.SUPPORTED_FORMATS, dtypes, ms, ks):
        af.act_quant_fp8_chunks(_meta((m, k), dtype), fmt, 128)
        af._fields(_meta((m, k), dtype), fmt, 128, packed=True)  # the prefill's launch


def _drive_weight_fp8(quick: bool) -> None:
    from vllm_mxplus.backends.cutlass.weight_fp8 import weight_fp8_chunks
    from vllm_mxplus.formats.constants import ceil_div

    shapes = ((4096, 4096),) if quick else ((4096, 4096), (576, 1536), (100, 72), (13, 4104))
    for (n, k), mbs in itertools.product(shapes, (True, False)):
        codes, scales, _ = _gemm_operand(n, k, "mxfp4-16", 16, 128)
        m = _meta((n, ceil_div(k, 128)), torch.uint8) if mbs else None
        weight_fp8_chunks(codes, scales, m, k, ceil_div(n, 8) * 8)


def _drive_fp8_chunk_gemm(quick: bool) -> None:
    from vllm_mxplus.backends.triton.fp8_chunk_gemm import fp8_chunk_gemm

    shapes = ((4096, 4096, 4096),) if quick else ((4096, 4096, 4096), (256, 576, 1536),
                                                   (300, 100, 128), (4096, 14336, 4096))  # fmt: skip
    outs = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    f8, f32 = torch.float8_e4m3fn, torch.float32
    for (m, n, k), out, bias in itertools.product(shapes, outs, (False, True)):
        nc = k // 128
        fp8_chunk_gemm(_meta((m, k), f8), _meta((nc, m), f32), _meta((n, k), f8),
                       _meta((nc, n), f32), _meta((n,), f32) if bias else None, out)  # fmt: skip


def _drive_fp8_packed_gemm(quick: bool) -> None:
    from vllm_mxplus.backends.cutlass.fp8_packed_gemm import fp8_packed_gemm

    # K as `gemm.packed_serves` takes it: multiples of fp8_packed_gemm.K_MULTIPLE (256)
    shapes = ((4096, 4096, 4096),) if quick else ((4096, 4096, 4096), (256, 576, 1536),
                                                   (300, 100, 256), (1024, 4096, 14336))  # fmt: skip
    outs = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    f8, f32 = torch.float8_e4m3fn, torch.float32
    for (m, n, k), out, bias, mbs in itertools.product(shapes, outs, (False, True), (True, False)):
        codes, scales, _ = _gemm_operand(n, k, "mxfp4-16", 16, 128)
        w_mbs = _meta((n, k // 128), torch.uint8) if mbs else None
        fp8_packed_gemm(_meta((m, k), f8), _meta((k // 128, m), f32), codes, scales, w_mbs, k,
                        _meta((n,), f32) if bias else None, out)  # fmt: skip


def _drive_fp4_scaled_gemm(quick: bool) -> None:
    from vllm_mxplus.backends.triton.fp4_rel_scales import aligned_rows
    from vllm_mxplus.backends.triton.fp4_scaled_gemm import CAPABILITY_MAJOR, fp4_scaled_gemm
    from vllm_mxplus.backends.triton.launch import target_capability
    from vllm_mxplus.formats.constants import ceil_div

    cap = target_capability(torch.device("cuda"))
    if cap is not None and cap // 10 != CAPABILITY_MAJOR:
        return  # sm_100's block-scaled FP4 MMA only

    shapes = ((4096, 4096, 4096),) if quick else ((4096, 4096, 4096), (256, 576, 1536),
                                                   (300, 100, 640), (256, 4096, 4096))  # fmt: skip
    outs = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    u8, f32 = torch.uint8, torch.float32
    meta = torch.device("meta")

    def op(rows: int, k: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # scales and factors laid out as rel_scales lays them
        return (_meta((rows, ceil_div(k, 2)), u8), aligned_rows(rows, k // 16, u8, meta),
                aligned_rows(groups, rows, f32, meta))  # fmt: skip

    for (m, n, k), out, bias, mbs in itertools.product(shapes, outs, (False, True), (True, False)):
        groups = k // 128 if mbs else 1
        fp4_scaled_gemm(op(m, k, groups), op(n, k, groups), k,
                        _meta((n,), f32) if bias else None, out, mbs)  # fmt: skip


def _drive_fp4_rel_scales(quick: bool) -> None:
    from vllm_mxplus.backends.triton.fp4_rel_scales import rel_scales
    from vllm_mxplus.formats.constants import ceil_div

    ks = (4096,) if quick else (4096, 200)
    for k, bs, mbs in itertools.product(ks, (16, 32), (True, False)):
        m = _meta((4096, ceil_div(k, 128)), torch.uint8) if mbs else None
        rel_scales(_meta((4096, ceil_div(k, bs)), torch.uint8), m, k, bs, per_chunk=mbs)


def _gemm_operand(
    rows: int, k: int, fmt: str, bs: int, macro: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes, E8M0 scales and MBS bytes (or None) of `rows` rows of a decode-GEMM operand."""
    from vllm_mxplus.formats import get_format
    from vllm_mxplus.formats.constants import ceil_div

    mbs = _meta((rows, ceil_div(k, macro)), torch.uint8) if get_format(fmt).mbs else None
    return (
        _meta((rows, ceil_div(k, 2)), torch.uint8),
        _meta((rows, ceil_div(k, bs)), torch.uint8),
        mbs,
    )


def _drive_decode_gemm(quick: bool) -> None:
    from vllm_mxplus.backends.base import E8M0_PAIRS
    from vllm_mxplus.backends.triton.decode_gemm import decode_gemm, takes_x_hat
    from vllm_mxplus.backends.triton.x_hat import hat_cols
    from vllm_mxplus.formats import get_format

    out_dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    # (N, K): 16-divisible strides (vectorized loads), 16-divisible codes with MBS strides
    # that are not, and nothing 16-divisible. The quick subset keeps every shape (their
    # register counts differ most) and the bias variants of one pair.
    # MBS macro blocks: under the 128-element K step (16, 32, 64: an operand row per macro
    # block of the step on the word path, one dot each on the byte path), the default, and
    # wider; --quick adds 32 on one shape.
    shapes = ((4096, 4096), (576, 1536), (100, 72))
    for (wf, af), out_dtype, (n, k), bias, split, macro in itertools.product(
        sorted(E8M0_PAIRS), out_dtypes, shapes, (False, True), (1, 4), (16, 32, 64, 128, 256, 2048)
    ):
        mbs = bool(get_format(wf).mbs or get_format(af).mbs)
        if quick and bias and (wf, af) != ("mxfp4-mbs-d", "mxfp4-mbs-s"):
            continue
        if (not mbs and macro != 128) or (
            quick and macro != 128 and (macro != 32 or (n, k) != (4096, 4096) or bias)
        ):
            continue
        bs = get_format(wf).block_size

        wc, ws, wm = _gemm_operand(n, k, wf, bs, macro)
        # the serving path (x_hat, folded weight scales) where the layer takes it, and the
        # codes-only path (any caller; --quick: on the default macro block); the batched decode's 32-
        # and 64-row tiles (x_hat only) on the shapes that take it, without split-K or bias
        serving = takes_x_hat(k)
        for x_hat in (True, False) if serving and (macro == 128 or not quick) else (serving,):
            wide = x_hat and split == 1 and not bias and (not quick or (n, k) == (4096, 4096))
            for rows in (16, 32, 64) if wide else (16,):
                xc, xs, xm = _gemm_operand(rows, k, af, bs, macro)
                decode_gemm(
                    xc,
                    xs,
                    xm,
                    wc,
                    ws,
                    wm,
                    k,
                    _meta((n,), out_dtype) if bias else None,
                    out_dtype,
                    block_size=bs,
                    x_hat=_meta((rows, hat_cols(k)), torch.bfloat16) if x_hat else None,
                    # served with x_hat: `act_quant_hat`'s sigmas beside x's MBS bytes
                    x_sigma=(_meta(xm.shape, torch.float32) if x_hat and xm is not None else None),
                    macro_block=macro,
                    split_k=split,
                    w_small_scales=x_hat,
                )
    _drive_decode_gemm_nvfp4(shapes, out_dtypes, quick)
    _drive_decode_gemm_mxplus(shapes, out_dtypes, quick)


def _drive_decode_gemm_mxplus(shapes: tuple, out_dtypes: tuple, quick: bool) -> None:
    """MX+ on the decode GEMM: x_hat only (16-row tiles: the launcher keeps MX+ there),
    E8M0 block 32 weight scales folded or not, the weight's block-max indices; on the shapes
    whose K takes x_hat."""
    from vllm_mxplus.backends.triton.decode_gemm import decode_gemm, takes_x_hat
    from vllm_mxplus.backends.triton.x_hat import hat_cols
    from vllm_mxplus.formats.constants import ceil_div

    def u8(rows: int, cols: int) -> torch.Tensor:
        return _meta((rows, cols), torch.uint8)

    for out_dtype, (n, k), bias, split, fold in itertools.product(
        out_dtypes, shapes, (False, True), (1, 4), (True, False)
    ):
        if not takes_x_hat(k) or (quick and (bias or out_dtype != torch.bfloat16)):
            continue
        nb = ceil_div(k, 32)
        for rows in (1, 16):
            decode_gemm(
                u8(rows, k // 2), u8(rows, nb), None, u8(n, k // 2), u8(n, nb), None, k,
                _meta((n,), out_dtype) if bias else None, out_dtype, block_size=32,
                x_hat=_meta((rows, hat_cols(k)), torch.bfloat16),
                w_block_max=_meta((n, nb), torch.int16),
                macro_block=128, split_k=split, w_small_scales=fold,
            )  # fmt: skip


def _drive_decode_gemm_nvfp4(shapes: tuple, out_dtypes: tuple, quick: bool) -> None:
    """NVFP4 on the decode GEMM: E4M3 scales and global scales, on x_hat (16 / 32 / 64 rows)
    where K takes it and on the codes."""
    from vllm_mxplus.backends.triton.decode_gemm import decode_gemm, takes_x_hat
    from vllm_mxplus.backends.triton.x_hat import hat_cols
    from vllm_mxplus.formats.constants import ceil_div

    def codes(rows: int, k: int) -> torch.Tensor:
        return _meta((rows, ceil_div(k, 2)), torch.uint8)

    def scales(rows: int, k: int) -> torch.Tensor:
        return _meta((rows, ceil_div(k, 16)), torch.float8_e4m3fn)

    for out_dtype, (n, k), bias, split in itertools.product(
        out_dtypes, shapes, (False, True), (1, 4)
    ):
        if quick and (bias or out_dtype != torch.bfloat16):
            continue
        serving = takes_x_hat(k)
        for x_hat in (True, False) if serving else (False,):
            wide = x_hat and split == 1 and not bias
            for rows in (16, 32, 64) if wide else (16,):
                decode_gemm(
                    codes(rows, k), scales(rows, k), None, codes(n, k), scales(n, k), None, k,
                    _meta((n,), out_dtype) if bias else None, out_dtype, block_size=16,
                    x_hat=_meta((rows, hat_cols(k)), torch.bfloat16) if x_hat else None,
                    x_global=_meta((rows,), torch.float32), w_global=_meta((n,), torch.float32),
                    macro_block=128, split_k=split,
                )  # fmt: skip


def _mx_operand(
    rows: int, k: int, fmt: str, bs: int, macro: int | None, words: bool = False
) -> tuple:
    """(codes, scales, extra, global) of `rows` rows of an `mx_gemm` operand of kind fmt
    ('e8m0' with MBS bytes when macro is given, 'nvfp4', 'mxplus') at block size bs; words:
    MX+'s block maxima as a linear's weight holds them (`plus_words`), else indices."""
    from vllm_mxplus.formats.constants import ceil_div

    extra = None
    if fmt == "mxplus":
        extra = _meta((rows, ceil_div(k, 32)), torch.int16 if words else torch.uint8)
    elif macro is not None:
        extra = _meta((rows, ceil_div(k, macro)), torch.uint8)
    g = _meta((rows,), torch.float32) if fmt == "nvfp4" else None
    return (
        _meta((rows, ceil_div(k, 2)), torch.uint8),
        _meta((rows, ceil_div(k, bs)), torch.uint8),
        extra,
        g,
    )


#: mx_gemm operand kinds: (fmt, block size, macro block or None): E8M0 without MBS at block
#: 16 and 32, with MBS under / equal to / over the 64-element K step, NVFP4, MX+.
_MX_KINDS: tuple[tuple[str, int, int | None], ...] = (
    ("e8m0", 16, None),
    ("e8m0", 32, None),
    ("e8m0", 16, 16),
    ("e8m0", 16, 32),
    ("e8m0", 16, 64),
    ("e8m0", 16, 128),
    ("e8m0", 16, 2048),
    ("nvfp4", 16, None),
    ("mxplus", 32, None),
)


def _drive_mx_gemm(quick: bool) -> None:
    """Linears: the prefill tiles (64 rows) for every kind, and the decode tile (16 rows,
    split-K) for NVFP4 and MX+ (E8M0 decode is `decode_gemm`'s)."""
    from vllm_mxplus.backends.triton.mx_gemm import mx_gemm

    out_dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    shapes = ((4096, 4096), (100, 72)) if quick else ((4096, 4096), (576, 1536), (100, 72))
    kinds = _MX_KINDS
    if quick:
        kinds = tuple(kd for kd in _MX_KINDS if kd[2] not in (64, 2048))
    for (fmt, bs, macro), out_dtype, (n, k), bias, m in itertools.product(
        kinds, out_dtypes, shapes, (False, True), (64, 16)
    ):
        if m == 16 and fmt == "e8m0":
            continue
        # --quick: E8M0 MBS-128 in every shape and bias variant; the others aligned, plus the
        # decode tile on rows that do not vectorize (the narrow tile, which the wide one spills)
        unaligned_decode = m == 16 and (n, k) == (100, 72) and not bias
        skip = quick and (bias or (n, k) == (100, 72)) and (fmt, macro) != ("e8m0", 128)
        if skip and not unaligned_decode:
            continue
        for split in (1, 4) if m == 16 else (1,):
            mx_gemm(
                _mx_operand(m, k, fmt, bs, macro),
                _mx_operand(n, k, fmt, bs, macro, words=True),
                k,
                _meta((n,), out_dtype) if bias else None,
                out_dtype,
                fmt=fmt,
                block_size=bs,
                macro_block=macro or 128,
                split_k=split,
            )


def _drive_mx_gemm_rows(quick: bool) -> None:
    """The prefill pipelines' exact fallback (`mx_gemm_rows`): the row list
    (`row_list.list_rows`) and the gathered-row GEMM over the whole weight, for the operand
    kinds the sm_90 FP8 and sm_100 FP4 pipelines take (E8M0 block 16 / 32 with MBS-128 or
    none, NVFP4), launched as those pipelines launch them (programmatic dependent launches
    on sm_90 and later)."""
    from vllm_mxplus.backends.triton.launch import target_capability
    from vllm_mxplus.backends.triton.mx_gemm import mx_gemm_rows

    cap = target_capability(torch.device("cuda"))
    if cap is not None and cap < FALLBACK_ROWS_TARGET:
        return  # no pipeline there has the fallback (sm_80: no FP8, no block-scaled FP4)

    kinds = (("e8m0", 16, 128),) if quick else (
        ("e8m0", 16, 128), ("e8m0", 16, None), ("e8m0", 32, None), ("nvfp4", 16, None))  # fmt: skip
    outs = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    m, n, k = 4096, 4096, 4096
    for (fmt, bs, macro), out_dtype, bias in itertools.product(kinds, outs, (False, True)):
        mx_gemm_rows(
            _meta((m, n), out_dtype), _meta((m,), torch.bool),
            _mx_operand(m, k, fmt, bs, macro), _mx_operand(n, k, fmt, bs, macro), k,
            _meta((n,), torch.float32) if bias else None,
            fmt=fmt, block_size=bs, macro_block=macro or 128,
        )  # fmt: skip


def _moe_layout(pairs: int, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta stand-ins for `moe_align`'s (sorted pairs, expert per row tile) of `pairs` pairs
    over `experts` experts in row tiles of block_m (their shapes' bound)."""
    return (
        _meta((pairs + experts * block_m,), torch.int32),
        _meta((pairs // block_m + experts,), torch.int32),
    )


def _drive_moe_gemm(quick: bool) -> None:
    """Grouped experts: w13 (rows gathered per token, top-k 8) and w2 (rows per pair) at the
    decode, the 32-row and (code rows that vectorize, no narrow macro block: where
    `moe_block_m` can pick it) the wide row tile, every operand kind."""
    from vllm_mxplus.backends.triton.moe_gemm import (
        MOE_WIDE_BLOCK_M,
        PackedExpertWeights,
        moe_gemm,
    )
    from vllm_mxplus.backends.triton.mx_gemm import (
        DECODE_BLOCK_M,
        GATHER_BLOCK_M,
        narrow_macro_block,
    )

    experts = 8
    out_dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    # (N, K) per stem: Qwen3-30B-A3B-like (w13 2I x H, w2 H x I), and nothing 16-divisible
    shapes = ((1536, 2048, 8), (2048, 768, 1), (100, 72, 8))
    kinds = _MX_KINDS if not quick else tuple(kd for kd in _MX_KINDS if kd[2] in (None, 32, 128))
    for (fmt, bs, macro), out_dtype, (n, k, topk), block_m in itertools.product(
        kinds, out_dtypes, shapes, (DECODE_BLOCK_M, GATHER_BLOCK_M, MOE_WIDE_BLOCK_M)
    ):
        small = (n, k) == (100, 72) or block_m == DECODE_BLOCK_M
        if quick and small and (fmt, macro) != ("e8m0", 128):
            continue
        if block_m == MOE_WIDE_BLOCK_M and (
            (n, k) == (100, 72) or narrow_macro_block(macro is not None, macro or 128)
        ):
            continue
        pairs = 64
        codes, scales, extra, g = _mx_operand(experts * n, k, fmt, bs, macro)
        w = PackedExpertWeights(codes, scales, extra, g, experts, n, k)
        moe_gemm(
            _mx_operand(pairs // topk, k, fmt, bs, macro),
            w,
            *_moe_layout(pairs, experts, block_m),
            num_pairs=pairs,
            topk=topk,
            out_dtype=out_dtype,
            fmt=fmt,
            block_size=bs,
            macro_block=macro or 128,
            block_m=block_m,
        )


def _drive_moe_decode_gemm(quick: bool) -> None:
    """Grouped E8M0 experts on the decode kernel (`moe_decode`): w13 (top-k 8) and w2 (rows
    per pair) of a Qwen3-30B-A3B-like layer at the three row tiles `moe_block_m` picks, every
    E8M0 pair (--quick: the default MBS pair and MXFP4-16-OAS), folded scales or not, the
    macro blocks of 128 and 256; fp32 outputs are the layers with expert biases."""
    from vllm_mxplus.backends.base import E8M0_PAIRS
    from vllm_mxplus.backends.triton.moe_decode import moe_decode_gemm
    from vllm_mxplus.backends.triton.moe_gemm import MOE_WIDE_BLOCK_M
    from vllm_mxplus.backends.triton.mx_gemm import DECODE_BLOCK_M, GATHER_BLOCK_M
    from vllm_mxplus.backends.triton.x_hat import hat_cols
    from vllm_mxplus.formats import get_format

    experts, pairs = 8, 64
    quick_pairs = {("mxfp4-mbs-d", "mxfp4-mbs-s"), ("mxfp4-16-oas", "mxfp4-16-oas")}
    out_dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32)
    for (wf, af), out_dtype, (n, k, topk), block_m, small, macro in itertools.product(
        sorted(E8M0_PAIRS), out_dtypes, ((1536, 2048, 8), (2048, 768, 1)),
        (DECODE_BLOCK_M, GATHER_BLOCK_M, MOE_WIDE_BLOCK_M), (True, False), (128, 256),
    ):  # fmt: skip
        mbs = bool(get_format(wf).mbs or get_format(af).mbs)
        if (not mbs and macro != 128) or (
            quick and ((wf, af) not in quick_pairs or not small or macro != 128)
        ):
            continue
        bs = get_format(wf).block_size
        _, _, xm = _gemm_operand(pairs // topk, k, af, bs, macro)
        moe_decode_gemm(
            _meta((pairs // topk, hat_cols(k)), torch.bfloat16),
            xm,
            _gemm_operand(experts * n, k, wf, bs, macro),
            *_moe_layout(pairs, experts, block_m),
            experts=experts,
            n=n,
            k=k,
            num_pairs=pairs,
            topk=topk,
            out_dtype=out_dtype,
            block_size=bs,
            macro_block=macro,
            block_m=block_m,
            w_small_scales=small,
        )


def _drive_act_quant_plus(quick: bool) -> None:
    from vllm_mxplus.backends.triton import act_quant_plus as ap

    dtypes = (
        (torch.bfloat16, torch.float32) if quick else (torch.bfloat16, torch.float16, torch.float32)
    )
    ms = (1, 64) if quick else (1, 2, 3, 4, 64)
    ks = (4096,) if quick else (32, 48, 576, 4096, 4104)
    for dtype, m, k in itertools.product(dtypes, ms, ks):
        ap.act_quant_mxplus(_meta((m, k), dtype))
        ap.act_quant_nvfp4_given(_meta((m, k), dtype), _meta((m, 1), torch.float32))
    # the decode path's x_hat variant of the MX+ quantizer
    for dtype, m, k in itertools.product(dtypes, (1, 16), (4096,) if quick else (576, 4096)):
        ap.act_quant_mxplus_hat(_meta((m, k), dtype))


#: The launchers, by the kernels they launch; each driver calls its wrapper over its domain.
DRIVERS: dict[str, Callable[[bool], None]] = {
    "act_quant": _drive_act_quant,
    "act_quant_fp8_chunks": _drive_act_fp8,
    "weight_fp8_chunks": _drive_weight_fp8,
    "fp8_chunk_gemm": _drive_fp8_chunk_gemm,
    "fp8_packed_gemm": _drive_fp8_packed_gemm,
    "fp4_scaled_gemm": _drive_fp4_scaled_gemm,
    "fp4_rel_scales": _drive_fp4_rel_scales,
    "decode_gemm": _drive_decode_gemm,
    "mx_gemm": _drive_mx_gemm,
    "mx_gemm_rows": _drive_mx_gemm_rows,
    "moe_gemm": _drive_moe_gemm,
    "moe_decode_gemm": _drive_moe_decode_gemm,
    "act_quant_plus": _drive_act_quant_plus,
}

# the prefill pipelines' exact fallback (`mx_gemm_rows`: the row list and the GEMM launched
# after it, the one `_mx_gemm_kernel` launch with PDL on) serves the FP8 (sm_89+) and FP4
# (sm_100) pipelines only
FALLBACK_ROWS_TARGET = 89

#: Kernels that need a newer target than sm_80 (FP8 E4M3 tensor cores and conversions: sm_89
#: and later; they serve only the sm_90 / sm_100 FP8-chunk pipeline), or serve only the
#: pipelines that do (the exact fallback's row list, FALLBACK_ROWS_TARGET); older targets are
#: skipped for them, not failed.
MIN_TARGET: dict[str, int] = {
    "_fp8_chunk_gemm_kernel": 89,
    "_fp8_packed_gemm_kernel": 89,
    "_weight_fp8_words_kernel": 89,
    "_weight_fp8_chunks_kernel": 89,
    "_act_fp8_chunks_kernel": 89,
    "_list_rows_kernel": FALLBACK_ROWS_TARGET,
}


FP4_MMA_TARGET = 100  # `fp4_scaled_gemm`'s MMA: sm_100 only (older targets emulate it)


def min_target(config) -> int:  # noqa: ANN001 (aot.KernelConfig; aot imports this module)
    """The oldest target a configuration is compiled for: MIN_TARGET of its kernel, the
    fallback rows' GEMM FALLBACK_ROWS_TARGET, and for the decode kernel's 64-row tile (linear
    or grouped) and its MX+ mode `decode_gemm.WIDE_MIN_CAPABILITY` (the launchers never pick
    them on older GPUs)."""
    from vllm_mxplus.backends.triton.decode_gemm import WIDE_BLOCK_MS, WIDE_MIN_CAPABILITY

    c = dict(config.constexprs)
    if config.kernel == "_fp4_scaled_gemm_kernel":
        return FP4_MMA_TARGET  # tcgen05's block-scaled FP4 MMA
    if config.kernel == "_mx_gemm_kernel" and c.get("PDL"):
        return FALLBACK_ROWS_TARGET
    if config.kernel == "_decode_gemm_kernel" and (
        c["BLOCK_M"] >= WIDE_BLOCK_MS[-1] or c.get("PLUS")
    ):
        return WIDE_MIN_CAPABILITY * 10
    return MIN_TARGET.get(config.kernel, 0)
