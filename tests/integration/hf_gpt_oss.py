"""The transformers reference for gpt-oss experts: `GptOssExperts` with W4A4 fake quantization.

transformers' `GptOssExperts` keeps its experts as [E, K, N] stacks (`x @ W`), with biases and
the clamped `swigluoai` on interleaved gate / up columns, and no `act_fn`, so
`apply_fake_quant` (backends/reference/modules.py) leaves it alone. `FakeQuantGptOssExperts`
computes what the plugin serves for it (integration/fused_moe.py): each expert's gate_up
[2I, H] and down [H, I] weight quantized as one logical weight (one NVFP4 global scale
each), activations quantized per token before each expert GEMM, biases added in fp32,
`moe_experts_reference` with `SwigluOAI(alpha, limit)` of the transformers module.
`gpt_oss_experts_fake_quant()` makes `hf_reference.fake_quant_model` (and so `hf_greedy`)
replace them too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import hf_reference
import torch
from torch import nn

from vllm_mxplus.backends.expert_layer import SwigluOAI
from vllm_mxplus.backends.reference.experts import moe_experts_reference
from vllm_mxplus.formats import MACRO_BLOCK, Scheme, get_scheme, quantize


def _fake_quant_per_expert(w: torch.Tensor, scheme: Scheme) -> torch.Tensor:
    """[E, N, K] -> fp32 Ŵ, each expert's [N, K] one logical weight."""
    return torch.stack(
        [
            quantize(w[e], scheme.weight_format, macro_block=scheme.macro_block).dequantize(
                torch.float32
            )
            for e in range(w.shape[0])
        ]
    )


class FakeQuantGptOssExperts(nn.Module):
    """A drop-in for transformers' GptOssExperts with the plugin's W4A4 numerics."""

    w13_fp32: torch.Tensor
    w2_fp32: torch.Tensor

    def __init__(self, experts: nn.Module, scheme: Scheme):
        super().__init__()
        self.scheme = scheme
        gate_up = experts.get_parameter("gate_up_proj").detach()  # [E, H, 2I]
        down = experts.get_parameter("down_proj").detach()  # [E, I, H]
        self.register_buffer("w13_fp32", _fake_quant_per_expert(gate_up.transpose(1, 2), scheme))
        self.register_buffer("w2_fp32", _fake_quant_per_expert(down.transpose(1, 2), scheme))
        self.register_buffer("w13_bias", experts.get_parameter("gate_up_proj_bias").detach())
        self.register_buffer("w2_bias", experts.get_parameter("down_proj_bias").detach())
        self.activation = SwigluOAI(float(experts.alpha), float(experts.limit))

    def forward(
        self,
        hidden_states: torch.Tensor,
        router_indices: torch.Tensor,
        routing_weights: torch.Tensor,
    ) -> torch.Tensor:
        return moe_experts_reference(
            hidden_states,
            self.w13_fp32,
            self.w2_fp32,
            routing_weights,
            router_indices,
            self.scheme.activation_format,
            per_row=self.scheme.activations_per_row,
            activation=self.activation,
            macro_block=self.scheme.macro_block,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias,
        )


def replace_gpt_oss_experts(model: nn.Module, scheme: Scheme) -> list[str]:
    """Every transformers GptOssExperts of model replaced in place; returns their names."""
    names = [n for n, m in model.named_modules() if type(m).__name__ == "GptOssExperts"]
    for name in names:
        parent, _, child = name.rpartition(".")
        mod = model.get_submodule(parent)
        setattr(mod, child, FakeQuantGptOssExperts(getattr(mod, child), scheme))
    return names


@contextmanager
def gpt_oss_experts_fake_quant() -> Iterator[None]:
    """Within: `hf_reference.fake_quant_model` also fake-quantizes gpt-oss experts."""
    plain = hf_reference.fake_quant_model

    def fake_quant_model(
        model: nn.Module, scheme: str | None, macro_block: int = MACRO_BLOCK
    ) -> nn.Module:
        if scheme is not None:
            replace_gpt_oss_experts(model, get_scheme(scheme, macro_block))
        return plain(model, scheme, macro_block)

    hf_reference.fake_quant_model = fake_quant_model
    try:
        yield
    finally:
        hf_reference.fake_quant_model = plain
