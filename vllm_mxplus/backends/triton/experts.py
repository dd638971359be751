"""`triton-grouped` experts on CUDA: every scheme's experts stay packed on the GPU (codes,
scales, MBS bytes / MX+ block-max indices, NVFP4 global scales: ~0.57 bytes per weight) and
run the grouped Triton GEMM of `moe_gemm` (pairs sorted into per-expert row tiles on the
device; activations quantized per token / pair row by the fused quantizers). The same values
as the reference experts up to fp32 accumulation order (docs/numerics.md, "Kernel numerics
and error bounds"; `moe_gemm`'s docstring). Expert parallelism (`layer.expert_map`, -1 for
other ranks' experts) and tensor parallelism (NVFP4 down-projection rows quantized with the
whole row's global scale, `layer.mxplus_row_global_scale`) as the CPU experts do.

Every expert activation of `expert_layer` (silu, gelu, gelu_tanh on w13's halves; gpt-oss's
swigluoai with its alpha, limit and the +1 on up, on the interleaved row) and expert biases
(w13_bias, w2_bias, added in fp32 before the model-dtype cast), as the CPU experts serve them:
h is `expert_layer.gated(act, g|u)` on the device, the biases gathered per pair
(`moe_gemm.pair_bias`).

Every call is CUDA-graph capturable: torch ops and kernel launches only, shapes from the
input shapes, no host synchronisation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_mxplus.backends.base import (
    STEMS,
    Activation,
    ExpertBackend,
    ExpertSpec,
    ExpertWeights,
    Layer,
)
from vllm_mxplus.backends.expert_layer import EXPERT_ACTIVATIONS, expert_bias
from vllm_mxplus.backends.triton.decode_gemm import small_weight_scales
from vllm_mxplus.backends.triton.gemm_ops import act_operands
from vllm_mxplus.backends.triton.linear import TritonKernels, triton_takes, weight_operands
from vllm_mxplus.backends.triton.moe_gemm import PackedExpertWeights, moe_experts_triton
from vllm_mxplus.backends.triton.ops import act_quant_hat_op

PACKED_ATTR = "mxplus_triton_experts"  # {stem: PackedExpertWeights} on the layer


class TritonExperts(TritonKernels, ExpertBackend):
    name = "triton-grouped"
    summary = "triton-grouped GEMM (packed FP4 experts on the GPU)"
    kernel = True  # self-tested against `formats` at first use (selftest_experts.py)

    @classmethod
    def can_implement(cls, spec: ExpertSpec) -> tuple[bool, str]:
        if spec.activation not in EXPERT_ACTIVATIONS:
            return False, (
                f"the expert activation {spec.activation!r} (the grouped Triton experts "
                f"compute {', '.join(EXPERT_ACTIVATIONS)})"
            )
        return triton_takes(spec.weight_format, spec.activation_format, spec.macro_block)

    def process_weights_after_loading(self, layer: Layer, weights: ExpertWeights) -> None:
        packed = {}
        for stem in STEMS:
            q, e = weights.quantized(stem)
            codes, scales, extra, g = weight_operands(q)
            codes, scales = codes.contiguous(), scales.contiguous()
            extra = None if extra is None else extra.contiguous()
            g = None if g is None else g.contiguous()
            if scales.dtype == torch.float8_e4m3fn:
                scales = scales.view(torch.uint8)
            # E8M0 scales checked once here (a host sync) for the grouped decode kernel
            small = scales.dtype == torch.uint8 and g is None and small_weight_scales(scales)
            packed[stem] = PackedExpertWeights(
                codes, scales, extra, g, e, q.shape[0] // e, q.shape[-1], small
            )
        setattr(layer, PACKED_ATTR, packed)

    def apply(
        self, layer: Layer, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, act: Activation
    ) -> Tensor:

        spec = self.spec
        packed = getattr(layer, PACKED_ATTR)
        # act_operands reads the activation format by name (the fused quantizers' API)
        afmt = spec.activation_format

        def quantize_rows(rows: Tensor, g: Tensor | None) -> tuple:
            c, s, extra, gs = act_operands(rows, afmt, spec.macro_block, g)
            if s.dtype == torch.float8_e4m3fn:
                s = s.view(torch.uint8)
            return c, s, extra, None if gs is None else gs.reshape(-1)

        def quantize_hat(rows: Tensor) -> tuple:
            return act_quant_hat_op(rows, afmt, macro_block=spec.macro_block)

        return moe_experts_triton(
            x,
            packed["w13"],
            packed["w2"],
            topk_weights,
            topk_ids,
            weight=spec.scheme.weight,
            activation_mbs=bool(spec.scheme.activation.mbs),
            quantize_rows=quantize_rows,
            macro_block=spec.macro_block,
            activation=act,
            expert_map=getattr(layer, "expert_map", None),
            row_global_scale=getattr(layer, "mxplus_row_global_scale", None),
            w13_bias=expert_bias(layer, "w13"),
            w2_bias=expert_bias(layer, "w2"),
            quantize_hat=quantize_hat,
        )
