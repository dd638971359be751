"""Every CUDA backend's apply, run on fake CUDA tensors under the capture guard, at the token
counts vLLM captures CUDA graphs for: what a GPU would reject shows up on the CPU.

`graph_guard.fake_cuda()` makes device="cuda" tensors fake (FakeTensorMode: shapes, no data),
and `CaptureGuard` fails on `_local_scalar_dense` (`.item()`, `bool(t)`), `nonzero`,
data-dependent output shapes, host <-> device copies (`torch.tensor([...], device="cuda")`,
`.cpu()`) and CPU tensors built per call. Kernels are their custom ops' fake
implementations; the Python between them runs for real, and where a custom op has Python
around its kernel (the CUTLASS prefill's exact fallback, the reference fake-quant, the
Triton launchers) that body is run under the guard as well. The controls at the end feed the
guard deliberately bad applies and expect it to fail.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types

import pytest
import torch

from vllm_mxplus.backends.base import LinearSpec
from vllm_mxplus.backends.graph_guard import (
    GraphCaptureViolation,
    cuda_empty,
    fake_cuda,
    guarded,
)
from vllm_mxplus.backends.triton.launch import is_split_k_sum

CAPTURE_MS = (1, 16, 24, 512)  # vLLM's capture sizes: decode ends, first prefill size, largest
N, K = 256, 576  # K: four whole macro blocks and a partial one


@pytest.fixture(autouse=True)
def _fake_cuda():
    with fake_cuda():
        yield


def _packed_layer(scheme: str, n: int = N, k: int = K, macro_block: int = 128):
    from vllm_mxplus.backends.triton.linear import ATTRS
    from vllm_mxplus.formats import get_format, get_scheme

    wf = get_format(get_scheme(scheme).weight_format)
    bufs = (
        cuda_empty((n, k // 2), torch.uint8),
        cuda_empty((n, -(-k // wf.block_size)), torch.uint8),
        cuda_empty((n, -(-k // macro_block)), torch.uint8) if wf.mbs else None,
    )
    return types.SimpleNamespace(**dict(zip(ATTRS, bufs, strict=True)))


def _spec(scheme: str, dtype=torch.bfloat16, macro_block: int = 128) -> LinearSpec:
    from vllm_mxplus.formats import get_scheme

    return LinearSpec(
        scheme=get_scheme(scheme, macro_block), n=N, k=K, out_dtype=dtype, device_type="cuda"
    )


def _assert_cuda_out(y, m: int, dtype=torch.bfloat16):
    assert tuple(y.shape) == (m, N) and y.dtype == dtype and y.device.type == "cuda"


# ----------------------------------------------------------------------------- Triton
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-ocp", "mxfp4-16-oas"])
@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
def test_triton_backends(scheme, m):
    """TritonDecodeBackend (M <= 16) / TritonGemmBackend (M > 16) apply end to end."""
    from vllm_mxplus.backends.triton.linear import TritonDecodeBackend, TritonGemmBackend

    cls = TritonDecodeBackend if TritonDecodeBackend.supports_m(m) else TritonGemmBackend
    assert cls.supports_m(m)
    x = cuda_empty((m, K), torch.bfloat16)
    y, guard = guarded(cls(_spec(scheme)).apply, _packed_layer(scheme), x, cuda_empty((N,)))
    _assert_cuda_out(y, m)
    gemms = [op for op in guard.ops if op.startswith("vllm_mxplus.triton_") and "gemm" in op]
    assert len(gemms) == 1, guard.ops  # one Triton GEMM op (decode_gemm or mx_gemm)


@pytest.mark.parametrize("fmt", ["mxfp4-mbs-s", "mxfp4-16-oas", "mxfp4-ocp", "nvfp4"])
@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
def test_triton_act_quant_launcher(fmt, m):
    """The act-quant custom op's body: allocations, tile choice, launch (recorded)."""
    from vllm_mxplus.backends.triton.act_quant import act_quant
    from vllm_mxplus.backends.triton.launch import capture_launches

    with capture_launches() as launches:
        guarded(lambda x: act_quant(x, fmt, macro_block=128), cuda_empty((m, K), torch.bfloat16))
    assert launches


@pytest.mark.parametrize("fmt", ["mxfp4-mbs-s", "mxfp4-16-oas", "mxfp4-16"])
@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
def test_triton_act_fp8_launcher(fmt, m):
    """The fused sm_90a encoder's body (act_fp8): allocations and one launch."""
    from vllm_mxplus.backends.cutlass.act_fp8 import act_quant_fp8_chunks
    from vllm_mxplus.backends.triton.launch import capture_launches

    with capture_launches() as launches:
        lay, _ = guarded(act_quant_fp8_chunks, cuda_empty((m, K), torch.bfloat16), fmt, 128)
    assert len(launches) == 1 and lay.fp8.device.type == "cuda"


# ----------------------------------------------------------------------------- CUTLASS
def _sm90_weight(inexact_rows: int):
    from benchmarks_count import sm90_weight  # type: ignore[import-not-found]

    return sm90_weight(N, K, inexact_rows)


@pytest.fixture(scope="module", autouse=True)
def _count_module():
    """benchmarks/count_prefill_ops.py's fake prepared weight, importable by name."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "count_prefill_ops.py"
    spec = importlib.util.spec_from_file_location("benchmarks_count", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules["benchmarks_count"] = mod
    yield
    sys.modules.pop("benchmarks_count", None)


def _fused_sm90(x, spec, w, bias, *engine):
    """The sm_90a prefill op's body (`prefill_sm90_fused_impl`) on the fused encoder's fake
    outputs for x, under the guard, its Triton launches recorded: (y, guard, launches)."""
    from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
    from vllm_mxplus.backends.triton.launch import capture_launches

    fields = torch.ops.vllm_mxplus.triton_act_fp8_chunks_packed(x, spec.activation_format, 128)
    with capture_launches() as launches:
        y, guard = guarded(
            cutlass_gemm.prefill_sm90_fused_impl,
            x,
            spec.activation_format,
            *fields,
            *w.sm90_operands(),
            bias,
            N,
            torch.bfloat16,
            *engine,
        )
    return y, guard, launches


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-16-oas"])
@pytest.mark.parametrize("inexact_w", [0, 3], ids=["w-exact", "w-fallback"])
@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
def test_cutlass_sm90_prefill(scheme, inexact_w, m):
    """CutlassPrefillBackend.apply on sm_90a, then the prefill op's body (the exact-row
    fallback: the row list, the Triton act-quant and the row-list GEMM; the weight's
    inexact columns) on the fused encoder's fake outputs."""
    from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend

    spec = _spec(scheme)
    w = _sm90_weight(inexact_w)
    layer = types.SimpleNamespace(**{CutlassPrefillBackend.WEIGHT_ATTR: w})
    x = cuda_empty((m, K), torch.bfloat16)
    y, guard = guarded(CutlassPrefillBackend(spec).apply, layer, x, cuda_empty((N,)))
    _assert_cuda_out(y, m)
    assert guard.count("vllm_mxplus.cutlass_prefill_sm90_fused") == 1
    y, guard, launches = _fused_sm90(x, spec, w, cuda_empty((N,), torch.bfloat16))
    _assert_cuda_out(y, m)
    assert guard.count("aten.nonzero_static") == 0  # the rows are listed by one kernel
    kernels = _kernels(launches)
    # the weight's FP8 form for this call (none is held; on words: the rows vectorize), the
    # row list and its GEMM (the activations' packed fields come from the fused encoder's
    # launch), and the columns of the weight's inexact rows
    want = ["_weight_fp8_words_kernel", "_list_rows_kernel", "_mx_gemm_kernel"]
    assert kernels == want + ["_mx_gemm_kernel"] * bool(inexact_w), kernels


@pytest.mark.parametrize("k", [K, 512], ids=["K576", "K512"])
@pytest.mark.parametrize("held", [False, True], ids=["per-call", "held"])
@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
def test_triton_fp8_prefill(held, m, k):
    """The FP8-chunk pipeline on Triton's GEMM (`triton-fp8-prefill`) on fake CUDA tensors:
    no host sync or host->device copy; then its kernels: with the weight's FP8 form held
    (VLLM_MXPLUS_FP8_WEIGHT_HELD=1) the Triton FP8 GEMM; else for K a multiple of 256 the
    packed-weight GEMM (`fp8_packed_gemm`, K split on this small grid, its sum in order), for
    other K the weight's encoder per call and the FP8 GEMM; then the fallback's row-list GEMM."""
    from benchmarks_count import sm90_weight  # type: ignore[import-not-found]

    from vllm_mxplus.backends.cutlass.linear import TritonFp8PrefillBackend

    spec = LinearSpec(scheme="mxfp4-mbs", n=N, k=k, out_dtype=torch.bfloat16, device_type="cuda")
    rows, kp = -(-N // 8) * 8, -(-k // 128) * 128
    fp8 = (cuda_empty((rows, kp), torch.float8_e4m3fn), cuda_empty((kp // 128, rows)))
    w = dataclasses.replace(sm90_weight(N, k, 0), engine="triton", held_fp8=fp8 if held else None)
    layer = types.SimpleNamespace(**{TritonFp8PrefillBackend.WEIGHT_ATTR: w})
    x = cuda_empty((m, k), torch.bfloat16)
    y, guard = guarded(TritonFp8PrefillBackend(spec).apply, layer, x, cuda_empty((N,)))
    _assert_cuda_out(y, m)
    assert guard.count("vllm_mxplus.cutlass_prefill_sm90_fused") == 1
    y, guard, launches = _fused_sm90(x, spec, w, cuda_empty((N,), torch.bfloat16), w.engine)
    _assert_cuda_out(y, m)
    assert not guard.violations
    if held:
        gemm = ["_fp8_chunk_gemm_kernel"]
    elif k % 256 == 0:
        gemm = ["_fp8_packed_gemm_kernel"]
        packed = next(lc for lc in launches if lc.kernel.fn.__name__ == gemm[0])
        # a grid of 2-8 tiles splits K, summed in the same launch
        assert packed.grid[1] > 1 and packed.kwargs["REDUCE"]
        assert not any(is_split_k_sum(lc) for lc in launches)
    else:
        gemm = ["_weight_fp8_words_kernel", "_fp8_chunk_gemm_kernel"]
    assert _kernels(launches) == [*gemm, "_list_rows_kernel", "_mx_gemm_kernel"]


def test_cutlass_sm90_every_row_inexact_at_m512():
    """M = 512, vLLM's largest capture size, with every row outside the FP8 span (the data
    of tests/backends/cutlass/test_cutlass_gemm.py's test at M = 512, where the numbers are
    checked): the fallback's shapes do not depend on the data, so here, on fake CUDA
    tensors, the guard sees no host sync, and the row-list GEMM has room for all 512 rows
    (the row list at capacity >= M; its row tiles cover every row)."""
    m, spec, w = 512, _spec("mxfp4-mbs"), _sm90_weight(0)
    x = cuda_empty((m, K), torch.bfloat16)
    y, guard, launches = _fused_sm90(x, spec, w, None)
    _assert_cuda_out(y, m)
    assert not guard.violations
    (rows_gemm,) = [launch for launch in launches if launch.kernel.__name__ == "_mx_gemm_kernel"]
    assert rows_gemm.kwargs["MOE"]  # the row list
    listed = rows_gemm.args[10]  # pairs_ptr: the listed rows, padded with M
    assert listed.shape[0] >= m and rows_gemm.grid[2] * rows_gemm.kwargs["BLOCK_M"] >= m
    (lister,) = [launch for launch in launches if launch.kernel.__name__ == "_list_rows_kernel"]
    assert lister.args[1] is listed and lister.args[4] == listed.shape[0]  # its capacity


@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
def test_cutlass_sm90_prefill_from_codes(m):
    """The codes entry point (`prefill_gemm`): the torch FP8 encoder + fallback."""
    from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
    from vllm_mxplus.backends.triton.launch import capture_launches

    w = _sm90_weight(3)
    nc = -(-K // 128)
    with capture_launches() as launches:
        y, _ = guarded(
            cutlass_gemm.prefill_sm90_impl,
            cuda_empty((m, K // 2), torch.uint8),
            cuda_empty((m, K // 16), torch.uint8),
            cuda_empty((m, nc), torch.uint8),
            K,
            *w.sm90_operands(),
            None,
            N,
            torch.float16,
        )
    _assert_cuda_out(y, m, torch.float16)
    want = ["_weight_fp8_words_kernel", "_list_rows_kernel", "_mx_gemm_kernel", "_mx_gemm_kernel"]
    assert _kernels(launches) == want


@pytest.mark.parametrize("use_mbs", [True, False], ids=["mbs", "no-mbs"])
@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
def test_cutlass_sm100_prefill(monkeypatch, use_mbs, m):
    from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm

    # the SF packer is a CUDA kernel of the extension: a stand-in of its output shape
    monkeypatch.setattr(
        cutlass_gemm,
        "pack_scales_sm100",
        lambda s, k, chunk=128: torch.empty(
            s.shape[0] * k // 16, dtype=torch.uint8, device=s.device
        ),
    )
    kp, nc = 640, 5
    y, guard = guarded(
        cutlass_gemm.prefill_sm100_impl,
        cuda_empty((m, K // 2), torch.uint8),
        cuda_empty((m, K // 16), torch.uint8),
        cuda_empty((m, nc), torch.uint8) if use_mbs else None,
        K,
        cuda_empty((N, kp // 2), torch.uint8),
        cuda_empty((N * kp // 16,), torch.uint8),
        cuda_empty((nc, N)) if use_mbs else cuda_empty((0,)),
        cuda_empty((N,), torch.float16),
        N,
        use_mbs,
        torch.float32,
    )
    _assert_cuda_out(y, m, torch.float32)
    assert guard.count("vllm_mxplus.cutlass_fp4_mbs_gemm") == 1


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-16-oas", "nvfp4"])
@pytest.mark.parametrize("inexact_w", [0, 3], ids=["w-exact", "w-fallback"])
@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
def test_triton_fp4_prefill(scheme, inexact_w, m):
    """sm_100's FP4 MMA pipeline (`triton-fp4-prefill`) on fake CUDA tensors: its one op per
    apply, then the op's body under the guard (no host sync, no host->device copy): the
    activations' relative scales (E8M0), the FP4 MMA GEMM, the exact fallback's row-list GEMM,
    and the columns of the weight's inexact rows (known at load)."""
    from vllm_mxplus.backends.triton.fp4_prefill import (
        FP4_ATTRS,
        TritonFp4PrefillBackend,
        fp4_prefill_impl,
    )
    from vllm_mxplus.backends.triton.fp4_rel_scales import aligned_rows
    from vllm_mxplus.backends.triton.launch import capture_launches
    from vllm_mxplus.backends.triton.linear import ATTRS, GLOBAL_ATTR
    from vllm_mxplus.formats import get_format, get_scheme

    k = 512  # whole 128-K chunks (the MMA's step)
    sch = get_scheme(scheme)
    wf = get_format(sch.weight_format)
    nvfp4, mbs = wf.has_global_scale, bool(wf.mbs)
    dev = torch.device("cuda")
    packed = (
        cuda_empty((N, k // 2), torch.uint8),
        cuda_empty((N, k // 16), torch.float8_e4m3fn if nvfp4 else torch.uint8),
        cuda_empty((N, k // 128), torch.uint8) if mbs else None,
    )
    fp4 = (
        aligned_rows(N, k // 16, torch.uint8, dev),
        aligned_rows(k // 128 if mbs else 1, N, torch.float32, dev),
        torch.arange(inexact_w, device=dev),
    )
    layer = types.SimpleNamespace(**dict(zip(ATTRS + FP4_ATTRS, packed + fp4, strict=True)))
    setattr(layer, GLOBAL_ATTR, cuda_empty((N,)) if nvfp4 else None)
    spec = LinearSpec(scheme=sch, n=N, k=k, out_dtype=torch.bfloat16, device_type="cuda")
    x = cuda_empty((m, k), torch.bfloat16)
    y, guard = guarded(TritonFp4PrefillBackend(spec).apply, layer, x, None)
    _assert_cuda_out(y, m)
    assert guard.count("vllm_mxplus.triton_fp4_prefill") == 1
    with capture_launches() as launches:
        y, guard = guarded(
            fp4_prefill_impl, x, sch.activation_format, sch.weight_format, 128, *packed,
            getattr(layer, GLOBAL_ATTR), *fp4, cuda_empty((N,)), None, torch.bfloat16,
        )  # fmt: skip
    _assert_cuda_out(y, m)
    assert not guard.violations
    assert guard.count("aten.nonzero_static") == 0  # the rows are listed by one kernel
    want = ([] if nvfp4 else ["_rel_scales_kernel"]) + ["_fp4_scaled_gemm_kernel"]
    want += ["_list_rows_kernel"] + ["_mx_gemm_kernel"] * (1 + bool(inexact_w))
    assert _kernels(launches) == want


# ----------------------------------------------------------------------------- MoE
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-16-oas"])
@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
def test_triton_experts(scheme, m, monkeypatch):
    """TritonExperts.apply (routing alignment on the device, two grouped GEMMs) at top-2
    over 8 experts: weights prepared from fake quantized tensors, then the guarded call. The
    E8M0 experts take the decode kernel's grouped mode (`moe_decode`)."""
    from vllm_mxplus.backends.base import ExpertSpec, ExpertWeights
    from vllm_mxplus.backends.triton import experts as triton_experts
    from vllm_mxplus.backends.triton.experts import TritonExperts

    # the load-time scale check reads the scales once (a host sync at load, outside any
    # capture); fake tensors hold no values to read
    monkeypatch.setattr(triton_experts, "small_weight_scales", lambda scales: True)
    from vllm_mxplus.formats import QuantizedTensor, get_format, quantize

    e, inter, hidden = 8, 256, K
    spec = ExpertSpec(scheme=scheme, device_type="cuda")
    mb = spec.macro_block

    def qt(rows: int, k: int) -> QuantizedTensor:
        """formats' QuantizedTensor of one CPU row, its fields swapped for fake CUDA ones."""
        f = get_format(spec.weight_format)
        with _outside_fake_mode():
            one = quantize(torch.ones(1, k), spec.weight_format, macro_block=mb)
        return dataclasses.replace(
            one,
            codes=cuda_empty((rows, k // 2), torch.uint8),
            scales=cuda_empty((rows, -(-k // f.block_size)), torch.uint8),
            shape=torch.Size((rows, k)),
            mbs=cuda_empty((rows, -(-k // mb)), torch.uint8) if f.mbs else None,
        )

    shapes = {"w13": (e * 2 * inter, hidden), "w2": (e * hidden, inter)}
    weights = ExpertWeights(quantized=lambda stem: (qt(*shapes[stem]), e), dequantized=None)
    layer = types.SimpleNamespace()
    backend = TritonExperts(spec)
    backend.process_weights_after_loading(layer, weights)
    x = cuda_empty((m, hidden), torch.bfloat16)
    ids = cuda_empty((m, 2), torch.int32)
    y, guard = guarded(backend.apply, layer, x, cuda_empty((m, 2)), ids, torch.nn.functional.silu)
    assert tuple(y.shape) == (m, hidden) and y.device.type == "cuda"
    assert guard.count("vllm_mxplus.triton_moe_decode_gemm") == 2
    assert guard.count("vllm_mxplus.triton_act_quant_hat") == 2


# ----------------------------------------------------------------------------- reference
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-16-oas", "mxfp4-ocp"])
@pytest.mark.parametrize("m", CAPTURE_MS, ids=lambda m: f"M{m}")
def test_reference_on_cuda(scheme, m):
    """ReferenceBackend.apply, then its fake-quant op's body (the fast path, no host branch
    on CUDA: blocks outside its easy range come from the general path by torch.where)."""
    from vllm_mxplus.backends.reference.activation import FAST_FORMATS, fast_fake_quantize
    from vllm_mxplus.backends.reference.linear import WEIGHT_ATTR, ReferenceBackend

    spec = _spec(scheme)
    layer = types.SimpleNamespace(**{WEIGHT_ATTR: cuda_empty((N, K))})
    x = cuda_empty((m, K), torch.bfloat16)
    y, _ = guarded(ReferenceBackend(spec).apply, layer, x, cuda_empty((N,), torch.bfloat16))
    _assert_cuda_out(y, m)
    assert spec.activation_format in FAST_FORMATS
    xq, _ = guarded(fast_fake_quantize, x, spec.activation_format, 128)
    assert xq.shape == x.shape and xq.device.type == "cuda"


def _activation_formats() -> list[str]:
    from vllm_mxplus.formats import get_scheme
    from vllm_mxplus.formats.schemes import SCHEMES

    return sorted({get_scheme(s).activation_format for s in SCHEMES})


@pytest.mark.parametrize("fmt", _activation_formats())
@pytest.mark.parametrize("m", [1, 512], ids=lambda m: f"M{m}")
def test_reference_general_fake_quant_on_cuda(fmt, m):
    """formats.fake_quantize, the reference's path for every activation format (per token
    for NVFP4, as served): no sync, no host tensor."""
    from vllm_mxplus.formats import fake_quantize

    x = cuda_empty((m, K), torch.bfloat16)
    xq, _ = guarded(fake_quantize, x, fmt, per_row=fmt == "nvfp4")
    assert xq.shape == (m, K) and xq.device.type == "cuda"


# ----------------------------------------------------------------------------- controls
def _table_decode(codes):  # the E2M1 decode this file was written against: a host table
    pos = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device=codes.device)
    return torch.cat([pos, -pos])[codes.long()]


def _branchy(x):  # the reference fake-quant's old host branch
    return x * 2 if bool((x.abs() > 1e30).any()) else x


BAD_APPLIES = {
    "table-h2d": _table_decode,
    "literal-cuda": lambda x: x + torch.tensor([1.0], device="cuda"),
    "host-branch": _branchy,
    "item": lambda x: x * x.amax().item(),
    "nonzero": lambda x: x[(x > 0).nonzero()[:, 0]],
    "mask-index": lambda x: x[x > 0],
    "to-cpu": lambda x: x.cpu(),
    "cpu-alloc": lambda x: x + torch.zeros(x.shape[-1]).sum(),
    "data-shape": lambda x: torch.unique(x),
}


@pytest.mark.parametrize("bad", list(BAD_APPLIES), ids=list(BAD_APPLIES))
def test_guard_fails_on_bad_applies(bad):
    x = cuda_empty((4, 8), torch.uint8 if bad == "table-h2d" else torch.float32)
    with pytest.raises(GraphCaptureViolation):
        guarded(BAD_APPLIES[bad], x)


def test_guard_fails_on_a_bad_backend_apply(monkeypatch):
    """A real backend whose apply regresses to a host table is caught end to end."""
    from vllm_mxplus.backends.cutlass import fp8_chunks

    test_cutlass_sm90_prefill_from_codes(24)  # passes with the real decode
    monkeypatch.setattr(fp8_chunks, "e2m1_decode", _table_decode)
    with pytest.raises(GraphCaptureViolation, match="CPU tensor|host copy|copy"):
        from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm

        w = _sm90_weight(0)
        guarded(
            cutlass_gemm.prefill_sm90_impl,
            cuda_empty((24, K // 2), torch.uint8),
            cuda_empty((24, K // 16), torch.uint8),
            None,
            K,
            *w.sm90_operands(),
            None,
            N,
            torch.bfloat16,
        )


def test_guard_passes_good_code_and_counts_ops():
    def good(x):
        return torch.where(x > 0, x, 0.0).sum(-1)

    y, guard = guarded(good, cuda_empty((4, 8)))
    assert y.shape == (4,) and not guard.violations
    aten_ops = [op.split(".")[1] for op in guard.ops if op.startswith("aten.")]
    assert aten_ops == ["gt", "scalar_tensor", "where", "sum"] and guard.count() == 4


def test_non_strict_guard_records_violations():
    _, guard = guarded(_table_decode, cuda_empty((4,), torch.uint8), strict=False)
    assert guard.violations and any("cpu" in v.lower() for v in guard.violations)


# ----------------------------------------------------------------------------- real CUDA
@contextlib.contextmanager
def _outside_fake_mode():
    """Real tensors inside: the module's fake CUDA mode left for the block."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    mode = _get_current_dispatch_mode()
    if isinstance(mode, FakeTensorMode):
        with _pop_mode_temporarily():
            yield
    else:
        yield


@pytest.fixture
def _real_tensors():
    """The GPU tests below need real tensors: leave the module's fake CUDA mode."""
    with _outside_fake_mode():
        yield


@pytest.mark.gpu
def test_cuda_graph_replay_check_on_the_device(_real_tensors, cuda_device):
    """graph_guard.cuda_graph_replay_mismatch passes a capturable fn and reports one that
    syncs (the capture raises) or one whose replay differs from eager."""
    from vllm_mxplus.backends.graph_guard import cuda_graph_replay_mismatch

    x = torch.randn(24, 64, device=cuda_device)
    fresh = torch.randn(24, 64, device=cuda_device)
    assert cuda_graph_replay_mismatch(lambda t: t * 2 + 1, x.clone(), fresh) is None
    assert "raised" in cuda_graph_replay_mismatch(lambda t: t * t.sum().item(), x.clone(), fresh)
    state = {"calls": 0}

    def drifts(t):  # a host-side value baked into the graph at capture time
        state["calls"] += 1
        return t * float(state["calls"])

    assert "differs" in cuda_graph_replay_mismatch(drifts, x.clone(), fresh)


def test_cuda_graph_replay_check_off_cuda(_real_tensors):
    from vllm_mxplus.backends.graph_guard import cuda_graph_replay_mismatch

    assert (
        cuda_graph_replay_mismatch(lambda t: t.sum().item(), torch.ones(3), torch.ones(3)) is None
    )


def _kernels(launches) -> list[str]:
    """The launched kernels' names, each split-K sum (`_finish_kernel`) checked to follow a
    launch of more than one K slice and then left out (it comes with every such launch)."""
    names = []
    for i, launch in enumerate(launches):
        if is_split_k_sum(launch):
            assert i > 0 and launches[i - 1].grid[1] > 1, "a split-K sum after an unsplit launch"
            continue
        names.append(launch.kernel.__name__)
    return names
