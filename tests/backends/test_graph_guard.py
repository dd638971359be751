"""CUDA-graph safety of the GPU backends' apply paths, checked on CPU.

How: the code runs on fake CUDA tensors (`vllm_mxplus.backends.graph_guard.fake_cuda`:
FakeTensorMode, shapes and dtypes on device "cuda", no data, on a CPU-only torch too) under
`CaptureGuard`, a TorchDispatchMode that sees every aten op and fails on anything a CUDA
graph cannot capture or that syncs the host:

- data-dependent ops (`nonzero`, `.item()`/`.tolist()` = `_local_scalar_dense`,
  `masked_select`, `unique`, boolean-mask indexing, ...): they wait for the GPU;
- any op output on the CPU (a CPU tensor built inside apply, e.g. by
  `torch.tensor([...], device="cuda")`, which builds on the host and copies), a copy between
  host and device, or an op mixing CPU and device inputs, except 0-dim wrapped Python
  numbers. (With meta tensors, the stand-in used before, `torch.tensor([...],
  device="meta")` dispatched no op at all, so a per-call host table went unseen.)

The leaf kernels (Triton, CUTLASS) are custom ops whose fake implementations run here; the
Python around them (the sm_90a fallback, the sm_100a operand preparation, the Triton
launchers' allocations and launch logic, recorded instead of launched) runs for real. The
negative controls at the end show that the guard does fail on the patterns it forbids.
"""

from __future__ import annotations

import types

import pytest
import torch
from repo_scripts import load_repo_script

from vllm_mxplus.backends.base import LinearSpec
from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
from vllm_mxplus.backends.cutlass.gemm import PreparedWeight
from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend
from vllm_mxplus.backends.graph_guard import GraphCaptureViolation as GraphSafetyViolation
from vllm_mxplus.backends.graph_guard import cuda_empty, fake_cuda, guarded
from vllm_mxplus.formats import get_scheme

DEVICE = "cuda"  # fake CUDA tensors (graph_guard.fake_cuda), on any machine
_count_prefill_ops = load_repo_script("benchmarks/count_prefill_ops.py")


@pytest.fixture(autouse=True)
def _fake_cuda():
    with fake_cuda():
        yield


def _checked(fn, *args):
    """Run fn(*args) under the capture guard, Triton launches recorded (not run); return
    (its output, the ops seen, then each Triton kernel launched as "triton.<its name>"; inside
    an enclosing `capture_launches` that one keeps the launches)."""
    from vllm_mxplus.backends.triton.launch import capture_launches, capturing

    if capturing():
        out, guard = guarded(fn, *args)
        return out, guard.ops
    with capture_launches() as launches:
        out, guard = guarded(fn, *args)
    return out, guard.ops + [f"triton.{lc.kernel.__name__}" for lc in launches]


def _e(shape, dtype=torch.float32):
    return cuda_empty(shape, dtype)


def _sm90_weight(n: int, k: int, with_fallback: bool) -> PreparedWeight:
    """The op-count benchmark's fake prepared sm_90a weight, 3 rows on the exact fallback or
    none."""
    return _count_prefill_ops.sm90_weight(n, k, 3 if with_fallback else 0)


SM90_CASES = [
    ("mxfp4-mbs-s", True, True),
    ("mxfp4-16-oas", False, False),
    ("mxfp4-mbs-s", False, True),
]


@pytest.mark.parametrize(
    "fmt,with_fallback,with_bias", SM90_CASES, ids=["mbs-fallbackw-bias", "oas-plain", "mbs-bias"]
)
@pytest.mark.parametrize("m", [1, 33, 100], ids=["M1", "M33", "M100"])
def test_sm90_prefill_from_codes_is_graph_safe(fmt, with_fallback, with_bias, m):
    k, n = 576, 40
    nc = -(-k // 128)
    if True:  # the tensors below live on DEVICE
        w = _sm90_weight(n, k, with_fallback)
        bias = _e((n,), torch.bfloat16) if with_bias else None
        x_mbs = _e((m, nc), torch.uint8) if "mbs" in fmt else None
        y, ops = _checked(
            cutlass_gemm.prefill_sm90_impl,
            _e((m, k // 2), torch.uint8),
            _e((m, k // 16), torch.uint8),
            x_mbs,
            k,
            *w.sm90_operands(),
            bias,
            n,
            torch.float16,
        )
    assert y.shape == (m, n) and y.dtype == torch.float16 and y.device.type == DEVICE
    assert "triton._list_rows_kernel" in ops  # the fallback ran (not skipped)


@pytest.mark.parametrize("fmt", ["mxfp4-mbs-s", "mxfp4-16-oas"])
@pytest.mark.parametrize("m", [1, 33, 100], ids=["M1", "M33", "M100"])
def test_sm90_fused_prefill_is_graph_safe(fmt, m):
    k, n = 576, 40
    nc = -(-k // 128)
    if True:  # the tensors below live on DEVICE
        w = _sm90_weight(n, k, True)
        y, ops = _checked(
            cutlass_gemm.prefill_sm90_fused_impl,
            _e((m, k), torch.bfloat16),
            fmt,
            _e((m, nc * 128), torch.float8_e4m3fn),
            _e((nc, m)),
            _e((m, nc), torch.int32),
            _e((m, nc), torch.uint8),
            _e((m, nc), torch.bool),
            _e((m, k // 2), torch.uint8),  # the encoder's packed codes and E8M0 scales
            _e((m, k // 16), torch.uint8),
            *w.sm90_operands(),
            _e((n,), torch.bfloat16),
            n,
            torch.bfloat16,
        )
    assert y.shape == (m, n) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("use_mbs", [True, False], ids=["mbs", "no-mbs"])
@pytest.mark.parametrize("m", [1, 33, 100], ids=["M1", "M33", "M100"])
def test_sm100_prefill_is_graph_safe(monkeypatch, use_mbs, m):
    """Without MBS on either operand (`mxfp4-16-oas`): no sigma tensor is built per call (the
    old code built a CPU tensor and copied it), and one full-K launch."""
    from vllm_mxplus.backends.cutlass import ops as cutlass_ops

    # the SF packer is a CUDA kernel of the extension: a fake stand-in of its output shape
    monkeypatch.setattr(
        cutlass_gemm,
        "pack_scales_sm100",
        lambda s, k, chunk=128: torch.empty(
            s.shape[0] * k // 16, dtype=torch.uint8, device=s.device
        ),
    )
    calls = []
    real = cutlass_ops.fp4_mbs_gemm
    monkeypatch.setattr(cutlass_gemm, "fp4_mbs_gemm", lambda *a: calls.append(a[7]) or real(*a))
    k, n = 576, 40
    kp, nc = 640, 5
    if True:  # the tensors below live on DEVICE
        x_mbs = _e((m, nc), torch.uint8) if use_mbs else None
        w_sigma = _e((nc, 40)) if use_mbs else _e((0,))
        y, _ = _checked(
            cutlass_gemm.prefill_sm100_impl,
            _e((m, k // 2), torch.uint8),
            _e((m, k // 16), torch.uint8),
            x_mbs,
            k,
            _e((40, kp // 2), torch.uint8),
            _e((40 * kp // 16,), torch.uint8),
            w_sigma,
            _e((n,), torch.float16),
            n,
            use_mbs,
            torch.float32,
        )
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert calls == [use_mbs]


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-16-oas"])
def test_cutlass_backend_apply_is_graph_safe(scheme):
    spec = LinearSpec(scheme=scheme, n=40, k=576, out_dtype=torch.bfloat16, device_type="cuda")
    if True:  # the tensors below live on DEVICE
        layer = types.SimpleNamespace()
        setattr(layer, CutlassPrefillBackend.WEIGHT_ATTR, _sm90_weight(40, 576, True))
        y, ops = _checked(
            CutlassPrefillBackend(spec).apply, layer, _e((2, 50, 576), torch.bfloat16), None
        )
    assert y.shape == (2, 50, 40)
    assert any("vllm_mxplus" in op for op in ops)  # went through the custom ops


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-ocp", "mxfp4-16-oas"])
@pytest.mark.parametrize("m", [1, 16], ids=["M1", "M16"])
def test_triton_decode_is_graph_safe(scheme, m):
    """The Triton launchers' host side (allocations, tile choice, split-K, the split-K sum)
    with the launches recorded instead of run."""
    from vllm_mxplus.backends.triton.act_quant import act_quant
    from vllm_mxplus.backends.triton.decode_gemm import decode_gemm
    from vllm_mxplus.backends.triton.launch import capture_launches
    from vllm_mxplus.formats import get_format, get_scheme

    s = get_scheme(scheme)
    wf, af = get_format(s.weight_format), get_format(s.activation_format)
    n, k = 4096, 576
    with capture_launches() as launches:
        x = _e((m, k), torch.bfloat16)
        (codes, scales, mbs, _), _ = _checked(
            lambda t: act_quant(t, s.activation_format, macro_block=128), x
        )
        w = (
            _e((n, k // 2), torch.uint8),
            _e((n, k // wf.block_size), torch.uint8),
            _e((n, 5), torch.uint8) if wf.mbs else None,
        )
        y, _ = _checked(
            lambda: decode_gemm(
                codes,
                scales,
                mbs,
                *w,
                k,
                _e((n,), torch.bfloat16),
                torch.bfloat16,
                block_size=wf.block_size,
                macro_block=128,
            )
        )
    names = [lc.kernel.fn.__name__ for lc in launches]
    split = launches[1].grid[1]  # the decode launch's K slices, summed in its own launch
    assert names[0].endswith("act_quant_kernel") and names[1] == "_decode_gemm_kernel", names
    assert y.shape == (m, n) and names[2:] == []
    assert launches[1].kwargs["REDUCE"] == (split > 1)
    assert (mbs is not None) == bool(af.mbs)


# ----------------------------------------------------------------------------- controls
def _old_sigma_chunks(mbs, rows, k):
    m = mbs if mbs is not None else torch.zeros((rows, 5), dtype=torch.uint8)  # CPU!
    return m


@pytest.mark.parametrize(
    "bad",
    [
        lambda x: x[x > 0],  # boolean mask: a sync
        lambda x: (x > 0).nonzero(),  # the old sm_90a fallback
        lambda x: x.sum().item(),  # .item()
        lambda x: x + torch.ones(x.shape[-1]),  # a CPU tensor into a CUDA op
        lambda x: _old_sigma_chunks(None, x.shape[0], 576),  # the old sm_100a sigma_chunks
        lambda x: x + torch.tensor([1.0, 2.0], device=x.device).sum(),  # a per-call literal
        lambda x: x * torch.tensor(0.5, device="cuda"),  # a 0-dim literal: still a copy
    ],
    ids=["mask", "nonzero", "item", "h2d", "cpu-alloc", "literal", "literal-0d"],
)
def test_guard_catches_unsafe_patterns(bad):
    with pytest.raises(GraphSafetyViolation):
        _checked(bad, _e((4, 8)))


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-ocp"])
def test_triton_backend_apply_is_graph_safe(scheme):
    """TritonDecodeBackend.apply end to end: the two custom ops (fakes here) and the glue."""
    from vllm_mxplus.backends.triton.linear import ATTRS, TritonDecodeBackend
    from vllm_mxplus.formats import get_format, get_scheme

    s = get_scheme(scheme)
    wf = get_format(s.weight_format)
    n, k = 256, 576
    spec = LinearSpec(scheme=scheme, n=n, k=k, out_dtype=torch.bfloat16, device_type="cuda")
    layer = types.SimpleNamespace(
        **dict(
            zip(
                ATTRS,
                (
                    _e((n, k // 2), torch.uint8),
                    _e((n, k // wf.block_size), torch.uint8),
                    _e((n, 5), torch.uint8) if wf.mbs else None,
                ),
            )
        )
    )
    y, ops = _checked(
        TritonDecodeBackend(spec).apply, layer, _e((3, k), torch.bfloat16), _e((n,), torch.bfloat16)
    )
    assert y.shape == (3, n)
    assert any("triton_decode_gemm" in op for op in ops)


@pytest.mark.parametrize("m", [3, 40], ids=["decode", "prefill"])
def test_triton_backends_at_macro_block_32_are_graph_safe(m):
    """Macro block 32 (MBS bytes per 32 of K): TritonDecodeBackend (M <= 16) and
    TritonGemmBackend (M > 16) apply without a host sync, CPU tensor or H2D copy."""
    from vllm_mxplus.backends.triton.linear import ATTRS, TritonDecodeBackend, TritonGemmBackend

    n, k = 256, 576
    spec = LinearSpec(
        scheme=get_scheme("mxfp4-mbs", 32), n=n, k=k, out_dtype=torch.bfloat16, device_type="cuda"
    )
    layer = types.SimpleNamespace(
        **dict(
            zip(
                ATTRS,
                (
                    _e((n, k // 2), torch.uint8),
                    _e((n, k // 16), torch.uint8),
                    _e((n, k // 32), torch.uint8),
                ),
            )
        )
    )
    cls = TritonDecodeBackend if m <= 16 else TritonGemmBackend
    assert cls.supports_m(m)
    y, ops = _checked(cls(spec).apply, layer, _e((m, k), torch.bfloat16), _e((n,), torch.bfloat16))
    assert y.shape == (m, n)
    assert any(op.startswith("vllm_mxplus.triton_") and "gemm" in op for op in ops)
