"""`cpu-packed` experts: every scheme on the CPU (E8M0 formats, MX+, NVFP4); every expert
stays packed (~0.57 bytes per weight, MX+ ~0.59) and each expert GEMM runs the C++ kernels
(`experts_math.py`). It computes with the same fp32 values as the reference experts
(docs/numerics.md, Kernel numerics and error bounds), with every expert activation of the
reference (gated ones and gpt-oss's swigluoai) and expert biases.
"""

from __future__ import annotations

from torch import Tensor

from vllm_mxplus.backends.base import STEMS, Activation, ExpertBackend, ExpertWeights, Layer
from vllm_mxplus.backends.cpu.experts_math import PackedExperts, moe_experts_packed
from vllm_mxplus.backends.cpu.linear import CpuKernels
from vllm_mxplus.backends.expert_layer import expert_bias


class CpuPackedExperts(CpuKernels, ExpertBackend):
    name = "cpu-packed"
    kernel = True  # self-tested at first use (selftest_experts.py)

    def process_weights_after_loading(self, layer: Layer, weights: ExpertWeights) -> None:
        spec = self.spec
        layer.mxplus_packed = {
            stem: PackedExperts.from_rows(
                *weights.quantized(stem), spec.scheme.activation, spec.macro_block
            )
            for stem in STEMS
        }

    def apply(
        self, layer: Layer, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, act: Activation
    ) -> Tensor:
        return moe_experts_packed(
            x,
            layer.mxplus_packed["w13"],
            layer.mxplus_packed["w2"],
            topk_weights,
            topk_ids,
            activation=act,
            expert_map=layer.expert_map,
            row_global_scale=getattr(layer, "mxplus_row_global_scale", None),
            w13_bias=expert_bias(layer, "w13"),
            w2_bias=expert_bias(layer, "w2"),
        )
