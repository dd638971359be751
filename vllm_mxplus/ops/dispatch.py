"""Backend registry and selector: a priority list per platform, no capability ladders.

`select(spec, platform, capability)` walks the platform's list, keeps every backend whose
`is_supported` and `can_implement` pass, stops after the first that serves every M (else
ends with the reference backend, which serves any M on any device), and logs
once per distinct situation what it chose and why each better backend was rejected. A
`LinearDispatch` then picks per call the first candidate that serves the activation's row
count M (e.g. a decode GEMV for small M, then a prefill GEMM, then the reference).

Backends are registered by import path so that a Triton / CUTLASS module is imported only on
the platform that may use it.
"""

from __future__ import annotations

import importlib
import logging
from typing import Optional, Union

import torch

from vllm_mxplus.ops.backend import LinearBackend, LinearSpec
from vllm_mxplus.ops.reference import ReferenceBackend

logger = logging.getLogger(__name__)

BackendRef = Union[str, type[LinearBackend]]  # "package.module:ClassName" or the class

# Priority order per platform; the reference backend is appended by the selector.
_REGISTRY: dict[str, list[BackendRef]] = {
    "cuda": [
        "vllm_mxplus.ops.triton_backend:TritonDecodeBackend",  # M <= 16
        "vllm_mxplus.ops.cutlass_prefill:CutlassPrefillBackend",  # larger M, where built
    ],
    "rocm": [],
    "xpu": [],
    "cpu": [
        "vllm_mxplus.ops.cpu_backend:CpuPackedBackend",  # C++ kernels, any M, E8M0 formats
    ],
}
_LOGGED: set[tuple] = set()


def register_backend(platform: str, backend: BackendRef, priority: Optional[int] = None) -> None:
    """Add a backend for a platform at position `priority` (0 = first; None = last)."""
    entries = _REGISTRY.setdefault(platform, [])
    if backend in entries:
        entries.remove(backend)
    entries.insert(len(entries) if priority is None else priority, backend)


def registered_backends(platform: str) -> list[BackendRef]:
    return list(_REGISTRY.get(platform, []))


def current_platform_of(device: torch.device) -> tuple[str, Optional[int]]:
    """(platform name, capability as 10*major+minor or None) for a device."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return ("rocm" if torch.version.hip else "cuda"), 10 * major + minor
    return device.type, None


def _resolve(ref: BackendRef) -> type[LinearBackend]:
    if isinstance(ref, str):
        module, _, cls = ref.partition(":")
        return getattr(importlib.import_module(module), cls)
    return ref


def _log_once(key: tuple, level: int, msg: str, *args) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.log(level, msg, *args)


def select(
    spec: LinearSpec, platform: str, capability: Optional[int]
) -> list[LinearBackend]:
    """Candidates for this layer in priority order; the last one serves every M.

    Backends after the first that serves every M are never called, so they are not kept
    (their weights would only cost memory, e.g. the reference's fp32 copy)."""
    chosen: list[LinearBackend] = []
    rejected: list[str] = []
    for ref in _REGISTRY.get(platform, []):
        try:
            cls = _resolve(ref)
        except Exception as e:  # a kernel module that cannot import is a rejection
            rejected.append(f"{ref}: import failed ({type(e).__name__}: {e})")
            continue
        ok, why = cls.is_supported(platform, capability)
        if ok:
            ok, why = cls.can_implement(spec)
        if ok:
            chosen.append(cls())
            if cls.covers_all_m:
                break
        else:
            rejected.append(f"{cls.name}: {why}")
    if not chosen or not chosen[-1].covers_all_m:
        chosen.append(ReferenceBackend())
    names = tuple(b.name for b in chosen)
    key = (platform, capability, spec.scheme, names, tuple(rejected))
    if rejected and len(chosen) == 1:
        _log_once(key, logging.WARNING,
                  "mxplus %s on %s (capability %s): falling back to the reference backend "
                  "(dequantized fp32 weights, fake-quant activations) because %s",
                  spec.scheme, platform, capability, "; ".join(rejected))
    else:
        _log_once(key, logging.INFO, "mxplus %s on %s (capability %s): backends %s%s",
                  spec.scheme, platform, capability, " > ".join(names),
                  f" (rejected: {'; '.join(rejected)})" if rejected else "")
    return chosen


class LinearDispatch:
    """The per-layer runtime: candidate backends, weights processed by each, pick by M."""

    def __init__(self, spec: LinearSpec, candidates: list[LinearBackend]):
        if not candidates:
            raise ValueError("LinearDispatch needs at least one backend")
        self.spec = spec
        self.candidates = candidates

    def process_weights_after_loading(self, layer: torch.nn.Module, qweight) -> None:
        for backend in self.candidates:
            backend.process_weights_after_loading(layer, qweight, self.spec)

    def pick(self, m: int) -> LinearBackend:
        for backend in self.candidates:
            if backend.supports_m(m):
                return backend
        return self.candidates[-1]

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: Optional[torch.Tensor],
        act_global_scale: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        # With one candidate, do not touch x.shape: keeps torch.compile free of shape guards.
        if len(self.candidates) == 1:
            backend = self.candidates[0]
        else:
            backend = self.pick(x.numel() // max(x.shape[-1], 1))
        return backend.apply(layer, x, bias, self.spec, act_global_scale)
