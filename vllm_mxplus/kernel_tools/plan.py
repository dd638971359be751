"""`mxplus kernels --plan`: which backend serves which token counts M, per scheme and layer
kind, on a GPU this machine does not have.

The real selector (`backends.selection.select`) runs for every scheme, for a linear and for a
MoE layer, with the two hardware probes answered as the user says instead of by a device:
Triton runs (it ships with vLLM's CUDA wheels) and the CUTLASS extension is built or absent
(`--cutlass`). Everything else is the selector's own decision: priority order, each backend's
`is_supported` / `can_implement`, the M ranges, the reference only where kernels leave a gap.
What it cannot show is the first-use self-test on the hardware, which may still reject a
kernel there (the log says so; `scripts/gpu_check.sh` runs it).

Expert rows cover every expert activation (silu, gelu, gpt-oss's swigluoai) with and without
expert biases. Each row also says how many bytes per weight the layer's chosen backends hold
on the device together (`bytes_per_weight`): measured, not estimated, by running each chosen
backend's own `process_weights_after_loading` on a small quantized layer (CPU tensors
standing in for device ones) and counting every distinct tensor storage it keeps on the
layer. Only the sm_100a scale packing runs in the CUTLASS extension; its output is stood in
for by a tensor of the packed layout's size (`_SF_TILE_ROWS` x K/16 bytes per 128 rows).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any
from unittest import mock

import torch

from vllm_mxplus import settings
from vllm_mxplus.backends import selection
from vllm_mxplus.backends.base import ExpertSpec, ExpertWeights, LinearSpec, Spec
from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
from vllm_mxplus.backends.cutlass import linear as cutlass_linear
from vllm_mxplus.backends.expert_layer import SWIGLUOAI
from vllm_mxplus.backends.triton import launch as triton_launch
from vllm_mxplus.formats import (
    SCHEMES,
    Scheme,
    get_format,
    get_scheme,
    logical_amax,
    quantize,
    quantize_nvfp4_logical,
)

PLAN_SHAPE = (4096, 4096)  # (N, K) of the linear the plan asks about: whole macro blocks
PLAN_ACTIVATIONS = ("silu", "gelu", SWIGLUOAI)  # expert activations the plan asks about
# the small layers the bytes per weight are measured on: linear (N, K); experts (E, H, I)
MEASURE_LINEAR = (128, 512)
MEASURE_EXPERTS = (2, 256, 128)
ARCH_OF_CAPABILITY = {90: "sm90a", 100: "sm100a"}
_SF_TILE_ROWS = 128  # CUTLASS's block-scale layout pads rows to whole 128-row tiles


@dataclass(frozen=True)
class PlanRow:
    scheme: str
    layer: str  # "linear" or "experts"
    m_min: int
    m_max: int | None  # None: no upper bound
    backend: str
    bytes_per_weight: float  # held on the device by the layer's chosen backends together
    activation: str | None = None  # experts: the expert activation asked about
    bias: bool | None = None  # experts: with expert biases


@contextmanager
def _assumed_hardware(cutlass_built: bool, capability: int | None) -> Iterator[None]:
    why = "the CUTLASS extension is not built (--cutlass absent)"
    arch = ARCH_OF_CAPABILITY.get(capability or 0)

    def sf_stand_in(scales: torch.Tensor, k: int, chunk_k: int = 128) -> torch.Tensor:
        rows = -(-scales.shape[0] // _SF_TILE_ROWS) * _SF_TILE_ROWS
        return torch.empty(rows * (k // 16), dtype=torch.uint8, device=scales.device)

    with (
        mock.patch.object(triton_launch, "is_available", lambda *a, **k: (True, "")),
        mock.patch.object(
            cutlass_linear,
            "is_available",
            lambda *a, **k: (cutlass_built, "" if cutlass_built else why),
        ),
        mock.patch.object(cutlass_linear, "arch_of", lambda *a, **k: arch),
        mock.patch.object(cutlass_gemm, "pack_scales_sm100", sf_stand_in),
        mock.patch.object(settings, "selftest_enabled", lambda: False),
        mock.patch.object(selection, "_LOGGED", set()),
    ):
        log = logging.getLogger(selection.__name__)
        level, log.level = log.level, logging.WARNING  # the plan itself says it all
        try:
            yield
        finally:
            log.setLevel(level)


def _storages(obj: Any, seen: dict[int, int], depth: int = 0) -> None:
    """Every distinct tensor storage reachable from obj (attributes, containers, dataclasses,
    a module's parameters and buffers): data pointer -> bytes."""
    if depth > 6 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    elif isinstance(obj, torch.nn.Module):
        for t in (*obj.parameters(recurse=False), *obj.buffers(recurse=False)):
            _storages(t, seen, depth + 1)
        for name, v in vars(obj).items():
            if not name.startswith("_"):
                _storages(v, seen, depth + 1)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            _storages(v, seen, depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            _storages(v, seen, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _storages(getattr(obj, f.name), seen, depth + 1)


def _held_bytes(layer: torch.nn.Module) -> int:
    seen: dict[int, int] = {}
    _storages(layer, seen)
    return sum(seen.values())


@functools.cache
def _quantized_weight(fmt: str, macro_block: int, shape: tuple[int, ...], parts: int = 1):
    """A random weight of `shape` ([E, N, K] or [N, K]) quantized as [rows, K] (NVFP4: one
    global scale per logical weight, `parts` per expert), once per plan process."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    flat = t.reshape(-1, shape[-1])
    if not get_format(fmt).has_global_scale:
        return quantize(flat, fmt, macro_block=macro_block)
    e = shape[0] if len(shape) == 3 else 1
    amax = logical_amax(t.reshape(e, parts, -1, shape[-1])).reshape(-1)
    return quantize_nvfp4_logical(flat, amax, [flat.shape[0] // (e * parts)] * (e * parts))


def _linear_bytes(spec: LinearSpec, chosen: list) -> float:
    n, k = MEASURE_LINEAR
    q = _quantized_weight(spec.weight_format, spec.macro_block, (n, k))
    layer = torch.nn.Module()
    for b in chosen:
        b.process_weights_after_loading(layer, q)
    return _held_bytes(layer) / (n * k)


def _expert_bytes(spec: ExpertSpec, chosen: list) -> float:
    e, h, inter = MEASURE_EXPERTS
    shapes = {"w13": (e, 2 * inter, h), "w2": (e, h, inter)}

    def quantized(stem: str):
        parts = 2 if stem == "w13" else 1
        return _quantized_weight(spec.weight_format, spec.macro_block, shapes[stem], parts), e

    def dequantized(stem: str) -> torch.Tensor:
        return quantized(stem)[0].dequantize(torch.float32).reshape(shapes[stem])

    layer = torch.nn.Module()
    layer.expert_map = None  # type: ignore[assignment]
    for b in chosen:
        b.process_weights_after_loading(layer, ExpertWeights(quantized, dequantized))
    return _held_bytes(layer) / sum(a * b * c for a, b, c in shapes.values())


def _rows(spec: Spec, platform: str, capability: int | None) -> list[PlanRow]:
    chosen = selection.select(spec, platform, capability)  # type: ignore[call-overload]
    activation: str | None = None
    bias: bool | None = None
    if isinstance(spec, LinearSpec):
        held = _linear_bytes(spec, chosen)
    else:
        assert isinstance(spec, ExpertSpec)
        held = _expert_bytes(spec, chosen)
        activation, bias = spec.activation, spec.has_bias
    rows: list[PlanRow] = []
    served: list[tuple[int, int | None]] = []
    for b in chosen:
        r = type(b).m_range() or (1, None)
        lo = selection.first_uncovered_m(served, *r)
        if lo is None:
            continue
        # an earlier (higher-priority) backend serving from above lo ends this one's range
        hi = min((a - 1 for a, _ in served if a > lo), default=r[1])
        hi = hi if r[1] is None else min(hi, r[1])
        rows.append(PlanRow(spec.scheme.name, spec.kind, lo, hi, b.name, held, activation, bias))
        served.append((lo, hi))
    return rows


def expert_specs(scheme: Scheme, platform: str) -> list[ExpertSpec]:
    """The MoE layers the plan asks about: every expert activation, with and without biases."""
    return [
        ExpertSpec(scheme, device_type=platform, activation=act, has_bias=bias)
        for act in PLAN_ACTIVATIONS
        for bias in (False, True)
    ]


def plan(
    platform: str, capability: int | None, cutlass_built: bool, out_dtype: torch.dtype
) -> list[PlanRow]:
    """The plan for every scheme, linears then experts (every activation, bias or not)."""
    n, k = PLAN_SHAPE
    rows: list[PlanRow] = []
    with _assumed_hardware(cutlass_built, capability):
        for name in SCHEMES:
            s = get_scheme(name)
            rows += _rows(
                LinearSpec(s, n, k, out_dtype, device_type=platform), platform, capability
            )
            for spec in expert_specs(s, platform):
                rows += _rows(spec, platform, capability)
    return rows


def _as_dict(r: PlanRow) -> dict[str, Any]:
    d = asdict(r)
    d["bytes_per_weight"] = round(r.bytes_per_weight, 4)
    if r.layer != "experts":
        del d["activation"], d["bias"]
    return d


def render(rows: list[PlanRow], as_json: bool) -> str:
    if as_json:
        return json.dumps([_as_dict(r) for r in rows], indent=1)
    width = max(len(r.scheme) for r in rows)
    lines = [f"{'scheme':<{width}}  layer    experts          M range      B/weight  backend"]
    for r in rows:
        m = f"{r.m_min}-{r.m_max}" if r.m_max is not None else f">= {r.m_min}"
        kind = "" if r.layer != "experts" else f"{r.activation}{' +bias' if r.bias else ''}"
        lines.append(
            f"{r.scheme:<{width}}  {r.layer:<7}  {kind:<15}  {m:<11}  "
            f"{r.bytes_per_weight:>8.3f}  {r.backend}"
        )
    return "\n".join(lines)
