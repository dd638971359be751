"""The Triton backends: fused activation quantizer + memory-bound FP4 GEMM.

For few rows (M <= DECODE_MAX_M) the packed FP4 weight, its E8M0 scales and MBS bytes are
streamed once and dequantized in registers (`triton_decode_gemm`); activations are quantized
by the fused Triton quantizer into the same layout, so decode computes the same numbers as
the reference (up to fp32 accumulation order). MBS macro blocks: powers of two 16..2048
(`SUPPORTED_MACRO_BLOCKS`); others go to the reference path.

Larger M goes to the next backend. With macro block 128 that is the CUTLASS prefill GEMM
(sm_90a / sm_100a, where built), else the reference. The CUTLASS kernels take only 128, so
for any other macro block `TritonGemmBackend` (the same kernels, which are correct for any M)
serves M > DECODE_MAX_M instead of the reference, whose fp32 weight copy costs 4 bytes per
weight.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import Module

from vllm_mxplus.backends.base import (
    LinearBackend,
    LinearSpec,
    check_e8m0_pair,
    set_packed_buffers,
)
from vllm_mxplus.formats import QuantizedTensor, get_format
from vllm_mxplus.formats.constants import MACRO_BLOCK

DECODE_MAX_M = 16
PREFILL_MACRO_BLOCK = MACRO_BLOCK  # the one macro block the CUTLASS prefill GEMM takes
ATTRS = ("mxplus_w_codes", "mxplus_w_scales", "mxplus_w_mbs")


class TritonDecodeBackend(LinearBackend):
    name = "triton-decode"

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        if platform != "cuda":
            return False, f"Triton kernels are built for CUDA, not {platform}"
        from vllm_mxplus.backends.triton.launch import is_available

        return is_available(torch.device("cuda"))

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        ok, why = check_e8m0_pair(spec.weight_format, spec.activation_format, "decode kernel")
        if not ok:
            return ok, why
        if spec.out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return False, f"output dtype {spec.out_dtype} (bf16, fp16 or fp32)"
        # What the kernels can tile (a macro block the act-quant tile or the GEMM's K step
        # cannot hold would fail to compile on the GPU; the interpreter accepts more).
        from vllm_mxplus.backends.triton.act_quant import SUPPORTED_MACRO_BLOCKS
        from vllm_mxplus.backends.triton.decode_gemm import supports_macro_block

        mbs = get_format(spec.weight_format).mbs or get_format(spec.activation_format).mbs
        if mbs and not (
            spec.macro_block in SUPPORTED_MACRO_BLOCKS and supports_macro_block(spec.macro_block)
        ):
            return False, (
                f"macro block {spec.macro_block} (the Triton kernels take the powers of two "
                f"{', '.join(map(str, SUPPORTED_MACRO_BLOCKS))}: their tiles hold whole "
                "macro blocks)"
            )
        return True, ""

    min_m, max_m = 1, DECODE_MAX_M
    kernel = True  # self-tested against `formats` at first use

    def selftest_activation(self, x: Tensor) -> QuantizedTensor:
        spec = self.spec
        """The fused quantizer's codes, compared bit for bit by the self-test."""
        from vllm_mxplus.backends.triton.ops import act_quant_op

        c, s, m, _ = act_quant_op(x, spec.activation_format, macro_block=spec.macro_block)
        return QuantizedTensor(
            codes=c,
            scales=s,
            fmt=spec.activation_format,
            shape=x.shape,
            mbs=m,
            macro_block=spec.macro_block,
        )

    def process_weights_after_loading(self, layer: Module, qweight: QuantizedTensor) -> None:
        set_packed_buffers(layer, ATTRS, (qweight.codes, qweight.scales, qweight.mbs))

    def apply(
        self, layer: Module, x: Tensor, bias: Tensor | None, act_global_scale: Tensor | None = None
    ) -> Tensor:
        from vllm_mxplus.backends.triton.ops import act_quant_op, decode_gemm_op

        spec = self.spec
        x2 = x.reshape(-1, x.shape[-1])
        a_codes, a_scales, a_mbs, _ = act_quant_op(
            x2, spec.activation_format, macro_block=spec.macro_block
        )
        y = decode_gemm_op(
            a_codes,
            a_scales,
            a_mbs,
            layer.mxplus_w_codes,
            layer.mxplus_w_scales,
            layer.mxplus_w_mbs,
            spec.k,
            bias,
            spec.out_dtype,
            block_size=get_format(spec.weight_format).block_size,
            macro_block=spec.macro_block,
        )
        return y.reshape(*x.shape[:-1], spec.n)


class TritonGemmBackend(TritonDecodeBackend):
    """The Triton kernels for M > DECODE_MAX_M, for MBS macro blocks the CUTLASS prefill GEMM
    does not take (all but 128): registered after it, so a layer gets Triton for every M and
    no fp32 weight copy. It shares the decode backend's packed buffers (same tensors)."""

    name = "triton-gemm"
    min_m, max_m = DECODE_MAX_M + 1, None

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        ok, why = super().can_implement(spec)
        if not ok:
            return ok, why
        mbs = get_format(spec.weight_format).mbs or get_format(spec.activation_format).mbs
        if not mbs or spec.macro_block == PREFILL_MACRO_BLOCK:
            what = f"macro block {PREFILL_MACRO_BLOCK}" if mbs else "formats without MBS"
            return False, (
                f"prefill for {what} is the CUTLASS GEMM's (or the reference's); this one "
                "takes the other macro blocks"
            )
        return True, ""
