"""`kernel_tools.launch_trace`: which ops launch a kernel, the order of a traced call's
kernels (aten, custom ops and Triton launches interleaved), and which launches are hidden
(a programmatic dependent launch right after a triggering kernel) on sm_90 / sm_100, with
PDL off, and on sm_80."""

from __future__ import annotations

import pytest
import torch

from vllm_mxplus.backends.graph_guard import cuda_empty
from vllm_mxplus.kernel_tools.launch_trace import (
    TRIGGERING_OPS,
    Kernel,
    counted,
    launches_kernel,
    trace,
)

aten = torch.ops.aten


def test_views_allocations_and_prims_launch_nothing():
    for op in (aten.empty.memory_format, aten.empty_strided.default, aten.view.default,
               aten.slice.Tensor, aten.detach.default, aten.t.default):  # fmt: skip
        assert not launches_kernel(op), op
    for op in (aten.all.dim, aten.add.Tensor, aten._to_copy.default, aten.copy_.default,
               aten.nonzero_static.default):  # fmt: skip
        assert launches_kernel(op), op
    from vllm_mxplus.backends.triton import ops  # registers the custom ops

    assert ops.act_quant_op is not None
    assert launches_kernel(torch.ops.vllm_mxplus.triton_act_quant.default)


def _rows_call(m: int = 40, n: int = 24, k: int = 256):
    """(fn, make_args): a flags reduction in torch, then `mx_gemm_rows` (row list + GEMM)."""
    from vllm_mxplus.backends.triton.mx_gemm import mx_gemm_rows

    def make_args() -> tuple:
        u8 = torch.uint8
        op = lambda r: (cuda_empty((r, k // 2), u8), cuda_empty((r, k // 16), u8),  # noqa: E731
                        cuda_empty((r, k // 128), u8), None)  # fmt: skip
        return cuda_empty((m, n), torch.bfloat16), cuda_empty((m, 2), torch.bool), op(m), op(n)

    def fn(y, exact, x, w) -> None:  # noqa: ANN001
        flags = exact.all(dim=-1)
        mx_gemm_rows(y, flags, x, w, k, fmt="e8m0", block_size=16, macro_block=128, when=False)

    return fn, make_args


def test_trace_keeps_the_order_and_hides_dependent_launches():
    names = ["aten.all.dim", "triton:_list_rows_kernel", "triton:_mx_gemm_kernel"]
    for cap in (90, 100):
        ks = trace(*_rows_call(), capability=cap)
        assert [k.name for k in ks] == names
        # the list starts after a torch reduction (no trigger): its gap is paid; the GEMM's
        # programs start while the list runs
        assert [k.hidden for k in ks] == [False, False, True]
        assert ks[1].pdl and ks[1].trigger and ks[2].pdl
        assert counted(ks) == 2
    ks = trace(*_rows_call(), capability=80)  # no griddepcontrol before sm_90
    assert [k.name for k in ks] == names and not any(k.pdl or k.hidden for k in ks)
    assert counted(ks) == 3


def test_pdl_off_hides_nothing(monkeypatch):
    monkeypatch.setenv("VLLM_MXPLUS_GPU_PDL", "0")
    ks = trace(*_rows_call(), capability=90)
    assert counted(ks) == 3 and not any(k.pdl for k in ks)


def test_argument_building_is_not_traced():
    def make_args() -> tuple:
        x = cuda_empty((4, 8))
        return (x + 1,)  # an add while building: not the call's

    ks = trace(lambda x: x * 2, make_args, capability=90)
    assert ks == [Kernel("aten.mul.Tensor", pdl=False, trigger=False, hidden=False)]


@pytest.mark.parametrize("cap,trigger", [(80, False), (90, True), (100, True)])
def test_triggering_ops_trigger_in_their_code(cap, trigger):
    """TRIGGERING_OPS holds what the act-quant launcher does: its launch has TRIGGER on from
    sm_90 (`launch.pdl_launch`)."""
    from vllm_mxplus.backends.triton.act_quant import act_quant
    from vllm_mxplus.backends.triton.launch import capture_launches

    assert TRIGGERING_OPS == ("vllm_mxplus.triton_act_quant",)
    with capture_launches(cap) as launches:
        x = torch.empty((64, 256), dtype=torch.bfloat16, device="meta")
        act_quant(x, "mxfp4-mbs-s", macro_block=128)
    assert [lc.kwargs["TRIGGER"] for lc in launches] == [trigger]
