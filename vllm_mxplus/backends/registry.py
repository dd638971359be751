"""Per-platform priority lists of backends, shared by the linear selector (`dispatch.py`) and
the MoE expert selector (`backends/experts.py`).

A registry maps a platform name ("cuda", "rocm", "xpu", "cpu") to backends in priority
order, each a class or an import path "package.module:Class" (imported only when a selector
looks at that platform, so a Triton / CUTLASS module is never imported on the CPU). A backend
class answers `is_supported(platform, capability)` and `can_implement(spec)` with
(ok, reason); `screen` walks a platform's list and yields the classes that pass both, noting
why each other one was rejected.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

BackendRef = str | type  # "package.module:ClassName" or the class
Registry = dict[str, list[BackendRef]]


def register(registry: Registry, platform: str, backend: BackendRef, priority: int | None) -> None:
    """Add a backend for a platform at position `priority` (0 = first; None = last); one
    registered again moves."""
    entries = registry.setdefault(platform, [])
    if backend in entries:
        entries.remove(backend)
    entries.insert(len(entries) if priority is None else priority, backend)


def resolve(ref: BackendRef) -> Any:
    """The backend class of a registry entry (importing its module for an import path)."""
    if isinstance(ref, str):
        module, _, cls = ref.partition(":")
        return getattr(importlib.import_module(module), cls)
    return ref


def screen(
    registry: Registry, platform: str, capability: int | None, spec: Any, rejected: list[str]
) -> Iterator[Any]:
    """The platform's backend classes, in priority order, that run here and implement spec;
    appends "name: reason" to `rejected` for every other one (a module that cannot import
    is a rejection too)."""
    for ref in registry.get(platform, []):
        try:
            cls = resolve(ref)
        except Exception as e:  # noqa: BLE001 - a kernel module that cannot import is a rejection
            rejected.append(f"{ref}: import failed ({type(e).__name__}: {e})")
            continue
        ok, why = cls.is_supported(platform, capability)
        if ok:
            ok, why = cls.can_implement(spec)
        if ok:
            yield cls
        else:
            rejected.append(f"{cls.name}: {why}")
