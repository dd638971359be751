"""The expert backends that exist today: packed C++ experts on the CPU, and the reference.

- `cpu-packed`: every scheme on the CPU (E8M0 formats, MX+, NVFP4); every expert stays packed
  (~0.57 bytes per weight, MX+ ~0.59) and each expert GEMM runs the C++ kernels
  (`ops.moe_cpu`).
- `reference`: any format, any device; experts dequantized once to fp32, activations
  fake-quantized per token before each expert GEMM (`ops.moe_reference`). Correct everywhere,
  slow on a GPU.
Both compute with the same fp32 values (docs/numerics.md, Kernel numerics and error bounds).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import Module

from vllm_mxplus.backends.experts import (
    STEMS,
    Activation,
    ExpertBackend,
    ExpertWeights,
    MoESpec,
)
from vllm_mxplus.integration.params import tp_max

W13_FP32, W2_FP32 = "mxplus_w13_fp32", "mxplus_w2_fp32"  # dequantized experts on the layer


def _needs_row_amax_reduce(spec: MoESpec, layer: Module) -> bool:
    """NVFP4 under TP: the down projection's input rows are sharded, so their global scales
    must come from the whole rows (the max over ranks)."""
    return spec.activation_per_row and layer.moe_config.tp_size > 1


def _row_global_scale(layer: Module) -> Callable[[Tensor], Tensor] | None:
    """h [R, I_part] -> the global scales of the whole unsharded rows (or None: rows' own)."""
    if not layer.mxplus_row_amax_reduce:
        return None
    from vllm_mxplus.backends.reference.linear import nvfp4_row_global_scale

    def row_g(h: Tensor) -> Tensor:
        return tp_max(nvfp4_row_global_scale(h).contiguous(), layer.moe_config.tp_size)

    return row_g


class CpuPackedExperts(ExpertBackend):
    name = "cpu-packed"
    summary = "cpu-packed C++ kernels (packed FP4 experts)"

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        if platform != "cpu":
            return False, f"no packed expert kernel on {platform}"
        from vllm_mxplus.backends.cpu import kernels as cpu_kernels

        return cpu_kernels.load()

    @classmethod
    def can_implement(cls, spec: MoESpec) -> tuple[bool, str]:
        from vllm_mxplus.backends.cpu.linear import cpu_kernels_take

        return cpu_kernels_take(spec.weight_format, spec.activation_format)

    def process_weights_after_loading(self, layer: Module, weights: ExpertWeights) -> None:
        from vllm_mxplus.backends.cpu.experts_math import PackedExperts

        spec = self.spec
        experts = {}
        for stem in STEMS:
            q, e = weights.quantized(stem)
            experts[stem] = PackedExperts.from_rows(q, e, spec.activation_format, spec.macro_block)
        layer.mxplus_packed = experts
        layer.mxplus_row_amax_reduce = _needs_row_amax_reduce(spec, layer)

    def apply(
        self, layer: Module, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, act: Activation
    ) -> Tensor:
        from vllm_mxplus.backends.cpu.experts_math import moe_experts_packed

        return moe_experts_packed(
            x,
            layer.mxplus_packed["w13"],
            layer.mxplus_packed["w2"],
            topk_weights,
            topk_ids,
            activation=act,
            expert_map=layer.expert_map,
            row_global_scale=_row_global_scale(layer),
        )


class ReferenceExperts(ExpertBackend):
    name = "reference"

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        return True, ""

    def process_weights_after_loading(self, layer: Module, weights: ExpertWeights) -> None:
        spec = self.spec
        fp32 = {stem: weights.dequantized(stem).contiguous() for stem in STEMS}
        for stem, attr in zip(STEMS, (W13_FP32, W2_FP32)):
            layer.register_parameter(attr, torch.nn.Parameter(fp32[stem], requires_grad=False))
        layer.mxplus_row_amax_reduce = _needs_row_amax_reduce(spec, layer)

    def apply(
        self, layer: Module, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, act: Activation
    ) -> Tensor:
        from vllm_mxplus.backends.reference.experts import moe_experts_reference

        spec = self.spec
        return moe_experts_reference(
            x,
            getattr(layer, W13_FP32),
            getattr(layer, W2_FP32),
            topk_weights,
            topk_ids,
            spec.activation_format,
            per_row=spec.activation_per_row,
            activation=act,
            macro_block=spec.macro_block,
            expert_map=layer.expert_map,
            row_global_scale=_row_global_scale(layer),
        )
