"""Reference fake-quant linears for any torch model (transformers reference, QSNR tooling).

`FakeQuantLinear` computes what the vLLM plugin's reference backend computes: weights
quantized with the scheme's weight format and dequantized once to fp32, activations
fake-quantized per call with the scheme's activation format, F.linear in fp32, bias added in
fp32, result cast back to the input dtype (see `vllm_mxplus.backends.reference.linear`).

`FakeQuantExperts` does the same for a transformers MoE expert stack (Qwen3-MoE, Mixtral,
... in transformers >= 5: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] parameters,
forward(hidden_states, top_k_index, top_k_weights)): every expert's gate, up and down weight
quantized as a separate logical weight, activations quantized per token before each expert
GEMM, computed by `ops.moe_reference` exactly as the vLLM FusedMoE method computes it.
lm_head, embeddings and MoE routers stay in high precision (`vllm_mxplus.quant_rules`, the rule
the plugin and the offline quantizer use).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from vllm_mxplus.backends.reference.experts import moe_experts_reference
from vllm_mxplus.backends.reference.linear import reference_linear
from vllm_mxplus.formats import Scheme, get_format, get_scheme, quantize
from vllm_mxplus.quant_rules import stays_unquantized


def _fake_quant_weight(w: torch.Tensor, fmt: str, macro_block: int) -> torch.Tensor:
    return quantize(w, fmt, macro_block=macro_block).dequantize(torch.float32)


class _FakeQuantModule(nn.Module):
    """The scheme (with its macro block), as every fake-quant module keeps it."""

    def __init__(self, scheme: Scheme) -> None:
        super().__init__()
        self.scheme = scheme
        self.weight_format = scheme.weight_format
        self.activation_format = scheme.activation_format
        # nvfp4 activations: one global scale per row (token), independent of batching
        self.per_row = scheme.activations_per_row
        self.macro_block = scheme.macro_block


class FakeQuantLinear(_FakeQuantModule):
    """A drop-in for nn.Linear with W4A4 fake quantization of one scheme."""

    weight_fp32: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, scheme: Scheme):
        super().__init__(scheme)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        w = linear.weight.detach()
        self.register_buffer(
            "weight_fp32", _fake_quant_weight(w, self.weight_format, self.macro_block)
        )
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference_linear(
            x,
            self.weight_fp32,
            self.bias,
            self.activation_format,
            per_row=self.per_row,
            out_dtype=x.dtype,
            macro_block=self.macro_block,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"scheme={self.scheme}"
        )


class FakeQuantExperts(_FakeQuantModule):
    """A drop-in for a transformers >= 5 expert stack with W4A4 fake quantization."""

    w13_fp32: torch.Tensor
    w2_fp32: torch.Tensor

    def __init__(self, experts: nn.Module, scheme: Scheme):
        super().__init__(scheme)
        self.act_fn: Callable[[torch.Tensor], torch.Tensor] = experts.act_fn  # type: ignore[assignment]
        gate_up = experts.get_parameter("gate_up_proj").detach()
        down = experts.get_parameter("down_proj").detach()
        self.num_experts = gate_up.shape[0]
        self.register_buffer("w13_fp32", self._fake_quant_stack(gate_up, 2, self.weight_format))
        self.register_buffer("w2_fp32", self._fake_quant_stack(down, 1, self.weight_format))

    def _fake_quant_stack(self, w: torch.Tensor, n_logical: int, fmt: str) -> torch.Tensor:
        """[E, N, K] of E * n_logical logical weights (gate | up stacked along N)."""
        e, n, k = w.shape
        if get_format(fmt).has_global_scale:  # one global scale per logical weight
            return torch.stack(
                [
                    torch.cat(
                        [
                            _fake_quant_weight(h, fmt, self.macro_block)
                            for h in w[i].chunk(n_logical, dim=0)
                        ]
                    )
                    for i in range(e)
                ]
            )
        # per-row formats: all rows in one call equal each weight apart
        return _fake_quant_weight(w.reshape(e * n, k), fmt, self.macro_block).reshape(e, n, k)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return moe_experts_reference(
            hidden_states,
            self.w13_fp32,
            self.w2_fp32,
            top_k_weights,
            top_k_index,
            self.activation_format,
            per_row=self.per_row,
            activation=self.act_fn,
            macro_block=self.macro_block,
        )

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, scheme={self.scheme}"


def _is_expert_stack(mod: nn.Module) -> bool:
    gu, down = getattr(mod, "gate_up_proj", None), getattr(mod, "down_proj", None)
    return (
        isinstance(gu, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gu.dim() == 3
        and down.dim() == 3
        and hasattr(mod, "act_fn")
    )


def _skipped(name: str, skip: Iterable[str]) -> bool:
    if stays_unquantized(name):
        return True
    parts = name.split(".")
    return any(name == s or name.endswith("." + s) or s in parts for s in skip)


def apply_fake_quant(
    model: nn.Module, scheme: str | Scheme, skip: Iterable[str] | None = None
) -> list[str]:
    """Replace every nn.Linear of `model` in place (and every MoE expert stack by a
    `FakeQuantExperts`), except lm_head, embeddings and MoE routers (vllm_mxplus.quant_rules)
    and those named in `skip` (a module name, its last component(s), or any path
    component), with the scheme's fake quantization (a name: at its default macro block).
    Returns the names of the replaced modules."""
    s = get_scheme(scheme)  # fails early on an unknown name
    skip = tuple(skip or ())
    targets = [
        (name, mod)
        for name, mod in model.named_modules()
        if (isinstance(mod, nn.Linear) or _is_expert_stack(mod)) and not _skipped(name, skip)
    ]
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        cls = FakeQuantLinear if isinstance(mod, nn.Linear) else FakeQuantExperts
        setattr(parent, child, cls(mod, s))
    return [name for name, _ in targets]
