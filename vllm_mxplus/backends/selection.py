"""Backend registry and selector: a priority list per platform, no capability ladders.

`select(spec, platform, capability)` walks the platform's list and keeps every backend whose
`is_supported` and `can_implement` pass, that serves some M no earlier candidate serves
(`LinearBackend.min_m` / `max_m`), and, for a kernel backend, whose self-test against
`vllm_mxplus.formats` passes (`selftest.py`, once per process). It stops as soon as the
candidates together serve every M; only if they never do is the reference backend (any M,
any device, but a 4-byte fp32 weight copy per layer) appended. It logs once per distinct
situation what it chose, for which M, and why each better backend was rejected.

A `LinearDispatch` then picks per call the first candidate that serves the activation's row
count M (e.g. a decode GEMV for small M, then a prefill GEMM). With more than one candidate
that choice runs inside one registered custom op (`linear_op.py`), so vLLM's compiled graph
(dynamic token count, guards dropped) and CUDA graphs take the right backend for every M.

Backends are registered by import path so that a Triton / CUTLASS module is imported only on
the platform that may use it.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable

import torch

from vllm_mxplus.backends import registry, selftest
from vllm_mxplus.backends.base import LinearBackend, LinearSpec
from vllm_mxplus.backends.linear_op import register_layer
from vllm_mxplus.backends.reference.linear import ReferenceBackend
from vllm_mxplus.log_once import log_once

logger = logging.getLogger(__name__)

BackendRef = str | type[LinearBackend]  # "package.module:ClassName" or the class
MRange = tuple[int, int | None]  # (min_m, max_m), max_m None = no upper bound

# Priority order per platform; the reference backend is appended by the selector.
_REGISTRY: dict[str, list[BackendRef]] = {
    "cuda": [
        "vllm_mxplus.backends.triton.linear:TritonDecodeBackend",  # M <= 16
        "vllm_mxplus.backends.cutlass.linear:CutlassPrefillBackend",  # larger M, where built
        "vllm_mxplus.backends.triton.linear:TritonGemmBackend",  # larger M, macro blocks != 128
    ],
    "rocm": [],
    "xpu": [],
    "cpu": [
        "vllm_mxplus.backends.cpu.linear:CpuPackedBackend",  # C++ kernels, any M, E8M0 formats
    ],
}
_LOGGED: set[Hashable] = set()  # the selector's situations already logged (tests reset it)


def register_backend(platform: str, backend: BackendRef, priority: int | None = None) -> None:
    """Add a backend for a platform at position `priority` (0 = first; None = last)."""
    registry.register(_REGISTRY, platform, backend, priority)


def registered_backends(platform: str) -> list[BackendRef]:
    return list(_REGISTRY.get(platform, []))


def current_platform_of(device: torch.device) -> tuple[str, int | None]:
    """(platform name, capability as 10*major+minor or None) for a device."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return ("rocm" if torch.version.hip else "cuda"), 10 * major + minor
    return device.type, None


def first_uncovered_m(ranges: list[MRange], lo: int = 1, hi: int | None = None) -> int | None:
    """The smallest M in [lo, hi] (hi None: unbounded) that no range serves; None if all are."""
    cur = lo
    for a, b in sorted(ranges, key=lambda r: r[0]):
        if b is not None and b < cur:
            continue
        if a > cur:
            break
        if b is None:
            return None
        cur = b + 1
        if hi is not None and cur > hi:
            return None
    return cur if hi is None or cur <= hi else None


def _describe_m(r: MRange | None) -> str:
    if r is None:
        return "M: see supports_m"
    lo, hi = r
    if hi is None:
        return "any M" if lo <= 1 else f"M >= {lo}"
    return f"M <= {hi}" if lo <= 1 else f"{lo} <= M <= {hi}"


def select(spec: LinearSpec, platform: str, capability: int | None) -> list[LinearBackend]:
    """Candidates for this layer in priority order; together they serve every M.

    A backend whose M range earlier candidates already serve is never called, and the
    reference backend is kept only when the others leave some M uncovered: both would only
    cost memory (the reference holds a 4-byte fp32 copy of the weight)."""
    chosen: list[LinearBackend] = []
    served: list[MRange] = []  # the known ranges of the chosen backends
    rejected: list[str] = []
    notes: list[str] = []
    for cls in registry.screen(_REGISTRY, platform, capability, spec, rejected):
        r = cls.m_range()
        if r is not None and first_uncovered_m(served, *r) is None:
            notes.append(f"{cls.name}: {_describe_m(r)} already served")
            continue
        if cls.kernel and selftest.enabled():
            ok, why = selftest.verdict(cls, spec, platform, capability)
            if not ok:
                rejected.append(f"{cls.name}: {why}")
                continue
        chosen.append(cls(spec))
        if r is not None:
            served.append(r)
        if first_uncovered_m(served) is None:
            break
    gap = first_uncovered_m(served)
    if gap is not None:
        chosen.append(ReferenceBackend(spec))
    names = tuple(b.name for b in chosen)
    key = (platform, capability, spec.scheme, names, tuple(rejected))
    if rejected and len(chosen) == 1 and gap is not None:
        log_once(
            logger,
            key,
            logging.WARNING,
            "mxplus %s on %s (capability %s): falling back to the reference backend "
            "(dequantized fp32 weights, fake-quant activations) because %s",
            spec.scheme,
            platform,
            capability,
            "; ".join(rejected),
            seen=_LOGGED,
        )
    else:
        ranges = [
            _describe_m(type(b).m_range())
            if not isinstance(b, ReferenceBackend)
            else (f"M >= {gap}" if gap is not None and gap > 1 else "any M")
            for b in chosen
        ]
        log_once(
            logger,
            key,
            logging.INFO,
            "mxplus %s on %s (capability %s): backends %s%s",
            spec.scheme,
            platform,
            capability,
            " > ".join(f"{n} ({d})" if len(chosen) > 1 else n for n, d in zip(names, ranges)),
            "".join(
                f" ({label}: {'; '.join(items)})"
                for label, items in (("rejected", rejected), ("not needed", notes))
                if items
            ),
            seen=_LOGGED,
        )
    return chosen


class LinearDispatch:
    """The per-layer runtime: candidate backends, weights processed by each, pick by M."""

    def __init__(self, spec: LinearSpec, candidates: list[LinearBackend]):
        if not candidates:
            raise ValueError("LinearDispatch needs at least one backend")
        for b in candidates:
            if b.spec != spec:
                raise ValueError(f"backend {b.name} was made for {b.spec}, not this layer's {spec}")
        self.spec = spec
        self.candidates = candidates
        self.key: str | None = None  # the layer's key in linear_op's registry

    def process_weights_after_loading(self, layer: torch.nn.Module, qweight) -> None:
        for backend in self.candidates:
            backend.process_weights_after_loading(layer, qweight)
        if len(self.candidates) > 1:
            self.key = register_layer(layer, self)

    def pick(self, m: int) -> LinearBackend:
        for backend in self.candidates:
            if backend.supports_m(m):
                return backend
        return self.candidates[-1]

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        act_global_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # One candidate: call it directly (no registry lookup, no op boundary, and no read of
        # x.shape that could put a shape guard into a compiled graph).
        if len(self.candidates) == 1:
            return self.candidates[0].apply(layer, x, bias, act_global_scale)
        if self.key is None:
            raise RuntimeError("LinearDispatch.apply before process_weights_after_loading")
        return torch.ops.vllm_mxplus.linear_dispatch(x, bias, act_global_scale, self.key)
