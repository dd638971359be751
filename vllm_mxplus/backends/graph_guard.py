"""Check on a machine without a GPU that code would be capturable in a CUDA graph.

`fake_cuda()` enters torch's `FakeTensorMode`: tensors created with device="cuda" inside it
are fake CUDA tensors (shape, dtype, device "cuda:0", no data), even on a CPU-only build
of torch. `CaptureGuard` is a `TorchDispatchMode` that sees every aten op run on them and
fails (`GraphCaptureViolation`) on what a CUDA graph rejects or what would wait for the GPU:

- a host sync: `_local_scalar_dense` (`.item()`, `bool(t)`, `int(t)`, `if t:`), `nonzero`,
  `masked_select`, `unique`, boolean-mask indexing, `equal`/`allclose`, `_assert_async`;
- an output whose shape depends on the data (FakeTensorMode's data-dependent exceptions);
- a tensor crossing between host and device: `torch.tensor([...], device="cuda")` (built on
  the host, then copied: `_to_copy` cpu -> cuda), `.cpu()`, `copy_` between cpu and cuda, or
  any op mixing a CPU tensor (not a 0-dim wrapped Python number) with CUDA tensors;
- a CPU tensor allocated while the guarded code runs (a constant rebuilt per call).

Custom ops dispatch to their fake implementations, so a backend's `apply` runs end to end:
the Python around the kernels for real, the kernels as shapes. `ops` records every op seen,
`count()` their number (the per-call op counts of benchmarks/count_prefill_ops.py).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

HOST_SYNC_OPS = frozenset(
    {
        aten.nonzero.default,
        aten.nonzero_numpy.default,
        aten.argwhere.default,
        aten._local_scalar_dense.default,
        aten.masked_select.default,
        aten.is_nonzero.default,
        aten.equal.default,
        aten.allclose.default,
        aten._unique2.default,
        aten.unique_dim.default,
        aten.unique_consecutive.default,
        aten.repeat_interleave.Tensor,
        aten._assert_async.default,
        aten._assert_async.msg,
    }
)
MASK_INDEX_OPS = frozenset(
    {
        aten.index.Tensor,
        aten.index_put_.default,
        aten.index_put.default,
        aten._index_put_impl_.default,
    }
)
COPY_OPS = frozenset({aten._to_copy.default, aten.copy_.default, aten.copy.default})


class GraphCaptureViolation(AssertionError):
    """What the guarded code did that a CUDA graph cannot capture (or that syncs the host)."""


def _devices(tree: Any) -> set[str]:
    return {t.device.type for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


class CaptureGuard(TorchDispatchMode):
    """Fails on host syncs, data-dependent shapes and host <-> device traffic; records ops."""

    def __init__(self, device_type: str = "cuda", strict: bool = True) -> None:
        super().__init__()
        self.device_type = device_type
        self.strict = strict  # False: record violations in `violations` and go on
        self.ops: list[str] = []
        self.violations: list[str] = []

    def _violation(self, what: str) -> None:
        if self.strict:
            raise GraphCaptureViolation(what)
        self.violations.append(what)

    def count(self, prefix: str = "aten.") -> int:
        """Ops seen whose name starts with prefix ("aten." by default)."""
        return sum(1 for op in self.ops if op.startswith(prefix))

    def histogram(self) -> Counter:
        return Counter(self.ops)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        self.ops.append(name)
        if func in HOST_SYNC_OPS:
            self._violation(f"host sync: {name}")
        if (
            func in MASK_INDEX_OPS
            and len(args) > 1
            and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                for i in (args[1] or ())
            )
        ):
            self._violation(f"boolean-mask indexing (a nonzero inside): {name}")
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        dev = self.device_type
        on_dev = any(t.device.type == dev for t in tensors)
        on_cpu = any(t.device.type == "cpu" and t.dim() > 0 for t in tensors)
        if on_dev and on_cpu:
            self._violation(f"a CPU tensor meets a {dev} tensor (host copy): {name}")
        if func in COPY_OPS:
            target = kwargs.get("device")
            src = _devices(args[:1])
            if target is not None and torch.device(target).type != next(iter(src), dev):
                self._violation(f"{name}: copy {src} -> {torch.device(target).type}")
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise GraphCaptureViolation(f"data-dependent output: {name} ({e})") from e
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self._violation(
                    f"CPU tensor built inside the guarded code: {name} -> {tuple(t.shape)}"
                )
        return out


def _basic_index(t: torch.Tensor, index: Any) -> tuple[torch.Tensor, list]:
    """Apply the basic part of a Python index (ints, slices, None, Ellipsis) with aten view
    ops; returns (the view, per-dim tensor indices or None for the advanced part)."""
    idx = index if isinstance(index, tuple) else (index,)
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    out, dim = t, 0
    adv: list[torch.Tensor | None] = []
    for i in idx:
        if i is Ellipsis:
            skip = t.dim() - n_real
            adv += [None] * skip
            dim += skip
        elif i is None:
            out = aten.unsqueeze.default(out, dim)
            adv.append(None)
            dim += 1
        elif isinstance(i, bool) or (isinstance(i, torch.Tensor) and i.dtype == torch.bool):
            adv.append(torch.as_tensor(i) if isinstance(i, bool) else i)
            dim += 1
        elif isinstance(i, (int, torch.SymInt)):
            out = aten.select.int(out, dim, i)
        elif isinstance(i, slice):
            start = 0 if i.start is None else i.start
            stop = torch.iinfo(torch.int64).max if i.stop is None else i.stop
            out = aten.slice.Tensor(out, dim, start, stop, 1 if i.step is None else i.step)
            adv.append(None)
            dim += 1
        elif isinstance(i, torch.Tensor):
            adv.append(i)
            dim += 1
        else:  # a list of ints: a host tensor index
            adv.append(torch.as_tensor(i, device=t.device))
            dim += 1
    return out, adv


def _getitem(t: torch.Tensor, index: Any) -> torch.Tensor:
    out, adv = _basic_index(t, index)
    if any(a is not None for a in adv):
        out = aten.index.Tensor(out, adv)
    return out


def _setitem(t: torch.Tensor, index: Any, value: Any) -> None:
    out, adv = _basic_index(t, index)
    if any(a is not None for a in adv):
        if not isinstance(value, torch.Tensor):
            value = torch.full((), value, dtype=t.dtype, device=t.device)
        aten.index_put_.default(out, adv, value)
    elif isinstance(value, torch.Tensor):
        aten.copy_.default(out, value)
    else:
        aten.fill_.Scalar(out, value)


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """FakeTensorMode in which device="cuda" makes fake CUDA tensors (no GPU needed), under
    no_grad (as vLLM runs its linears).

    On a CPU-only torch, some Python bindings of Tensor take a CUDA device guard before
    dispatch and raise "not linked with support for cuda devices": `~t`, `t[i]`,
    `t[i] = v`, `t.contiguous()`, `t.copy_(s)`, `t.nonzero()`, `t.new_tensor(data)`. Inside this context
    they are the aten ops the real ones dispatch, called from Python (`bitwise_not`;
    select / slice / unsqueeze / index / index_put_ / copy_ / fill_ as torch's indexing;
    clone; copy_; `torch.tensor`), so the guard sees the same ops."""
    patches = {
        "__invert__": lambda t: torch.bitwise_not(t),
        "__getitem__": _getitem,
        "__setitem__": _setitem,
        "contiguous": _contiguous,
        "copy_": lambda t, src, non_blocking=False: aten.copy_.default(t, src, non_blocking),
        "nonzero": lambda t, *, as_tuple=False: (
            aten.nonzero.default(t).unbind(1) if as_tuple else aten.nonzero.default(t)
        ),
        "new_tensor": lambda t, data, dtype=None, device=None, **_: torch.tensor(
            data, dtype=dtype or t.dtype, device=device or t.device
        ),
    }
    saved = {name: getattr(torch.Tensor, name) for name in patches}
    for name, fn in patches.items():
        setattr(torch.Tensor, name, fn)
    try:
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=False) as mode:
            yield mode
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _contiguous(t: torch.Tensor, memory_format=torch.contiguous_format) -> torch.Tensor:
    if t.is_contiguous(memory_format=memory_format):
        return t
    return aten.clone.default(t, memory_format=memory_format)


def guarded(
    fn: Callable[..., Any], *args: Any, strict: bool = True, **kwargs: Any
) -> tuple[Any, CaptureGuard]:
    """fn(*args, **kwargs) under a CaptureGuard (inside an already entered `fake_cuda()`);
    returns (its output, the guard). Raises GraphCaptureViolation on a violation (strict;
    else they are in guard.violations), and AssertionError when the guard saw no op at all
    (the check would prove nothing)."""
    guard = CaptureGuard(strict=strict)
    with guard:
        out = fn(*args, **kwargs)
    if not guard.ops:
        raise AssertionError("the guard saw no op: the check would be vacuous")
    return out, guard


def cuda_empty(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fake CUDA tensor of shape / dtype (call inside `fake_cuda()`)."""
    return torch.empty(shape, dtype=dtype, device="cuda")


def capture_graph(fn: Callable[[torch.Tensor], Any], x: torch.Tensor) -> tuple[Any, Any]:
    """(torch.cuda.CUDAGraph, its output) of fn(x), captured after an eager warm-up on a side
    stream, on that stream, as vLLM warms up and captures on its own stream (real CUDA
    device only): what a kernel sets up per stream at its first eager call (the split-K
    counters, `gemm_launch.split_counters`) is there for the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = fn(x)
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def cuda_graph_replay_mismatch(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, fresh: torch.Tensor
) -> str | None:
    """On a real CUDA device: fn(x) captured in a CUDA graph (after an eager warm-up on a
    side stream, as vLLM does), x refilled with `fresh`, the graph replayed; None when the
    replayed output equals eager fn(fresh) bit for bit, else what differed (a capture that
    raises is reported too). Not CUDA: None (nothing to capture; the fake-CUDA guard above
    is the CPU-side check). For the self-test of the chosen backend at an M above 16."""
    if x.device.type != "cuda":
        return None
    try:
        graph, out = capture_graph(fn, x)
        x.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        got, want = out.clone(), fn(fresh)
    except Exception as e:  # a capture error is a failure of the backend on this device
        return f"CUDA-graph capture / replay raised {type(e).__name__}: {e}"
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    if got.shape == want.shape and torch.equal(got.view(view), want.view(view)):
        return None
    differ = int((got.view(view) != want.view(view)).sum()) if got.shape == want.shape else -1
    return f"CUDA-graph replay differs from eager ({differ} elements, shape {tuple(got.shape)})"
