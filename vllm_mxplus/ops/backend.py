"""The linear-backend interface: one backend per file behind this small base class.

Modelled on vLLM's `model_executor/kernels/linear/mxfp4/` kernels: a backend says whether it
runs on a platform / capability (`is_supported`), whether it can implement one layer
(`can_implement`), which token counts M it serves (`supports_m`), turns the loaded checkpoint
tensors into its runtime layout once (`process_weights_after_loading`), and computes
y = x W^T + b (`apply`). The selector in `dispatch.py` keeps a priority list per platform.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import torch

from vllm_mxplus.formats import MACRO_BLOCK, QuantizedTensor, get_format, get_scheme


# (weight format, activation format) pairs of the E8M0 family that the packed kernels (Triton
# decode GEMM, C++ CPU kernels) implement: E8M0 scales, the same block size on both sides,
# MBS on either side optional. NVFP4 and MX+ are not among them.
E8M0_PAIRS = frozenset({
    ("mxfp4-ocp", "mxfp4-ocp"),
    ("mxfp4-16", "mxfp4-16"),
    ("mxfp4-16-oas", "mxfp4-16-oas"),
    ("mxfp4-mbs-s", "mxfp4-mbs-s"),
    ("mxfp4-mbs-d", "mxfp4-mbs-s"),
})


@dataclass(frozen=True)
class LinearSpec:
    """What a backend needs to know about one quantized linear (per TP partition)."""

    scheme: str
    n: int  # output features on this rank (sum of the logical widths)
    k: int  # input features on this rank
    out_dtype: torch.dtype
    device_type: str = "cpu"
    macro_block: int = MACRO_BLOCK

    @property
    def weight_format(self) -> str:
        return get_scheme(self.scheme).weight_format

    @property
    def activation_format(self) -> str:
        return get_scheme(self.scheme).activation_format

    @property
    def activation_per_row(self) -> bool:
        """NVFP4 activations take one global scale per token (DESIGN.md §1)."""
        return get_format(self.activation_format).scale_rule == "e4m3"


class LinearBackend(ABC):
    """One way to run a quantized linear. Subclasses are stateless apart from their name."""

    name: str = "base"
    #: False for a backend whose `supports_m` rejects some M (e.g. decode-only kernels): the
    #: selector then keeps the next backends, down to the reference, for the other M.
    covers_all_m: bool = True

    @classmethod
    @abstractmethod
    def is_supported(cls, platform: str, capability: Optional[int]) -> tuple[bool, str]:
        """(True, "") when the backend can run on this platform / device capability
        (e.g. 90 for sm_90); otherwise (False, the reason)."""

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        """(True, "") when the backend handles this layer's scheme and shape."""
        return True, ""

    @classmethod
    def supports_m(cls, m: int) -> bool:
        """Whether the backend serves an activation with m rows (e.g. decode-only kernels)."""
        return True

    @abstractmethod
    def process_weights_after_loading(
        self, layer: torch.nn.Module, qweight: QuantizedTensor, spec: LinearSpec
    ) -> None:
        """Turn the loaded (or just quantized) weight into this backend's runtime tensors,
        stored on `layer`. Called once per layer after loading."""

    @abstractmethod
    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: Optional[torch.Tensor],
        spec: LinearSpec,
        act_global_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """y = Q_act(x) @ W_hat^T + bias, in spec.out_dtype, shape [..., spec.n].

        act_global_scale: NVFP4 activations only, per-row global scales [..., 1] to use
        instead of x's own (row-parallel TP shards pass the whole row's)."""


def check_e8m0_pair(weight_format: str, activation_format: str,
                    kernel: str) -> tuple[bool, str]:
    """Whether the packed E8M0 kernels take this pair: (True, "") or (False, why) naming
    `kernel`. The `can_implement` of those backends, also used for MoE experts."""
    if (weight_format, activation_format) not in E8M0_PAIRS:
        return False, f"no {kernel} for weights {weight_format} x activations {activation_format}"
    return True, ""


def set_packed_buffers(layer: torch.nn.Module, attrs: tuple[str, ...],
                       tensors: tuple[Optional[torch.Tensor], ...]) -> None:
    """Register a backend's runtime tensors on `layer` as non-persistent buffers (contiguous;
    None allowed), replacing earlier ones of the same names."""
    for attr, t in zip(attrs, tensors):
        if hasattr(layer, attr):
            delattr(layer, attr)
        layer.register_buffer(attr, None if t is None else t.contiguous(), persistent=False)
