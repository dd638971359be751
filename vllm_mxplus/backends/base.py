"""The one backend interface, for linear layers and for MoE experts alike.

Modelled on vLLM's `model_executor/kernels/linear/mxfp4/` kernels: a backend says whether it
runs on a platform / capability (`is_supported`), whether it can implement one layer
(`can_implement`), which token counts M it serves (`min_m` / `max_m`, `supports_m`), turns the
loaded weights into its runtime layout once (`process_weights_after_loading`) and computes the
layer (`apply`). A layer is described by a `Spec` holding its whole `Scheme` (weight format,
activation format, macro block): `LinearSpec` for a linear, `ExpertSpec` for a layer's routed
experts. The selector (`selection.py`) keeps one priority list per (layer kind, platform); a
backend that runs its own kernels (`kernel = True`) is self-tested against
`vllm_mxplus.formats` the first time it is selected (`selftest.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, TypeVar, overload

import torch
from torch import Tensor

from vllm_mxplus.formats import FORMATS, FormatSpec, QuantizedTensor, Scheme, get_format, get_scheme

# The layer a backend keeps its runtime tensors on: a torch Module (a vLLM LinearBase or
# RoutedExperts, or a bare Module in the self-tests) to which vLLM and the backends add
# attributes at run time, which mypy cannot follow through Module.__getattr__.
Layer = Any

LayerKind = Literal["linear", "experts"]
LAYER_KINDS: tuple[LayerKind, ...] = ("linear", "experts")


def is_cpu_kernel_pair(weight: FormatSpec, activation: FormatSpec) -> bool:
    """Whether the C++ CPU kernels (and the CPU exact-bf16 path, which uses their activation
    quantizers) take this (weight, activation) pair: both NVFP4-like (E4M3 + global scale),
    both MX+ (block maxima), or an E8M0 pair (`is_e8m0_pair`)."""
    if weight.has_global_scale and activation.has_global_scale:
        return True
    if weight.block_max_mantissa and activation.block_max_mantissa:
        return True
    return is_e8m0_pair(weight, activation)


def is_e8m0_pair(weight: FormatSpec, activation: FormatSpec) -> bool:
    """Whether the packed E8M0 kernels (Triton decode GEMM, C++ CPU kernels) implement this
    (weight, activation) pair: E8M0 scales under one scale rule and one block size on both
    sides, no MX+ block max, MBS on both sides or neither (the activation's static; the
    weight's static or dynamic). NVFP4 and MX+ have kernels of their own."""
    return (
        weight.scale_is_e8m0
        and activation.scale_is_e8m0
        and not (weight.block_max_mantissa or activation.block_max_mantissa)
        and weight.scale_rule == activation.scale_rule
        and weight.block_size == activation.block_size
        and activation.mbs != "dynamic"
        and bool(weight.mbs) == bool(activation.mbs)
    )


# Those pairs by name, for tests and the ahead-of-time compile lists.
E8M0_PAIRS = frozenset(
    (w.name, a.name) for w in FORMATS.values() for a in FORMATS.values() if is_e8m0_pair(w, a)
)


T = TypeVar("T")


class _FromScheme(Generic[T]):
    """A read-only attribute of `Spec` that reads its scheme's attribute `name` (the spec
    holds the scheme, not copies of its parts)."""

    def __init__(self, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, spec: None, owner: type) -> _FromScheme[T]: ...
    @overload
    def __get__(self, spec: Spec, owner: type) -> T: ...
    def __get__(self, spec: Spec | None, owner: type) -> T | _FromScheme[T]:
        return self if spec is None else getattr(spec.scheme, self.name)


@dataclass(frozen=True)
class Spec:
    """What a backend needs to know about one layer (per TP partition): its whole scheme
    (a `Scheme`, or a scheme name meaning that scheme at its default macro block) and the
    device type its weights live on."""

    kind: ClassVar[LayerKind]
    scheme: Scheme
    device_type: str = field(default="cpu", kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, Scheme):
            object.__setattr__(self, "scheme", get_scheme(self.scheme))

    weight_format = _FromScheme[str]("weight_format")
    activation_format = _FromScheme[str]("activation_format")
    macro_block = _FromScheme[int]("macro_block")
    # NVFP4 activations take one global scale per token (docs/numerics.md, NVFP4)
    activation_per_row = _FromScheme[bool]("activations_per_row")


@dataclass(frozen=True)
class LinearSpec(Spec):
    """One quantized linear: y [M, n] = x [M, k] W^T (+ b) in out_dtype."""

    kind: ClassVar[LayerKind] = "linear"
    n: int  # output features on this rank (sum of the logical widths)
    k: int  # input features on this rank
    out_dtype: torch.dtype


@dataclass(frozen=True)
class ExpertSpec(Spec):
    """One MoE layer's routed experts (w13 [E, 2I, H], w2 [E, H, I] on this rank): also the
    layer's expert activation (a vLLM MoEActivation value) and whether its experts have biases,
    for backends that implement only some (expert_layer.py)."""

    kind: ClassVar[LayerKind] = "experts"
    activation: str = field(default="silu", kw_only=True)
    has_bias: bool = field(default=False, kw_only=True)


STEMS = ("w13", "w2")  # gate|up stacked [E, 2I, H]; down [E, H, I]


@dataclass
class ExpertWeights:
    """The loaded experts, in the two forms a backend may want (computed on demand).

    quantized(stem) -> (QuantizedTensor of all local experts' rows [E*N, K], E)
    dequantized(stem) -> fp32 [E, N, K] (NVFP4: one global scale per logical weight)
    """

    quantized: Callable[[str], tuple[QuantizedTensor, int]]
    dequantized: Callable[[str], torch.Tensor]


Activation = Callable[[Tensor], Tensor]  # the layer's gated activation, [M, 2I] -> [M, I]


S = TypeVar("S", bound=Spec)


class Backend(ABC, Generic[S]):
    """One way to run one kind of quantized layer, made for one layer: the backend owns the
    layer's spec (`self.spec`, given once by the selector) and keeps the runtime tensors it
    prepares on the layer, so `apply` takes only what changes per call."""

    kind: ClassVar[LayerKind]
    name: str = "base"
    #: The token counts M the backend serves, inclusive (max_m None: no upper bound), e.g.
    #: a decode kernel min_m=1, max_m=16 and a prefill GEMM min_m=17. The selector keeps the
    #: reference backend (a 4-byte-per-weight fp32 copy) only when the candidates' ranges
    #: together leave some M uncovered, and drops a candidate whose range earlier ones cover.
    min_m: int = 1
    max_m: int | None = None
    #: False for a backend whose `supports_m` rejects some M without declaring `min_m` /
    #: `max_m`; its range is then unknown and the reference is kept.
    covers_all_m: bool = True
    #: True for a backend that runs its own kernels (not torch math on `formats` values): it
    #: is self-tested against `vllm_mxplus.formats` the first time it is selected for a
    #: (device, scheme, dtype), and rejected if it disagrees (`selftest.py`).
    kernel: bool = False
    #: Significand bits kept by the backend's GEMM accumulator, for the self-test's error
    #: bound (24: IEEE fp32 round to nearest; an accumulator that keeps fewer bits says so
    #: here, with its reason: docs/numerics.md, "Kernel numerics and error bounds").
    accumulator_bits: int = 24
    #: K elements the narrow accumulator sums (from zero) before each promotion into fp32, for a
    #: backend with accumulator_bits < 24 (None: one accumulator over all K). The bound is
    #: then the chunked one (`checks.accumulation_gamma`).
    accumulation_chunk: int | None = None

    @classmethod
    @abstractmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        """(True, "") when the backend can run on this platform / device capability
        (e.g. 90 for sm_90); otherwise (False, the reason)."""

    @classmethod
    def can_implement(cls, spec: S) -> tuple[bool, str]:
        """(True, "") when the backend handles this layer's scheme and shape."""
        return True, ""

    @classmethod
    def can_implement_on(cls, spec: S, capability: int | None) -> tuple[bool, str]:
        """(True, "") unless a rule needs both the layer and the device: a path the backend
        has for this scheme on this generation that another backend beats (the selector asks
        after `is_supported` and `can_implement` pass). Most backends have none."""
        return True, ""

    @classmethod
    def m_bounds(cls) -> tuple[int, int | None]:
        """(min_m, max_m) as declared now: the class attributes, or a setting read at use by a
        backend that overrides this (e.g. the CUTLASS prefill GEMM's VLLM_MXPLUS_PREFILL_MIN_M)."""
        return cls.min_m, cls.max_m

    @classmethod
    def m_range(cls) -> tuple[int, int | None] | None:
        """(min_m, max_m) served, or None when unknown (only `covers_all_m = False` and an
        overridden `supports_m`, no declared range): the selector then relies on it for no M."""
        lo, hi = cls.m_bounds()
        if not cls.covers_all_m and lo == 1 and hi is None:
            return None
        return lo, hi

    @classmethod
    def supports_m(cls, m: int) -> bool:
        """Whether the backend serves an activation with m rows (e.g. decode-only kernels)."""
        lo, hi = cls.m_bounds()
        return lo <= m and (hi is None or m <= hi)

    def __init__(self, spec: S) -> None:
        if spec.kind != self.kind:
            raise TypeError(f"{self.name} is a {self.kind} backend, given a {spec.kind} spec")
        self.spec = spec


class LinearBackend(Backend[LinearSpec]):
    """A backend for one quantized linear (`LinearSpec`)."""

    kind: ClassVar[LayerKind] = "linear"

    @property
    def branches_on_m(self) -> bool:
        """Whether apply picks its kernels by the row count M: then it must run inside the
        dispatch's opaque op (`linear_op`), where the test runs on every call, not once at
        trace time in a compiled graph. Set once the weights are processed."""
        return False

    def selftest_activation(self, x: Tensor) -> QuantizedTensor | Tensor | None:
        """The backend's own activation quantization of rows x, for the self-test to compare
        bit for bit with `formats.quantize` (a QuantizedTensor: codes, scales, MBS bytes) or
        `formats.fake_quantize` (an fp32 tensor: the values). None: not exposed."""
        return None

    @abstractmethod
    def process_weights_after_loading(self, layer: Layer, qweight: QuantizedTensor) -> None:
        """Turn the loaded (or just quantized) weight into this backend's runtime tensors,
        stored on `layer`. Called once per layer after loading."""

    @abstractmethod
    def apply(
        self, layer: Layer, x: Tensor, bias: Tensor | None, act_global_scale: Tensor | None = None
    ) -> Tensor:
        """y = Q_act(x) @ W_hat^T + bias, in spec.out_dtype, shape [..., spec.n].

        act_global_scale: NVFP4 activations only, per-row global scales [..., 1] to use
        instead of x's own (row-parallel TP shards pass the whole row's)."""


class ExpertBackend(Backend[ExpertSpec]):
    """A backend for one MoE layer's routed experts (`ExpertSpec`)."""

    kind: ClassVar[LayerKind] = "experts"

    @abstractmethod
    def process_weights_after_loading(self, layer: Layer, weights: ExpertWeights) -> None:
        """Store the runtime expert tensors on `layer` (once, after loading)."""

    @abstractmethod
    def apply(
        self, layer: Layer, x: Tensor, topk_weights: Tensor, topk_ids: Tensor, act: Activation
    ) -> Tensor:
        """Routed-expert output [M, H] in x's dtype (TP partial sums; not all-reduced)."""


def check_e8m0_pair(
    weight_format: str | FormatSpec, activation_format: str | FormatSpec, kernel: str
) -> tuple[bool, str]:
    """Whether the packed E8M0 kernels take this pair (`is_e8m0_pair`): (True, "") or (False,
    why) naming `kernel`. The `can_implement` of those backends, also used for MoE experts."""
    w = weight_format if isinstance(weight_format, FormatSpec) else get_format(weight_format)
    a = (
        activation_format
        if isinstance(activation_format, FormatSpec)
        else get_format(activation_format)
    )
    if not is_e8m0_pair(w, a):
        return False, f"no {kernel} for weights {w.name} x activations {a.name}"
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
