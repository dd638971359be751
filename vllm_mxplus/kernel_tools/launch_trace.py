"""The device kernels one call of a GPU code path launches, in order, traced on CPU.

The code runs for real on fake CUDA tensors (`graph_guard.fake_cuda`: shapes, no data), its
Triton launches recorded instead of run (`launch.capture_launches`, with the tile choices of
the capability asked for), and every aten or custom op that launches a kernel noted in the
same sequence by a dispatch mode: views, allocations and metadata ops launch none. So the
launch count of a pipeline (`benchmarks/gpu_static_model.py`) comes from its code, glue
ops included, not from a hand count.

A kernel is *hidden* when it is a programmatic dependent launch (its `PDL` constexpr) right
after a kernel that lets its dependents start (a Triton launch with `TRIGGER`, or a custom op
of TRIGGERING_OPS, whose own launch triggers where `launch.pdl_launch` says): its programs
are resident, waiting, before the kernel before it ends, so no launch gap is paid for it
(an assumption of the static model, which `scripts/gpu_check.sh` can measure).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# custom ops whose single Triton launch calls launch_dependents where `launch.pdl_launch`
# holds (`act_quant`: TRIGGER=pdl_launch(device))
TRIGGERING_OPS = ("vllm_mxplus.triton_act_quant",)
# aten ops that allocate without a kernel (an empty tensor's memory is not written)
ALLOCATING = ("empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like")


@dataclass(frozen=True)
class Kernel:
    name: str  # "triton:<kernel>" or the op's name ("aten.all.dim", "vllm_mxplus.<op>")
    pdl: bool  # a programmatic dependent launch
    trigger: bool  # lets the launch after it start early
    hidden: bool = False  # counted without a launch gap (module docstring)


def _op_name(func: Any) -> str:
    return f"{func.namespace}.{func._schema.name.split('::')[-1]}.{func._overloadname}"


def launches_kernel(func: Any) -> bool:
    """Whether an aten / custom op launches a device kernel: not a view (its outputs alias
    its inputs, unwritten), an allocation, or a prim / metadata op."""
    if func.namespace == "prim":
        return False
    if func.namespace == "aten":
        base = func._schema.name.split("::")[-1]
        if base in ALLOCATING or base in ("lift_fresh", "_local_scalar_dense"):
            return False
        if any(r.alias_info is not None and not r.alias_info.is_write
               for r in func._schema.returns):  # fmt: skip
            return False  # a view (slice, view, detach, ...); in-place ops write theirs
    return True


class _Sequence(TorchDispatchMode):
    """Appends each kernel-launching op to `seq` (the list Triton launches are recorded in)."""

    def __init__(self, seq: list, trigger_ops: bool) -> None:
        super().__init__()
        self.seq = seq
        self.trigger_ops = trigger_ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if launches_kernel(func):
            name = _op_name(func)
            trig = self.trigger_ops and name.rsplit(".", 1)[0] in TRIGGERING_OPS
            self.seq.append(Kernel(name, pdl=False, trigger=trig))
        return func(*args, **(kwargs or {}))


def trace(fn: Callable[..., Any], make_args: Callable[[], tuple], capability: int = 90
          ) -> list[Kernel]:  # fmt: skip
    """The kernels fn(*make_args()) launches on sm_<capability>, in order, each marked hidden
    or not (module docstring). Both run inside `fake_cuda()`: make_args builds fn's CUDA
    tensors there (`graph_guard.cuda_empty`), untraced; fn's launches are traced."""
    from vllm_mxplus.backends.graph_guard import fake_cuda
    from vllm_mxplus.backends.triton.launch import capture_launches, pdl_launch

    with fake_cuda(), capture_launches(capability) as seq:
        args = make_args()
        start = len(seq)  # what building the arguments launched is not fn's
        trigger_ops = pdl_launch(torch.device("cuda"))
        with _Sequence(seq, trigger_ops):
            fn(*args)
    out: list[Kernel] = []
    for item in seq[start:]:
        k = item if isinstance(item, Kernel) else _triton_kernel(item)
        hidden = k.pdl and bool(out) and out[-1].trigger
        out.append(Kernel(k.name, k.pdl, k.trigger, hidden))
    return out


def _triton_kernel(launch: Any) -> Kernel:
    """A recorded Triton launch (`launch.Launch`) as a Kernel."""
    kw = launch.kwargs
    return Kernel(f"triton:{launch.kernel.__name__}", bool(kw.get("PDL")), bool(kw.get("TRIGGER")))


def counted(kernels: list[Kernel]) -> int:
    """The launches a gap is paid for: those not hidden."""
    return sum(not k.hidden for k in kernels)
