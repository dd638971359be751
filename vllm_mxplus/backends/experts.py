"""Expert backends of the FusedMoE method: a priority list per platform, like backends/selection.py.

A backend turns one MoE layer's expert weights into its runtime form once
(`process_weights_after_loading`) and computes the routed experts (`apply`). The selector
walks the platform's list, takes the first backend whose `is_supported` and `can_implement`
pass, falls back to the reference (fp32 experts, any device), and logs once per situation
what it chose and why each better backend was rejected. A grouped GPU kernel slots in with
`register_expert_backend("cuda", "package.module:Class", priority=0)`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import Module

from vllm_mxplus.backends import registry
from vllm_mxplus.formats import QuantizedTensor, get_format
from vllm_mxplus.log_once import log_once

logger = logging.getLogger(__name__)
STEMS = ("w13", "w2")  # gate|up stacked [E, 2I, H]; down [E, H, I]


@dataclass(frozen=True)
class MoESpec:
    """What an expert backend needs to know about one MoE layer (per TP partition)."""

    scheme: str
    weight_format: str
    activation_format: str
    macro_block: int
    device_type: str

    @property
    def activation_per_row(self) -> bool:
        """NVFP4 activations take one global scale per token (docs/numerics.md, NVFP4)."""
        return get_format(self.activation_format).scale_rule == "e4m3"


@dataclass
class ExpertWeights:
    """The loaded experts, in the two forms a backend may want (computed on demand).

    quantized(stem) -> (QuantizedTensor of all local experts' rows [E*N, K], E)
    dequantized(stem) -> fp32 [E, N, K] (NVFP4: one global scale per logical weight)
    """

    quantized: Callable[[str], tuple[QuantizedTensor, int]]
    dequantized: Callable[[str], torch.Tensor]


Activation = Callable[[Tensor], Tensor]  # the layer's gated activation, [M, 2I] -> [M, I]


class ExpertBackend(ABC):
    """One way to run a layer's routed experts, made for one layer: the backend owns the
    layer's `MoESpec` (`self.spec`) and keeps its runtime expert tensors on the layer."""

    name: str = "base"
    summary: str = ""  # what the selection log says when chosen (default: name)

    @classmethod
    @abstractmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        """(True, "") when the backend runs on this platform / capability, else the reason."""

    @classmethod
    def can_implement(cls, spec: MoESpec) -> tuple[bool, str]:
        return True, ""

    def __init__(self, spec: MoESpec) -> None:
        self.spec = spec

    @abstractmethod
    def process_weights_after_loading(self, layer: Module, weights: ExpertWeights) -> None:
        """Store the runtime expert tensors on `layer` (once, after loading)."""

    @abstractmethod
    def apply(
        self, layer: Module, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, act: Activation
    ) -> Tensor:
        """Routed-expert output [M, H] in x's dtype (TP partial sums; not all-reduced)."""


BackendRef = str | type[ExpertBackend]  # "package.module:Class" or the class
_REGISTRY: dict[str, list[BackendRef]] = {
    "cuda": [],  # a grouped Triton / CUTLASS expert kernel goes here
    "rocm": [],
    "xpu": [],
    "cpu": ["vllm_mxplus.backends.cpu.experts:CpuPackedExperts"],
}
REFERENCE: BackendRef = "vllm_mxplus.backends.cpu.experts:ReferenceExperts"


def register_expert_backend(
    platform: str, backend: BackendRef, priority: int | None = None
) -> None:
    """Add an expert backend for a platform at `priority` (0 = first; None = last)."""
    registry.register(_REGISTRY, platform, backend, priority)


def registered_expert_backends(platform: str) -> list[BackendRef]:
    return list(_REGISTRY.get(platform, []))


def select_expert_backend(spec: MoESpec, platform: str, capability: int | None) -> ExpertBackend:
    """The first registered backend that runs here and implements spec, else the reference;
    logs the choice (and every rejection) once per situation."""
    rejected: list[str] = []
    for cls in registry.screen(_REGISTRY, platform, capability, spec, rejected):
        log_once(
            logger,
            ("moe", spec.scheme, platform, cls.name),
            logging.INFO,
            "mxplus %s MoE experts on %s: %s",
            spec.scheme,
            platform,
            cls.summary or cls.name,
        )
        return cls(spec)
    if not _REGISTRY.get(platform):
        rejected.append(f"no expert backend registered for {platform}")
    log_once(
        logger,
        ("moe", spec.scheme, platform, "reference", tuple(rejected)),
        logging.INFO,
        "mxplus %s MoE experts on %s: reference path (dequantized fp32 experts, "
        "fake-quant activations) because %s",
        spec.scheme,
        platform,
        "; ".join(rejected),
    )
    return registry.resolve(REFERENCE)(spec)
