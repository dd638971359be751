"""`library.define_op`: an op registered to the dispatcher directly (no `custom_op` wrapper)
computes its Python body on a real tensor, its fake on FakeTensors and meta tensors, and
traces into a torch.compile graph as one call; and `linear_dispatch` is such an op."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from vllm_mxplus.backends.library import OP_NAMESPACE, define_op

_NAMES = itertools.count()


def _define(body, fake):  # noqa: ANN001, ANN202
    return define_op(f"test_define_op_{next(_NAMES)}", body, fake)


def _scale_rows(x: torch.Tensor, s: torch.Tensor | None, n: int) -> torch.Tensor:
    y = x[..., :n] * 3.0
    return y if s is None else y * s


def _scale_rows_fake(x, s, n):  # noqa: ANN001, ANN202
    return x.new_empty((*x.shape[:-1], n))


def test_body_runs_on_real_tensors():
    op = _define(_scale_rows, _scale_rows_fake)
    x = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(op(x, None, 2), x[:, :2] * 3.0)
    s = torch.tensor([[2.0], [0.5], [-1.0]])
    assert torch.equal(op(x, s, 3), x[:, :3] * 3.0 * s)
    assert op.default._schema.name == f"{OP_NAMESPACE}::{op._qualified_op_name.split('::')[1]}"
    assert not any(a.is_write for a in op.default._schema.arguments if a.alias_info)


def test_fake_gives_shape_without_running_the_body():
    calls = []

    def body(x: torch.Tensor, n: int) -> torch.Tensor:
        calls.append(n)
        return x[..., :n].clone()

    def fake(x, n):  # noqa: ANN001, ANN202
        return x.new_empty((*x.shape[:-1], n))

    op = _define(body, fake)
    with FakeTensorMode() as mode:
        y = op(mode.from_tensor(torch.zeros(5, 8)), 3)
    assert y.shape == (5, 3)
    assert calls == []


def test_meta_tensors_take_the_fake():
    def body(x: torch.Tensor, n: int) -> torch.Tensor:
        raise AssertionError("the body ran on meta tensors")

    def fake(x, n):  # noqa: ANN001, ANN202
        return x.new_empty((*x.shape[:-1], n))

    op = _define(body, fake)
    y = op(torch.empty(3, 4, device="meta"), 5)
    assert y.shape == (3, 5) and y.device.type == "meta"


def test_traced_as_one_call_and_equal_to_eager():
    op = _define(_scale_rows, _scale_rows_fake)
    graphs = []

    def backend(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return gm.forward

    def f(x: torch.Tensor) -> torch.Tensor:
        return op(x + 1.0, None, 2).sum(-1)

    compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
    for m in (3, 7):
        x = torch.randn(m, 4)
        assert torch.equal(compiled(x), f(x))
    targets = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum(1 for t in targets if "test_define_op" in str(t)) == len(graphs) >= 1


def test_a_name_defined_twice_is_refused():
    name = f"test_define_op_{next(_NAMES)}"
    define_op(name, _scale_rows, _scale_rows_fake)
    with pytest.raises(RuntimeError, match="already|multiple|registered"):
        define_op(name, _scale_rows, _scale_rows_fake)


def test_linear_dispatch_is_registered_directly():
    import vllm_mxplus.backends.linear_op as linear_op

    # a custom_op would be a CustomOpDef wrapping the op; define_op returns the op itself
    assert isinstance(linear_op.linear_dispatch, torch._ops.OpOverloadPacket)
    assert linear_op.linear_dispatch is torch.ops.vllm_mxplus.linear_dispatch
