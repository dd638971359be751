"""The linear-backend interface: one backend per file behind this small base class.

Modelled on vLLM's `model_executor/kernels/linear/mxfp4/` kernels: a backend says whether it
runs on a platform / capability (`is_supported`), whether it can implement one layer
(`can_implement`), which token counts M it serves (`min_m` / `max_m`, `supports_m`), turns the
loaded checkpoint tensors into its runtime layout once (`process_weights_after_loading`), and
computes y = x W^T + b (`apply`). The selector in `dispatch.py` keeps a priority list per
platform; a backend that runs its own kernels (`kernel = True`) is self-tested against
`vllm_mxplus.formats` the first time it is selected (`selftest.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import Module

from vllm_mxplus.formats import MACRO_BLOCK, QuantizedTensor, get_format, get_scheme

# (weight format, activation format) pairs of the E8M0 family that the packed kernels (Triton
# decode GEMM, C++ CPU kernels) implement: E8M0 scales, the same block size on both sides,
# MBS on either side optional. NVFP4 and MX+ are not among them.
E8M0_PAIRS = frozenset(
    {
        ("mxfp4-ocp", "mxfp4-ocp"),
        ("mxfp4-16", "mxfp4-16"),
        ("mxfp4-16-oas", "mxfp4-16-oas"),
        ("mxfp4-mbs-s", "mxfp4-mbs-s"),
        ("mxfp4-mbs-d", "mxfp4-mbs-s"),
    }
)


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
        """NVFP4 activations take one global scale per token (docs/numerics.md, NVFP4)."""
        return get_format(self.activation_format).scale_rule == "e4m3"


class LinearBackend(ABC):
    """One way to run a quantized linear, made for one layer: the backend owns the layer's
    `LinearSpec` (`self.spec`, given once by the selector) and keeps the runtime tensors it
    prepares on the layer, so `apply` takes only what changes per call."""

    name: str = "base"
    #: The token counts M the backend serves, inclusive (max_m None: no upper bound), e.g.
    #: a decode kernel min_m=1, max_m=16 and a prefill GEMM min_m=17. The selector keeps the
    #: reference backend (a 4-byte-per-weight fp32 copy) only when the candidates' ranges
    #: together leave some M uncovered, and drops a candidate whose range earlier ones cover.
    min_m: int = 1
    max_m: int | None = None
    #: Legacy declaration: False for a backend whose `supports_m` rejects some M without
    #: declaring `min_m` / `max_m`; its range is then unknown and the reference is kept.
    covers_all_m: bool = True
    #: True for a backend that runs its own kernels (not torch math on `formats` values): it
    #: is self-tested against `vllm_mxplus.formats` the first time it is selected for a
    #: (device, scheme, dtype), and rejected if it disagrees (`vllm_mxplus.backends.selftest`).
    kernel: bool = False
    #: Significand bits of the backend's GEMM accumulator, for the self-test's error bound
    #: (24: IEEE fp32 round to nearest; a tensor-core accumulator that keeps fewer bits says
    #: so here, with its reason).
    accumulator_bits: int = 24

    @classmethod
    @abstractmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        """(True, "") when the backend can run on this platform / device capability
        (e.g. 90 for sm_90); otherwise (False, the reason)."""

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        """(True, "") when the backend handles this layer's scheme and shape."""
        return True, ""

    @classmethod
    def m_range(cls) -> tuple[int, int | None] | None:
        """(min_m, max_m) served, or None when unknown (only `covers_all_m = False` and an
        overridden `supports_m`, no declared range): the selector then relies on it for no M."""
        if not cls.covers_all_m and cls.min_m == 1 and cls.max_m is None:
            return None
        return cls.min_m, cls.max_m

    @classmethod
    def supports_m(cls, m: int) -> bool:
        """Whether the backend serves an activation with m rows (e.g. decode-only kernels)."""
        return cls.min_m <= m and (cls.max_m is None or m <= cls.max_m)

    def __init__(self, spec: LinearSpec) -> None:
        self.spec = spec

    def selftest_activation(self, x: Tensor) -> QuantizedTensor | Tensor | None:
        """The backend's own activation quantization of rows x, for the self-test to compare
        bit for bit with `formats.quantize` (a QuantizedTensor: codes, scales, MBS bytes) or
        `formats.fake_quantize` (an fp32 tensor: the values). None: not exposed."""
        return None

    @abstractmethod
    def process_weights_after_loading(self, layer: Module, qweight: QuantizedTensor) -> None:
        """Turn the loaded (or just quantized) weight into this backend's runtime tensors,
        stored on `layer`. Called once per layer after loading."""

    @abstractmethod
    def apply(
        self, layer: Module, x: Tensor, bias: Tensor | None, act_global_scale: Tensor | None = None
    ) -> Tensor:
        """y = Q_act(x) @ W_hat^T + bias, in spec.out_dtype, shape [..., spec.n].

        act_global_scale: NVFP4 activations only, per-row global scales [..., 1] to use
        instead of x's own (row-parallel TP shards pass the whole row's)."""


def check_e8m0_pair(weight_format: str, activation_format: str, kernel: str) -> tuple[bool, str]:
    """Whether the packed E8M0 kernels take this pair: (True, "") or (False, why) naming
    `kernel`. The `can_implement` of those backends, also used for MoE experts."""
    if (weight_format, activation_format) not in E8M0_PAIRS:
        return False, f"no {kernel} for weights {weight_format} x activations {activation_format}"
    return True, ""


def set_packed_buffers(
    layer: torch.nn.Module, attrs: tuple[str, ...], tensors: tuple[torch.Tensor | None, ...]
) -> None:
    """Register a backend's runtime tensors on `layer` as non-persistent buffers (contiguous;
    None allowed), replacing earlier ones of the same names."""
    for attr, t in zip(attrs, tensors):
        if hasattr(layer, attr):
            delattr(layer, attr)
        layer.register_buffer(attr, None if t is None else t.contiguous(), persistent=False)
