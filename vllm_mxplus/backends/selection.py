"""The backend registry and selector, for linear layers and MoE experts alike.

One priority list per (layer kind, platform), no capability ladders. `select(spec, platform,
capability)` walks the list for the spec's kind and keeps every backend whose `is_supported`
and `can_implement` pass, that serves some M no earlier candidate serves (`Backend.min_m` /
`max_m`), and, for a kernel backend, whose self-test against `vllm_mxplus.formats` passes
(`selftest.py`, once per process). It stops as soon as the candidates together serve every
M; only if they never do is the kind's reference backend (any M, any device, but a 4-byte
fp32 weight copy) appended. It logs once per distinct situation what it chose, for which M,
and why each better backend was rejected.

`VLLM_MXPLUS_BACKEND` (`vllm_mxplus.settings`) narrows the lists: one name forces that
backend, a comma list allows only those (in priority order, the reference only if named);
the layer then fails to load, naming the layer and the reason, when the allowed backends
cannot serve every M.

The per-call choice among the candidates (`pick`) happens in `linear_op.LinearDispatch` for
linears (inside one custom op, for compiled graphs and CUDA graphs) and in the FusedMoE method
for experts (vLLM runs MoE layers inside its own opaque custom op).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, overload

import torch

from vllm_mxplus import settings
from vllm_mxplus.backends import selftest
from vllm_mxplus.backends.base import (
    LAYER_KINDS,
    Backend,
    ExpertBackend,
    ExpertSpec,
    LayerKind,
    LinearBackend,
    LinearSpec,
    Spec,
)
from vllm_mxplus.backends.reference.experts import ReferenceExperts
from vllm_mxplus.backends.reference.linear import ReferenceBackend
from vllm_mxplus.log_once import log_once

logger = logging.getLogger(__name__)

MRange = tuple[int, int | None]  # (min_m, max_m), max_m None = no upper bound


@dataclass(frozen=True)
class LazyBackend:
    """A registered backend named without importing its family: `target` is
    "package.module:Class", imported the first time the selector screens that platform (a CPU
    worker never imports a Triton or CUTLASS module, a CUDA worker no C++ CPU build code)."""

    name: str
    target: str

    def load(self) -> type[Backend]:
        module, _, attr = self.target.partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if cls.name != self.name:
            raise RuntimeError(f"registry entry {self.name!r} resolves to {cls.name!r}")
        return cls


Entry = type[Backend] | LazyBackend
Registry = dict[str, list[Entry]]  # platform -> backends in priority order

# Priority order per layer kind and platform; the kind's reference backend is appended by the
# selector where the others leave some M uncovered (never on CUDA unless VLLM_MXPLUS_BACKEND
# names it).
_REGISTRY: dict[LayerKind, Registry] = {
    "linear": {
        "cuda": [
            # (a backend serves the M its range holds that no backend before it serves)
            # M >= VLLM_MXPLUS_PREFILL_MIN_M, where the extension is built
            LazyBackend(
                "cutlass_prefill", "vllm_mxplus.backends.cutlass.linear:CutlassPrefillBackend"
            ),
            # sm_100 from the decode GEMM's 64-row tile on (below the extension's range where
            # it is built): the block-scaled FP4 MMA (tcgen05)
            LazyBackend(
                "triton-fp4-prefill",
                "vllm_mxplus.backends.triton.fp4_prefill:TritonFp4PrefillBackend",
            ),
            # decode and batched decode: M up to 128 (`triton.linear.decode_max_m`)
            LazyBackend("triton-decode", "vllm_mxplus.backends.triton.linear:TritonDecodeBackend"),
            # large M where the extension is not built: the FP8-chunk pipeline on Triton
            LazyBackend(
                "triton-fp8-prefill",
                "vllm_mxplus.backends.cutlass.linear:TritonFp8PrefillBackend",
            ),
            # the rest of M > 16
            LazyBackend("triton-gemm", "vllm_mxplus.backends.triton.linear:TritonGemmBackend"),
        ],
        "rocm": [],
        "xpu": [],
        # C++ kernels, any M, every scheme
        "cpu": [LazyBackend("cpu-packed", "vllm_mxplus.backends.cpu.linear:CpuPackedBackend")],
    },
    "experts": {
        # grouped Triton GEMM, packed experts, every scheme and expert activation
        "cuda": [
            LazyBackend("triton-grouped", "vllm_mxplus.backends.triton.experts:TritonExperts")
        ],
        "rocm": [],
        "xpu": [],
        # C++ kernels, packed experts, every scheme
        "cpu": [LazyBackend("cpu-packed", "vllm_mxplus.backends.cpu.experts:CpuPackedExperts")],
    },
}
# Platforms whose layers never fall back to the reference unless VLLM_MXPLUS_BACKEND names it:
# the reference holds fp32 weights (4 bytes each) and its routing is not what a GPU serves with.
NO_SILENT_REFERENCE = ("cuda",)
REFERENCE: dict[LayerKind, type[Backend]] = {
    "linear": ReferenceBackend,
    "experts": ReferenceExperts,
}
_LOGGED: set[Hashable] = set()  # the selector's situations already logged (tests reset it)


class BackendUnavailable(RuntimeError):
    """The backends `VLLM_MXPLUS_BACKEND` allows cannot serve a layer."""


def register_backend(platform: str, backend: type[Backend], priority: int | None = None) -> None:
    """Add a backend class for a platform (its kind from `backend.kind`) at position `priority`
    (0 = first; None = last); one registered again moves."""
    entries = _REGISTRY[backend.kind].setdefault(platform, [])
    entries[:] = [e for e in entries if e is not backend]
    entries.insert(len(entries) if priority is None else priority, backend)


def _load(entry: Entry) -> type[Backend]:
    return entry.load() if isinstance(entry, LazyBackend) else entry


def registered_backends(platform: str, kind: LayerKind = "linear") -> list[type[Backend]]:
    """The backend classes of a kind on a platform, in priority order (imports that
    platform's families)."""
    return [_load(e) for e in _REGISTRY[kind].get(platform, [])]


def backend_names(kind: LayerKind) -> list[str]:
    """Every backend name of a kind on any platform, reference included, in registry order."""
    names: list[str] = []
    for entries in _REGISTRY[kind].values():
        names += [e.name for e in entries if e.name not in names]
    return names + [REFERENCE[kind].name]


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


def describe_m(r: MRange | None) -> str:
    if r is None:
        return "M: see supports_m"
    lo, hi = r
    if hi is None:
        return "any M" if lo <= 1 else f"M >= {lo}"
    return f"M <= {hi}" if lo <= 1 else f"{lo} <= M <= {hi}"


def _allowed(kind: LayerKind) -> tuple[str, ...] | None:
    """The backend names VLLM_MXPLUS_BACKEND allows for this kind (one name: forced); None
    when it leaves the kind alone. Kinds and names are checked against the registry."""
    choice = settings.backend_choice()
    if choice is None:
        return None
    bad_kinds = [k for k in choice.names if k and k not in LAYER_KINDS]
    if bad_kinds:
        raise BackendUnavailable(
            f"{settings.BACKEND.name}={choice.raw!r}: unknown layer kind "
            f"{', '.join(map(repr, bad_kinds))}; use {' or '.join(LAYER_KINDS)}"
        )
    names = choice.names_for(kind)
    if not names:
        return None
    valid = backend_names(kind)
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise BackendUnavailable(
            f"{settings.BACKEND.name}={choice.raw!r}: no {kind} backend named "
            f"{', '.join(map(repr, unknown))}; {kind} backends: {', '.join(valid)} "
            f"(prefix a name with 'linear:' or 'experts:' to apply it to one kind only)"
        )
    return names


def screen(
    spec: Spec, platform: str, capability: int | None, rejected: list[str]
) -> list[type[Backend]]:
    """The registered backends of the spec's kind on this platform, in priority order, that
    run here and implement spec; appends "name: reason" to `rejected` for every other one."""
    passed = []
    for cls in registered_backends(platform, spec.kind):
        ok, why = cls.is_supported(platform, capability)
        if ok:
            ok, why = cls.can_implement(spec)
        if ok:
            ok, why = cls.can_implement_on(spec, capability)
        if ok:
            passed.append(cls)
        else:
            rejected.append(f"{cls.name}: {why}")
    return passed


@overload
def select(
    spec: LinearSpec, platform: str, capability: int | None, where: str = ""
) -> list[LinearBackend]: ...
@overload
def select(
    spec: ExpertSpec, platform: str, capability: int | None, where: str = ""
) -> list[ExpertBackend]: ...
def select(spec: Spec, platform: str, capability: int | None, where: str = "") -> list[Any]:
    """Candidates for this layer in priority order; together they serve every M.

    A backend whose M range earlier candidates already serve is never called, and the
    reference backend is kept only when the others leave some M uncovered (or when
    VLLM_MXPLUS_BACKEND names it): both would only cost memory (the reference holds a 4-byte
    fp32 copy of the weight). `where` names the layer in errors."""
    allowed = _allowed(spec.kind)
    chosen: list[Backend] = []
    served: list[MRange] = []  # the known ranges of the chosen backends
    rejected: list[str] = []
    notes: list[str] = []
    candidates = screen(spec, platform, capability, rejected)
    reference = REFERENCE[spec.kind]
    if allowed is not None:
        here = [e.name for e in _REGISTRY[spec.kind].get(platform, [])] + [reference.name]
        rejected += [
            f"{n}: not a {spec.kind} backend on {platform}" for n in allowed if n not in here
        ]
        if reference.name in allowed:
            candidates.append(reference)
        rejected += [
            f"{c.name}: not in {settings.BACKEND.name}" for c in candidates if c.name not in allowed
        ]
        candidates = [c for c in candidates if c.name in allowed]
    for cls in candidates:
        r = cls.m_range()
        if r is not None and first_uncovered_m(served, *r) is None:
            notes.append(f"{cls.name}: {describe_m(r)} already served")
            continue
        if cls.kernel and settings.selftest_enabled():
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
    if gap is not None and allowed is not None:
        what = f"{settings.BACKEND.name}={','.join(allowed)}"
        raise BackendUnavailable(
            f"{where or spec.kind}: {spec.scheme} on {platform} (capability {capability}): "
            f"{what} leaves M >= {gap} unserved"
            + (f" ({'; '.join(rejected)})" if rejected else "")
            + (
                f"; allow another backend too (e.g. {what},{reference.name}) or unset "
                f"{settings.BACKEND.name}"
            )
        )
    if gap is not None and platform in NO_SILENT_REFERENCE:
        raise BackendUnavailable(
            f"{where or spec.kind}: {spec.scheme} on {platform} (capability {capability}): no "
            f"kernel backend serves M >= {gap}"
            + (f" ({'; '.join(rejected)})" if rejected else "")
            + f"; the reference backend (fp32 weights, 4 bytes each) serves a {platform} layer "
            f"only when asked: {settings.BACKEND.name}={spec.kind}:{reference.name}"
        )
    if gap is not None:
        chosen.append(reference(spec))
    _log_choice(spec, platform, capability, chosen, rejected, notes, gap)
    return chosen


def _log_choice(
    spec: Spec,
    platform: str,
    capability: int | None,
    chosen: Sequence[Backend],
    rejected: list[str],
    notes: list[str],
    gap: int | None,
) -> None:
    names = tuple(b.name for b in chosen)
    key = (spec.kind, platform, capability, spec.scheme, names, tuple(rejected))
    what = " MoE experts" if spec.kind == "experts" else ""  # linears: the plain message
    if rejected and len(chosen) == 1 and gap is not None:
        log_once(
            logger,
            key,
            logging.WARNING,
            "mxplus %s%s on %s (capability %s): falling back to the reference backend "
            "(dequantized fp32 weights, fake-quant activations) because %s",
            spec.scheme,
            what,
            platform,
            capability,
            "; ".join(rejected),
            seen=_LOGGED,
        )
        return
    ranges = [
        describe_m(type(b).m_range())
        if type(b) is not REFERENCE[spec.kind] or gap is None
        else (f"M >= {gap}" if gap > 1 else "any M")
        for b in chosen
    ]
    log_once(
        logger,
        key,
        logging.INFO,
        "mxplus %s%s on %s (capability %s): backends %s%s",
        spec.scheme,
        what,
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


def pick(candidates: Sequence[Backend], m: int) -> Backend:
    """The first candidate that serves an activation of m rows (the last as a fallback)."""
    for backend in candidates:
        if backend.supports_m(m):
            return backend
    return candidates[-1]


__all__ = [
    "LAYER_KINDS",
    "REFERENCE",
    "LazyBackend",
    "BackendUnavailable",
    "backend_names",
    "current_platform_of",
    "first_uncovered_m",
    "pick",
    "register_backend",
    "registered_backends",
    "select",
]
