"""`cpu-packed` experts: every scheme on the CPU (E8M0 formats, MX+, NVFP4); every expert
stays packed (~0.57 bytes per weight, MX+ ~0.59) and each expert GEMM runs the C++ kernels
(`experts_math.py`). It computes with the same fp32 values as the reference experts
(docs/numerics.md, Kernel numerics and error bounds).
"""

from __future__ import annotations

from torch import Tensor

from vllm_mxplus.backends.base import (
    STEMS,
    Activation,
    ExpertBackend,
    ExpertSpec,
    ExpertWeights,
    Layer,
)
from vllm_mxplus.backends.cpu import kernels as cpu_kernels
from vllm_mxplus.backends.cpu.experts_math import PackedExperts, moe_experts_packed
from vllm_mxplus.backends.cpu.linear import cpu_kernels_take


class CpuPackedExperts(ExpertBackend):
    name = "cpu-packed"
    kernel = True  # self-tested at first use (selftest_experts.py)

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        if platform != "cpu":
            return False, f"no packed expert kernel on {platform}"
        return cpu_kernels.load()

    @classmethod
    def can_implement(cls, spec: ExpertSpec) -> tuple[bool, str]:
        return cpu_kernels_take(spec.weight_format, spec.activation_format)

    def process_weights_after_loading(self, layer: Layer, weights: ExpertWeights) -> None:
        spec = self.spec
        experts = {}
        for stem in STEMS:
            q, e = weights.quantized(stem)
            experts[stem] = PackedExperts.from_rows(q, e, spec.activation_format, spec.macro_block)
        layer.mxplus_packed = experts

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
        )
