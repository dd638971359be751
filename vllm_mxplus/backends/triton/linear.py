"""The Triton backends on CUDA: fused activation quantizer + FP4 GEMM, every scheme, every M.

- `triton-decode` (M <= `decode_max_m()`, 128 by default): every scheme runs the
  memory-bound decode GEMM (`decode_gemm`: the packed weight, its E8M0 / E4M3 scales and MBS
  bytes or MX+ block-max indices streamed once; 16-row tiles up to DECODE_MAX_M, 32 / 64
  above on the x_hat path); NVFP4 rows with given global scales (row-parallel shards), MX+
  off the x_hat path, above DECODE_MAX_M or before sm_90, and any layer off the x_hat path
  above DECODE_MAX_M run `mx_gemm` (its decode or prefill tiles).
- `triton-gemm` (M > DECODE_MAX_M where the backends before it leave M): `mx_gemm` with
  prefill tiles, every format (E8M0 at block 16 / 32 with MBS at any power-of-two macro block
  16..2048, NVFP4, MX+).
Weights stay packed (codes, scales, MBS bytes / MX+ block-max indices, NVFP4 global scales:
~0.57 bytes per weight), never an fp32 copy; activations are quantized by the fused Triton
quantizers into the same layout, bit for bit with `vllm_mxplus.formats`. Where the CUTLASS
prefill GEMM is built it comes first for M > 16 (the selector's priority order decides; this
backend does not encode what CUTLASS takes). MBS macro blocks that are not a power of two
(48, 80, ...) are refused with the reason, and run the reference.
Error bound: docs/numerics.md, "Kernel numerics and error bounds" (`mx_gemm`'s docstring).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from vllm_mxplus import settings
from vllm_mxplus.backends.base import (
    Layer,
    LinearBackend,
    LinearSpec,
    check_e8m0_pair,
    set_packed_buffers,
)
from vllm_mxplus.backends.triton import launch
from vllm_mxplus.backends.triton.act_quant import SUPPORTED_MACRO_BLOCKS
from vllm_mxplus.backends.triton.decode_gemm import (
    GPU_BLOCK_K,
    sm90_or_later,
    small_weight_scales,
    sub_blocks,
    takes_x_hat,
)
from vllm_mxplus.backends.triton.gemm_launch import supports_macro_block
from vllm_mxplus.backends.triton.gemm_ops import act_operands
from vllm_mxplus.backends.triton.mx_gemm import operand_format
from vllm_mxplus.backends.triton.ops import act_quant_hat_op, act_quant_op, decode_gemm_op
from vllm_mxplus.backends.triton.plus_words import block_max_words
from vllm_mxplus.formats import QuantizedTensor, get_format, quantize

DECODE_MAX_M = 16  # the decode GEMM's 16-row tile: every E8M0 layer up to here
# Batched decode: on the x_hat word path (`decode_gemm.takes_x_hat`) the decode GEMM's 32- and
# 64-row tiles serve up to BATCHED_DECODE_MAX_M rows, where the static estimate for
# Llama-3-8B's linears puts them ahead of the prefill pipelines (two 64-row tiles at M = 128:
# ~1.2x bf16 on H200, where the FP8-chunk pipeline's per-call weight encode gives ~0.7x;
# `benchmarks/gpu_static_model.py`, docs/benchmarks.md); up to HELD_DECODE_MAX_M when the
# weight's FP8 form is held (VLLM_MXPLUS_FP8_WEIGHT_HELD=1: that pipeline is ahead above 64).
# Layers off that path use `mx_gemm` above DECODE_MAX_M, as `triton-gemm` does.
BATCHED_DECODE_MAX_M = 128
HELD_DECODE_MAX_M = 64
# codes, scales (E8M0 bytes, or float8_e4m3fn for NVFP4), and the MBS bytes or MX+ block-max
# words (`plus_words`; None otherwise)
ATTRS = ("mxplus_w_codes", "mxplus_w_scales", "mxplus_w_mbs")
GLOBAL_ATTR = "mxplus_w_global"  # NVFP4: fp32 global scale of each weight row [N]
SMALL_SCALES_ATTR = "mxplus_w_small_scales"  # `decode_gemm.small_weight_scales` of the weight


def decode_max_m() -> int:
    """The largest M `triton-decode` serves now: BATCHED_DECODE_MAX_M (HELD_DECODE_MAX_M with
    the weight's FP8 form held), and below VLLM_MXPLUS_PREFILL_MIN_M, where the prefill
    GEMMs start."""
    top = HELD_DECODE_MAX_M if settings.fp8_weight_held() else BATCHED_DECODE_MAX_M
    return max(DECODE_MAX_M, min(top, settings.prefill_min_m() - 1))


def global_or_plus_pair(weight_format: str, activation_format: str) -> bool:
    """Whether both operands are NVFP4 (E4M3 scales under a global scale) or both MX+
    (block-max mantissa): the pairs the Triton kernels take besides the E8M0 ones."""
    w, a = get_format(weight_format), get_format(activation_format)
    return (w.has_global_scale and a.has_global_scale) or (
        w.block_max_mantissa and a.block_max_mantissa
    )


def decode_reads(
    weight_format: str, activation_format: str, hat: bool, m: int, device: torch.device
) -> bool:
    """Whether the decode GEMM (`decode_gemm`) reads this pair for m rows on `device`: the
    E8M0 pairs and NVFP4; MX+ where the layer takes x_hat (`hat`: its activation is read only
    as x_hat), m <= DECODE_MAX_M (its 16-row tile: wider ones spill) and on sm_90 or later
    (`sm90_or_later`)."""
    w, a = get_format(weight_format), get_format(activation_format)
    plus = w.block_max_mantissa and a.block_max_mantissa
    return not plus or (hat and m <= DECODE_MAX_M and sm90_or_later(device))


def triton_takes(weight_format: str, activation_format: str, macro_block: int) -> tuple[bool, str]:
    """Whether the Triton kernels take this scheme (linears and MoE experts): the E8M0 pairs
    with a macro block the tiles hold, NVFP4 and MX+. (True, "") or (False, why)."""
    if global_or_plus_pair(weight_format, activation_format):
        return True, ""
    ok, why = check_e8m0_pair(weight_format, activation_format, "Triton kernel")
    if not ok:
        return ok, why
    # What the kernels can tile (a macro block the act-quant tile or the GEMM's K step
    # cannot hold would fail to compile on the GPU; the interpreter accepts more).

    mbs = get_format(weight_format).mbs or get_format(activation_format).mbs
    if mbs and not (macro_block in SUPPORTED_MACRO_BLOCKS and supports_macro_block(macro_block)):
        return False, (
            f"macro block {macro_block} (the Triton kernels take the powers of two "
            f"{', '.join(map(str, SUPPORTED_MACRO_BLOCKS))}: their tiles hold whole "
            "macro blocks)"
        )
    return True, ""


def weight_operands(
    qweight: QuantizedTensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(codes, scales, extra, global) of a packed weight [N, K]: extra the MBS bytes or the
    MX+ block-max indices; global the NVFP4 fp32 global scale of each row [N] (one per
    logical weight, repeated over its rows)."""
    rows = qweight.codes.shape[0]
    extra = qweight.block_max_index if qweight.spec.block_max_mantissa else qweight.mbs
    g = qweight.global_scale
    if g is not None:
        g = g.to(torch.float32).reshape(-1).expand(rows).contiguous()
    return qweight.codes, qweight.scales, extra, g


class TritonKernels:
    """Where the Triton kernels run (linears and MoE experts alike): CUDA, with a working
    Triton."""

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        if platform != "cuda":
            return False, f"Triton kernels are built for CUDA, not {platform}"
        return launch.is_available(torch.device("cuda"))


class TritonDecodeBackend(TritonKernels, LinearBackend):
    name = "triton-decode"
    min_m: int = 1
    max_m: int | None = BATCHED_DECODE_MAX_M
    kernel = True  # self-tested against `formats` at first use

    @classmethod
    def m_bounds(cls) -> tuple[int, int | None]:
        return cls.min_m, decode_max_m()

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if spec.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False, f"output dtype {spec.out_dtype} (bf16, fp16 or fp32)"
        return triton_takes(spec.weight_format, spec.activation_format, spec.macro_block)

    def selftest_activation(self, x: Tensor) -> QuantizedTensor:
        """The fused quantizer's fields, compared bit for bit by the self-test: `formats`'
        QuantizedTensor of x with codes, scales, MBS bytes / MX+ block-max indices and
        global scales replaced by the kernel's."""

        spec = self.spec
        fmt = spec.activation_format
        c, s, extra, g = act_operands(x, fmt, spec.macro_block)
        ref = quantize(
            x.to(torch.float32), fmt, macro_block=spec.macro_block, per_row=spec.activation_per_row
        )
        plus = ref.spec.block_max_mantissa
        return dataclasses.replace(
            ref,
            codes=c,
            scales=s,
            mbs=None if plus else extra,
            global_scale=g,
            block_max_index=extra if plus else None,
        )

    def process_weights_after_loading(self, layer: Layer, qweight: QuantizedTensor) -> None:
        codes, scales, extra, g = weight_operands(qweight)
        if extra is not None and qweight.spec.block_max_mantissa:
            # MX+: the block maxima as the words the decode GEMM reads (mx_gemm takes them too)
            extra = block_max_words(codes, scales, extra)
        set_packed_buffers(layer, (*ATTRS, GLOBAL_ATTR), (codes, scales, extra, g))
        # checked once here (a host sync), read by every decode call
        setattr(
            layer, SMALL_SCALES_ATTR, scales.dtype == torch.uint8 and small_weight_scales(scales)
        )

    def _apply_mx_gemm(self, layer: Layer, x2: Tensor, bias: Tensor | None, g: Tensor | None):
        spec = self.spec
        a = act_operands(x2, spec.activation_format, spec.macro_block, g)
        fmt, bs = operand_format(spec.weight_format)
        weight = (*(getattr(layer, a_) for a_ in ATTRS), getattr(layer, GLOBAL_ATTR, None))
        return torch.ops.vllm_mxplus.triton_mx_gemm(
            *a, *weight, spec.k, bias, spec.out_dtype, fmt, bs, spec.macro_block
        )

    def apply(
        self, layer: Layer, x: Tensor, bias: Tensor | None, act_global_scale: Tensor | None = None
    ) -> Tensor:
        spec = self.spec
        x2 = x.reshape(-1, x.shape[-1])
        hat = takes_x_hat(spec.k)
        # batched decode where a K step is one macro block: narrower ones take an operand
        # row per macro block (`decode_gemm.sub_blocks`), a weight pass per few rows
        has_mbs = bool(get_format(spec.weight_format).mbs or get_format(spec.activation_format).mbs)
        batched = hat and sub_blocks(spec.macro_block, has_mbs, GPU_BLOCK_K) == 1
        # NVFP4 rows with given global scales (a row-parallel shard: the whole row's) keep
        # mx_gemm, whose quantizer takes them
        if (
            not decode_reads(
                spec.weight_format, spec.activation_format, hat, x2.shape[0], x2.device
            )
            or act_global_scale is not None
            or (x2.shape[0] > DECODE_MAX_M and not batched)
        ):  # mx_gemm's decode or prefill tiles (it picks them by M)
            y = self._apply_mx_gemm(layer, x2, bias, act_global_scale)
            return y.reshape(*x.shape[:-1], spec.n)

        x_hat = x_sigma = None
        if hat:
            a_codes, a_scales, a_mbs, a_global, x_hat, x_sigma = act_quant_hat_op(
                x2, spec.activation_format, macro_block=spec.macro_block
            )
        else:
            a_codes, a_scales, a_mbs, a_global = act_quant_op(
                x2, spec.activation_format, macro_block=spec.macro_block
            )
        plus = get_format(spec.weight_format).block_max_mantissa
        extra = layer.mxplus_w_mbs  # MBS bytes, or MX+'s block-max words (`plus_words`)
        y = decode_gemm_op(
            a_codes,
            a_scales,
            None if plus else a_mbs,
            layer.mxplus_w_codes,
            layer.mxplus_w_scales,
            None if plus else extra,
            spec.k,
            bias,
            spec.out_dtype,
            block_size=get_format(spec.weight_format).block_size,
            macro_block=spec.macro_block,
            w_small_scales=getattr(layer, SMALL_SCALES_ATTR, False),
            x_hat=x_hat,
            x_global=a_global,
            w_global=getattr(layer, GLOBAL_ATTR, None),
            w_block_max=extra if plus else None,
            x_sigma=x_sigma,
        )
        return y.reshape(*x.shape[:-1], spec.n)


class TritonGemmBackend(TritonDecodeBackend):
    """`mx_gemm` with prefill tiles for M > DECODE_MAX_M, every scheme and every macro block
    the kernels tile. Registered after the CUTLASS prefill GEMM, which serves first where it
    is built and takes the layer. It shares the decode backend's packed buffers."""

    name = "triton-gemm"
    min_m: int = DECODE_MAX_M + 1
    max_m: int | None = None

    @classmethod
    def m_bounds(cls) -> tuple[int, int | None]:
        return cls.min_m, cls.max_m

    def apply(
        self, layer: Layer, x: Tensor, bias: Tensor | None, act_global_scale: Tensor | None = None
    ) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = self._apply_mx_gemm(layer, x2, bias, act_global_scale)
        return y.reshape(*x.shape[:-1], self.spec.n)
