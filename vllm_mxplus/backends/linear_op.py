"""`torch.ops.vllm_mxplus.linear_dispatch`: the per-call choice of backend by row count M,
inside one registered custom op, so compiled graphs and CUDA graphs see one opaque call.

vLLM compiles a model once with a dynamic token dimension and drops Dynamo's guards
(`vllm/compilation/wrapper.py`: `guard_filter_fn=torch.compiler.skip_all_guards_unsafe`). A
Python `if m <= 16` in the traced code would be evaluated once, at trace time, and the
branch taken then would run for every M. Inside a custom op the test runs eagerly on every
call (and, under CUDA graphs, at capture time for each captured batch size).

A custom op takes tensors and scalars, not modules, so layers are passed the way vLLM passes
attention layers to its ops: by a string key into a process-global registry (here: the
layer's prefix, e.g. "model.layers.0.mlp.down_proj", which is stable across processes and
so also valid in a graph loaded from vLLM's compile cache). The registry holds the layer
weakly; the fake implementation reads the output width and dtype from it.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING

import torch

from vllm_mxplus.backends.library import op_name

if TYPE_CHECKING:
    from vllm_mxplus.backends.selection import LinearDispatch

# key -> (weak reference to the layer, its dispatch)
_LAYERS: dict[str, tuple[weakref.ref, LinearDispatch]] = {}
_ANON = itertools.count()


def register_layer(layer: torch.nn.Module, dispatch: LinearDispatch) -> str:
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
    _LAYERS[key] = (weakref.ref(layer, lambda _r, k=key: _forget(k, _r)), dispatch)
    return key


def _forget(key: str, ref: weakref.ref) -> None:
    entry = _LAYERS.get(key)
    if entry is not None and entry[0] is ref:  # not a newer layer registered under the key
        del _LAYERS[key]


def lookup(key: str) -> tuple[torch.nn.Module, LinearDispatch]:
    """The (layer, dispatch) registered under key; a clear error when there is none."""
    entry = _LAYERS.get(key)
    layer = entry[0]() if entry is not None else None
    if layer is None:
        raise RuntimeError(
            f"vllm_mxplus.linear_dispatch: no live quantized linear registered as {key!r} "
            f"(layers are registered by MxplusLinearMethod.process_weights_after_loading)"
        )
    return layer, entry[1]


@torch.library.custom_op(op_name("linear_dispatch"), mutates_args=())
def linear_dispatch(
    x: torch.Tensor,
    bias: torch.Tensor | None,
    act_global_scale: torch.Tensor | None,
    key: str,
) -> torch.Tensor:
    """y = Q_act(x) W_hat^T + bias by the layer's first candidate backend serving M rows."""
    layer, dispatch = lookup(key)
    backend = dispatch.pick(x.numel() // max(x.shape[-1], 1))
    return backend.apply(layer, x, bias, act_global_scale)


@linear_dispatch.register_fake
def _(
    x: torch.Tensor, bias: torch.Tensor | None, act_global_scale: torch.Tensor | None, key: str
) -> torch.Tensor:
    spec = lookup(key)[1].spec
    return x.new_empty((*x.shape[:-1], spec.n), dtype=spec.out_dtype)
