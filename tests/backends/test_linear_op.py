"""The M choice inside `vllm_mxplus::linear_dispatch`, under torch.compile as vLLM runs it.

vLLM 0.32 (`vllm/compilation/wrapper.py`, `decorators.py`) marks the token dimension dynamic
(`torch._dynamo.mark_dynamic`) and compiles once with `fullgraph=True, dynamic=False` and
`guard_filter_fn=torch.compiler.skip_all_guards_unsafe`: no guard is ever checked, so a graph
traced at one M runs for every M. `compile_like_vllm` does the same.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from vllm_mxplus.backends import linear_op
from vllm_mxplus.backends.base import LinearBackend, LinearSpec
from vllm_mxplus.backends.linear_op import LinearDispatch
from vllm_mxplus.formats import quantize

SPEC = LinearSpec(scheme="mxfp4-mbs", n=24, k=64, out_dtype=torch.float32)
DECODE, PREFILL = 1.0, 2.0  # what each fake backend writes


class _Marker(LinearBackend):
    """Writes its marker, so the output says which backend ran (and records the call)."""

    marker = 0.0
    calls: list[int] = []

    @classmethod
    def is_supported(cls, platform: str, capability: int | None):
        return True, ""

    def process_weights_after_loading(self, layer, qweight):

        pass

    def apply(self, layer, x, bias, act_global_scale=None):

        spec = self.spec
        type(self).calls.append(x.shape[0])
        return torch.full((*x.shape[:-1], spec.n), self.marker, dtype=spec.out_dtype)


class _Decode(_Marker):
    name, marker, min_m, max_m = "fake-decode", DECODE, 1, 16


class _Prefill(_Marker):
    name, marker, min_m, max_m = "fake-prefill", PREFILL, 17, None


def compile_like_vllm(fn, backend="aot_eager"):
    counter = CompileCounterWithBackend(backend)
    opts = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=counter, options=opts), counter


def _layer(candidates, prefix: str = "", spec=SPEC) -> tuple[torch.nn.Module, LinearDispatch]:
    layer = torch.nn.Module()
    if prefix:
        layer.prefix = prefix
    d = LinearDispatch(spec, candidates)
    d.process_weights_after_loading(layer, quantize(torch.randn(spec.n, spec.k), "mxfp4-mbs-d"))
    return layer, d


def _dispatch_calls(gm: torch.fx.GraphModule) -> int:
    """How many linear_dispatch calls a Dynamo graph holds (packet or overload)."""
    return sum(
        1
        for n in gm.graph.nodes
        if n.op == "call_function" and "vllm_mxplus.linear_dispatch" in str(n.target)
    )


def _marked(m: int) -> torch.Tensor:
    x = torch.randn(m, SPEC.k)
    torch._dynamo.mark_dynamic(x, 0)
    return x


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_python_branch_is_frozen_by_this_compile_setup():
    """The set-up is the one that breaks a Python M test: traced at 100, run at 1, the
    prefill branch still runs. (What the custom op must prevent.)"""

    def python_pick(x):
        return x * PREFILL if x.shape[0] > 16 else x * DECODE

    fn, counter = compile_like_vllm(python_pick)
    fn(_marked(100))
    x1 = _marked(1)
    assert torch.equal(fn(x1), x1 * PREFILL)
    assert counter.frame_count == 1


@pytest.mark.parametrize(
    "first,then",
    [(100, 1), (1, 100), (16, 17), (17, 16)],
    ids=["trace100-run1", "trace1-run100", "trace16-run17", "trace17-run16"],
)
def test_compiled_dispatch_picks_by_m_on_every_call(first, then):
    layer, d = _layer([_Decode(SPEC), _Prefill(SPEC)], prefix="model.layers.0.mlp.down_proj")
    fn, counter = compile_like_vllm(lambda x: d.apply(layer, x, None))
    for m in (first, then, first):
        y = fn(_marked(m))
        assert y.shape == (m, SPEC.n)
        assert (y == (DECODE if m <= 16 else PREFILL)).all(), m
    assert counter.frame_count == 1  # one graph, no recompilation, no graph break


def test_one_op_in_the_graph_and_fake_gives_shape_and_dtype():
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    spec16 = LinearSpec(scheme="mxfp4-mbs", n=24, k=64, out_dtype=torch.bfloat16)
    layer, d = _layer([_Decode(spec16), _Prefill(spec16)], spec=spec16)
    fn = torch.compile(
        lambda x: d.apply(layer, x, None) + 1,
        fullgraph=True,
        backend=grab,
        options={"guard_filter_fn": torch.compiler.skip_all_guards_unsafe},
    )
    y = fn(_marked(5))
    assert y.dtype == torch.bfloat16 and y.shape == (5, 24)
    assert _dispatch_calls(graphs[0]) == 1


def test_single_candidate_is_called_directly():
    """One candidate: no registry entry and no op in the graph (the cheap path)."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    class _Any(_Marker):
        name, marker = "fake-any", 3.0

    layer, d = _layer([_Any(SPEC)])
    assert d.key is None
    fn = torch.compile(lambda x: d.apply(layer, x, None), fullgraph=True, backend=grab)
    assert (fn(_marked(7)) == 3.0).all()
    assert _dispatch_calls(graphs[0]) == 0


class _Branching(_Marker):
    """One backend that picks its own kernels by M (as cpu-packed with its exact-bf16 path)."""

    name = "fake-branching"

    @property
    def branches_on_m(self) -> bool:
        return True

    def apply(self, layer, x, bias, act_global_scale=None):
        type(self).calls.append(x.shape[0])
        marker = PREFILL if x.shape[0] >= 32 else DECODE
        return torch.full((*x.shape[:-1], self.spec.n), marker, dtype=self.spec.out_dtype)


@pytest.mark.parametrize("first,then", [(100, 1), (1, 100)], ids=["trace100-run1", "trace1-run100"])
def test_a_single_candidate_that_branches_on_m_runs_inside_the_op(first, then):
    """Its M test must run on every call: the dispatch registers it and calls the op, so a
    graph traced at one M runs the other branch at the other M."""
    layer, d = _layer([_Branching(SPEC)], prefix="model.layers.0.self_attn.o_proj")
    assert d.key is not None
    fn, counter = compile_like_vllm(lambda x: d.apply(layer, x, None))
    for m in (first, then):
        assert (fn(_marked(m)) == (PREFILL if m >= 32 else DECODE)).all(), m
    assert counter.frame_count == 1


def test_inductor_like_vllm():
    """The same with inductor, vLLM's backend on CPU (slower: compiles C++)."""
    layer, d = _layer([_Decode(SPEC), _Prefill(SPEC)])
    fn, counter = compile_like_vllm(lambda x: d.apply(layer, x, None) * 2, backend="inductor")
    assert (fn(_marked(100)) == 2 * PREFILL).all()
    assert (fn(_marked(1)) == 2 * DECODE).all()
    assert counter.frame_count == 1


def test_registry_keys():
    a, da = _layer([_Decode(SPEC), _Prefill(SPEC)], prefix="model.layers.3.qkv_proj")
    b, db = _layer([_Decode(SPEC), _Prefill(SPEC)], prefix="model.layers.3.qkv_proj")
    assert da.key is not None and db.key is not None
    assert da.key.value == "model.layers.3.qkv_proj" and db.key != da.key  # both alive
    assert linear_op.lookup(da.key.value)[0] is a and linear_op.lookup(db.key.value)[0] is b
    del a, da
    gc.collect()
    c, dc = _layer([_Decode(SPEC), _Prefill(SPEC)], prefix="model.layers.3.qkv_proj")
    assert dc.key is not None and dc.key.value == "model.layers.3.qkv_proj"  # reused
    assert linear_op.lookup(dc.key.value)[0] is c


def test_unknown_key_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no live quantized linear registered as 'nope'"):
        torch.ops.vllm_mxplus.linear_dispatch(
            torch.randn(2, 4), None, None, 3, torch.float32, linear_op.LayerKey("nope")
        )


def test_apply_before_weights_are_processed_fails_loudly():
    d = LinearDispatch(SPEC, [_Decode(SPEC), _Prefill(SPEC)])
    with pytest.raises(RuntimeError, match="before process_weights_after_loading"):
        d.apply(torch.nn.Module(), torch.randn(2, SPEC.k), None)


def test_a_backend_made_for_another_layer_is_refused():
    other = LinearSpec(scheme="mxfp4-mbs", n=48, k=64, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="fake-prefill was made for"):
        LinearDispatch(SPEC, [_Decode(SPEC), _Prefill(other)])


class _Stack(torch.nn.Module):
    """Four same-shaped layers, each a quantized linear (two candidates: the dispatch op) or
    a plain fp32 linear, then an elementwise op: vLLM's model in miniature."""

    def __init__(self, quantized: bool):
        super().__init__()
        square = LinearSpec(scheme="mxfp4-mbs", n=64, k=64, out_dtype=torch.float32)
        self.quantized = quantized
        self.layers = torch.nn.ModuleList()
        for i in range(4):
            if quantized:
                layer, d = _layer(
                    [_Decode(square), _Prefill(square)], f"model.layers.{i}.mlp", square
                )
                layer.mxplus_dispatch = d
            else:
                layer = torch.nn.Linear(64, 64, bias=False)
            self.layers.append(layer)

    def forward(self, x):
        for layer in self.layers:
            y = layer.mxplus_dispatch.apply(layer, x, None) if self.quantized else layer(x)
            x = torch.relu(y)
        return x


def _per_layer_graphs(model: torch.nn.Module) -> list[tuple]:
    """Trace the model once (as vLLM does), split the graph into one piece per layer (as
    vLLM's piecewise compile splits at attention), and return each piece in a form that
    compares equal exactly when the pieces are the same graph: op, target and arguments
    with nodes by position (vLLM compiles each distinct piece once)."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(model, fullgraph=True, backend=grab)(_marked(5))
    (gm,) = graphs
    pieces: list[list] = [[]]
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        pieces[-1].append(node)
        if node.op == "call_function" and node.target is torch.relu:
            pieces.append([])

    def form(nodes: list) -> tuple:
        index = {n: i for i, n in enumerate(nodes)}

        def arg(a):
            if isinstance(a, torch.fx.Node):
                return ("node", index.get(a, "input"))
            if isinstance(a, (list, tuple)):
                return tuple(arg(b) for b in a)
            return a

        return tuple((n.op, str(n.target), arg(n.args), arg(n.kwargs)) for n in nodes)

    return [form(p) for p in pieces if p]


@pytest.mark.parametrize("quantized", [False, True], ids=["unquantized", "quantized"])
def test_every_layer_is_the_same_graph(quantized):
    """One compile for all layers: no per-layer Python value (the layer's key) is a constant
    of the graph, so the four layers' pieces are one graph, as for the unquantized model."""
    pieces = _per_layer_graphs(_Stack(quantized))
    assert len(pieces) == 4
    assert len(set(pieces)) == 1, "the layers' pieces differ: one compile per layer"


def test_a_string_key_would_make_one_graph_per_layer():
    """The check above can fail: with the key as a plain string constant (how it was passed
    before), the four pieces differ."""
    model = _Stack(True)
    for layer in model.layers:
        d = layer.mxplus_dispatch

        d.apply = lambda layer, x, bias, n=d.spec.n, key=d.key.value: _string_key_call(x, n, key)
    pieces = _per_layer_graphs(model)
    assert len(set(pieces)) == 4


@torch.library.custom_op("mxplus_test::dispatch_by_string", mutates_args=())
def _by_string(x: torch.Tensor, n: int, key: str) -> torch.Tensor:
    """The dispatch op as it took the layer's key before: a string argument."""
    return x.new_zeros((*x.shape[:-1], n))


@_by_string.register_fake
def _(x, n, key):
    return x.new_empty((*x.shape[:-1], n))


def _string_key_call(x, n, key):
    return torch.ops.mxplus_test.dispatch_by_string(x, n, key)
