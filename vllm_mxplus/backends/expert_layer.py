"""What an MoE layer computes around its two expert GEMMs, beyond W4A4: the expert
activation and the expert biases, for every expert backend.

- Activations, by vLLM MoEActivation value: the gated ones, act(g) * u on w13's halves (gate
  rows, then up rows: silu, gelu, gelu_tanh), and gpt-oss's `swigluoai` on the whole g|u row,
  gate and up interleaved (`SwigluOAI`, vLLM's SwigluOAIAndMul). `gated(act, g|u)` applies
  either kind; every backend computes h with it, in the model dtype.
- Expert biases (gpt-oss): w13_bias [E, 2I] and w2_bias [E, H] on the layer, in the model
  dtype, added in fp32 after each expert GEMM (`expert_bias`).
- `ExpertSpec` (base.py) carries the layer's activation and whether it has biases, for backends
  that implement only some (`can_implement`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from vllm_mxplus.backends.base import Activation, Layer

# The gated activations act(g) * u on w13's halves (gate rows, then up rows), by vLLM
# MoEActivation value.
GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
}
SWIGLUOAI = "swigluoai"  # gpt-oss: gate / up interleaved along w13's rows, clamped
# vLLM 0.32's SwigluOAIAndMul defaults, which its gpt-oss experts use (the layer's
# swiglu_alpha / swiglu_limit take precedence where a model sets them)
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0
# Every expert activation the expert backends implement
EXPERT_ACTIVATIONS = (*GATED_ACTIVATIONS, SWIGLUOAI)


@dataclass(frozen=True)
class SwigluOAI:
    """gpt-oss's clamped SwiGLU on the whole g|u row [R, 2I] -> [R, I], gate in the even and
    up in the odd columns (vLLM's SwigluOAIAndMul.forward_native, transformers'
    GptOssExperts._apply_gate), in the dtype of g|u:
    g = min(g, limit); u = clamp(u, -limit, limit); h = (u + 1) * g * sigmoid(alpha * g)."""

    alpha: float = SWIGLUOAI_ALPHA
    limit: float = SWIGLUOAI_LIMIT
    takes_gate_up: ClassVar[bool] = True  # see gated()

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def expert_activation(
    name: str, alpha: float | None = None, limit: float | None = None
) -> Activation | None:
    """The activation callable of a vLLM MoEActivation value (alpha / limit: the layer's
    swiglu_alpha / swiglu_limit, None for the defaults), or None when none implements it."""
    if name == SWIGLUOAI:
        return SwigluOAI(
            SWIGLUOAI_ALPHA if alpha is None else alpha, SWIGLUOAI_LIMIT if limit is None else limit
        )
    return GATED_ACTIVATIONS.get(name)


def gated(activation: Activation, gate_up: torch.Tensor) -> torch.Tensor:
    """h [R, I] from g|u [R, 2I]: an activation that takes the whole row (`takes_gate_up`,
    `SwigluOAI`) gets it; any other is act(g) * u on the halves."""
    if getattr(activation, "takes_gate_up", False):
        return activation(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate) * up


def expert_bias(layer: Layer, stem: str) -> torch.Tensor | None:
    """The layer's expert biases of a stem (w13 [E, 2I], w2 [E, H]) or None."""
    return getattr(layer, f"{stem}_bias", None)
