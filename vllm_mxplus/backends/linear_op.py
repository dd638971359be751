"""`torch.ops.vllm_mxplus.linear_dispatch`: the per-call choice of backend by row count M,
inside one registered custom op, so compiled graphs and CUDA graphs see one opaque call.

vLLM compiles a model once with a dynamic token dimension and drops Dynamo's guards
(`vllm/compilation/wrapper.py`: `guard_filter_fn=torch.compiler.skip_all_guards_unsafe`). A
Python `if m <= 16` in the traced code would be evaluated once, at trace time, and the
branch taken then would run for every M. Inside a custom op the test runs eagerly on every
call (and, under CUDA graphs, at capture time for each captured batch size).

A custom op takes tensors and scalars, not modules, so layers are passed the way vLLM passes
attention and MoE layers to its ops: by a key into a process-global registry (here: the
layer's prefix, e.g. "model.layers.0.mlp.down_proj", which is stable across processes and
so also valid in a graph loaded from vLLM's compile cache). The key travels as a `LayerKey`,
an opaque value that torch.compile lifts to a graph input: a plain string would be a constant
of each layer's graph, so vLLM's piecewise compile would see 32-80 different graphs and
compile each, where with the key an input every layer's graph is the same one, compiled once.
The registry holds the layer weakly. In eager mode (nothing being traced) `LinearDispatch.apply`
runs the op's body directly: the op boundary only matters to a trace.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch._library.opaque_object import register_opaque_type
from torch._opaque_base import OpaqueBase

from vllm_mxplus.backends.base import Layer, LinearBackend, LinearSpec
from vllm_mxplus.backends.library import define_op
from vllm_mxplus.backends.selection import pick


class LayerKey(OpaqueBase):
    """A layer's key into this module's registry, passed to the op as a value-type opaque
    object that torch.compile hoists to a graph input instead of baking it into the graph as
    a constant (the way vLLM passes layer names to its attention and MoE ops on torch >=
    2.11): every layer's piecewise graph is then the same graph, compiled once for all."""

    def __init__(self, value: str):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayerKey) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __fx_repr__(self) -> tuple[str, dict[str, type]]:
        return f"LayerKey({self.value!r})", {"LayerKey": LayerKey}


register_opaque_type(LayerKey, typ="value", hoist=True)


class LinearDispatch:
    """The per-layer runtime: candidate backends (from `selection.select`), weights
    processed by each, the backend picked per call by the activation's row count M."""

    def __init__(self, spec: LinearSpec, candidates: list[LinearBackend]):
        if not candidates:
            raise ValueError("LinearDispatch needs at least one backend")
        for b in candidates:
            if b.spec != spec:
                raise ValueError(f"backend {b.name} was made for {b.spec}, not this layer's {spec}")
        self.spec = spec
        self.candidates = candidates
        self.key: LayerKey | None = None  # the layer's key in this module's registry

    def process_weights_after_loading(self, layer: Layer, qweight) -> None:
        for backend in self.candidates:
            backend.process_weights_after_loading(layer, qweight)
        if len(self.candidates) > 1 or self.candidates[0].branches_on_m:
            self.key = LayerKey(register_layer(layer, self))

    def pick(self, m: int) -> LinearBackend:
        backend = pick(self.candidates, m)
        assert isinstance(backend, LinearBackend)
        return backend

    def run(
        self,
        layer: Layer,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        act_global_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        """The candidate serving x's row count M applied: the op's body, run on every call."""
        return self.pick(x.numel() // max(x.shape[-1], 1)).apply(layer, x, bias, act_global_scale)

    def apply(
        self,
        layer: Layer,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        act_global_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # One candidate that does not branch on M: call it directly (no registry lookup, no op
        # boundary, and no read of x.shape that could put a shape guard into a compiled graph).
        if len(self.candidates) == 1 and not self.candidates[0].branches_on_m:
            return self.candidates[0].apply(layer, x, bias, act_global_scale)
        if self.key is None:
            raise RuntimeError("LinearDispatch.apply before process_weights_after_loading")
        if not torch.compiler.is_compiling():  # eager: the op's body without the op's boundary
            return self.run(layer, x, bias, act_global_scale)
        spec = self.spec
        return torch.ops.vllm_mxplus.linear_dispatch(
            x, bias, act_global_scale, spec.n, spec.out_dtype, self.key
        )


# key -> (weak reference to the layer, its dispatch)
_LAYERS: dict[str, tuple[weakref.ref, LinearDispatch]] = {}
_ANON = itertools.count()


def register_layer(layer: Layer, dispatch: LinearDispatch) -> str:
    """Make (layer, dispatch) reachable from the op; returns the key to pass to it.

    The key is the layer's vLLM prefix when it has one. A prefix already held by another live
    layer (two engines in one process) gets a numbered suffix; a dead layer's entry is
    replaced (engines built one after another)."""
    base = getattr(layer, "prefix", "") or f"mxplus_linear_{next(_ANON)}"
    key, n = base, 1
    while key in _LAYERS:
        ref, _ = _LAYERS[key]
        held = ref()
        if held is None or held is layer:
            break
        key, n = f"{base}#{n}", n + 1

    def forget(ref: weakref.ref, k: str = key) -> None:
        _forget(k, ref)

    _LAYERS[key] = (weakref.ref(layer, forget), dispatch)
    return key


def _forget(key: str, ref: weakref.ref) -> None:
    entry = _LAYERS.get(key)
    if entry is not None and entry[0] is ref:  # not a newer layer registered under the key
        del _LAYERS[key]


def lookup(key: str) -> tuple[torch.nn.Module, LinearDispatch]:
    """The (layer, dispatch) registered under key; a clear error when there is none."""
    entry = _LAYERS.get(key)
    layer = entry[0]() if entry is not None else None
    if entry is None or layer is None:
        raise RuntimeError(
            f"vllm_mxplus.linear_dispatch: no live quantized linear registered as {key!r} "
            f"(layers are registered by MxplusLinearMethod.process_weights_after_loading)"
        )
    return layer, entry[1]


def _linear_dispatch(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    act_global_scale: torch.Tensor | None,
    n: int,
    out_dtype: torch.dtype,
    key: LayerKey,
) -> torch.Tensor:
    """y = Q_act(x) W_hat^T + bias by the layer's first candidate backend serving M rows.

    n and out_dtype (the output's width and dtype) are the layer's, given so that the fake
    implementation needs no look-up of the key (a graph input, whose value a trace cannot
    read); layers of one shape pass the same values."""
    layer, dispatch = lookup(key.value)
    return dispatch.run(layer, x, bias, act_global_scale)


def _linear_dispatch_fake(x, bias, act_global_scale, n, out_dtype, key):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)


# registered directly (define_op): it runs once per quantized linear per step
linear_dispatch = define_op("linear_dispatch", _linear_dispatch, _linear_dispatch_fake)
