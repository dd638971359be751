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
        macros = aq.SUPPORTED_MACRO_BLOCKS if mbs else (128,)
        if quick and mbs:
            # the default, the widest, and 32 (many macro blocks per tile) on the largest tile
            macros = (128, macros[-1])
            aq.act_quant(_meta((64, 4096), torch.bfloat16), fmt, macro_block=32)
        for dtype, m, k, macro in itertools.product(dtypes, ms, ks, macros):
            aq.act_quant(_meta((m, k), dtype), fmt, macro_block=macro)


def _drive_act_fp8(quick: bool) -> None:
    from vllm_mxplus.backends.triton import act_fp8 as af

    dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    ms = (64,) if quick else (1, 2, 3, 4, 64)
    ks = (4096,) if quick else (128, 256, 576, 4096, 4104)
    for fmt, dtype, m, k in itertools.product(af.SUPPORTED_FORMATS, dtypes, ms, ks):
        af.act_quant_fp8_chunks(_meta((m, k), dtype), fmt)


def _gemm_operand(
    rows: int, k: int, fmt: str, bs: int, macro: int
) -> tuple[torch.Tensor | None, ...]:
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
    from vllm_mxplus.backends.triton.decode_gemm import decode_gemm
    from vllm_mxplus.formats import get_format

    out_dtypes = (torch.bfloat16,) if quick else (torch.bfloat16, torch.float16, torch.float32)
    # (N, K): 16-divisible strides (vectorized loads), 16-divisible codes with MBS strides
    # that are not, and nothing 16-divisible. The quick subset keeps every shape (their
    # register counts differ most) and the bias variants of one pair.
    # MBS macro blocks: under the 64-element K step (16, 32: one dot and division per macro
    # block in the step), equal to it, the default, and wider; --quick adds 32 on one shape.
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

        decode_gemm(
            *_gemm_operand(16, k, af, bs, macro),
            *_gemm_operand(n, k, wf, bs, macro),
            k,
            _meta((n,), out_dtype) if bias else None,
            out_dtype,
            block_size=bs,
            macro_block=macro,
            split_k=split,
        )


#: The launchers, by the kernels they launch; each driver calls its wrapper over its domain.
DRIVERS: dict[str, Callable[[bool], None]] = {
    "act_quant": _drive_act_quant,
    "act_quant_fp8_chunks": _drive_act_fp8,
    "decode_gemm": _drive_decode_gemm,
}
