"""`mxplus kernels --plan`: which backend serves which token counts M, per scheme and layer
kind, on a GPU this machine does not have.

The real selector (`backends.selection.select`) runs for every scheme, for a linear and for a
MoE layer, with the two hardware probes answered as the user says instead of by a device:
Triton runs (it ships with vLLM's CUDA wheels) and the CUTLASS extension is built or absent
(`--cutlass`). Everything else is the selector's own decision: priority order, each backend's
`is_supported` / `can_implement`, the M ranges, the reference only where kernels leave a gap.
What it cannot show is the first-use self-test on the hardware, which may still reject a
kernel there (the log says so; `scripts/gpu_check.sh` runs it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from unittest import mock

import torch

from vllm_mxplus import settings
from vllm_mxplus.backends import selection
from vllm_mxplus.backends.base import ExpertSpec, LinearSpec, Spec
from vllm_mxplus.backends.cutlass import linear as cutlass_linear
from vllm_mxplus.backends.triton import launch as triton_launch
from vllm_mxplus.formats import SCHEMES, get_scheme

PLAN_SHAPE = (4096, 4096)  # (N, K) of the linear the plan asks about: whole macro blocks


@dataclass(frozen=True)
class PlanRow:
    scheme: str
    layer: str  # "linear" or "experts"
    m_min: int
    m_max: int | None  # None: no upper bound
    backend: str


@contextmanager
def _assumed_hardware(cutlass_built: bool) -> Iterator[None]:
    why = "the CUTLASS extension is not built (--cutlass absent)"
    with (
        mock.patch.object(triton_launch, "is_available", lambda *a, **k: (True, "")),
        mock.patch.object(
            cutlass_linear,
            "is_available",
            lambda *a, **k: (cutlass_built, "" if cutlass_built else why),
        ),
        mock.patch.object(settings, "selftest_enabled", lambda: False),
        mock.patch.object(selection, "_LOGGED", set()),
    ):
        log = logging.getLogger(selection.__name__)
        level, log.level = log.level, logging.WARNING  # the plan itself says it all
        try:
            yield
        finally:
            log.setLevel(level)


def _rows(spec: Spec, platform: str, capability: int | None) -> list[PlanRow]:
    chosen = selection.select(spec, platform, capability)  # type: ignore[call-overload]
    rows: list[PlanRow] = []
    served: list[tuple[int, int | None]] = []
    for b in chosen:
        r = type(b).m_range() or (1, None)
        lo = selection.first_uncovered_m(served, *r)
        if lo is None:
            continue
        rows.append(PlanRow(spec.scheme.name, spec.kind, lo, r[1], b.name))
        served.append((lo, r[1]))
    return rows


def plan(
    platform: str, capability: int | None, cutlass_built: bool, out_dtype: torch.dtype
) -> list[PlanRow]:
    """The plan for every scheme, linears then experts."""
    n, k = PLAN_SHAPE
    rows: list[PlanRow] = []
    with _assumed_hardware(cutlass_built):
        for name in SCHEMES:
            s = get_scheme(name)
            rows += _rows(
                LinearSpec(s, n, k, out_dtype, device_type=platform), platform, capability
            )
            rows += _rows(ExpertSpec(s, device_type=platform), platform, capability)
    return rows


def render(rows: list[PlanRow], as_json: bool) -> str:
    if as_json:
        return json.dumps([asdict(r) for r in rows], indent=1)
    width = max(len(r.scheme) for r in rows)
    lines = [f"{'scheme':<{width}}  layer    M range      backend"]
    for r in rows:
        m = f"{r.m_min}-{r.m_max}" if r.m_max is not None else f">= {r.m_min}"
        lines.append(f"{r.scheme:<{width}}  {r.layer:<7}  {m:<11}  {r.backend}")
    return "\n".join(lines)
