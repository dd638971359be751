"""The Triton backends in the dispatch: registered for CUDA, rejected elsewhere with a
reason, every scheme served at every M without the reference (no fp32 weight copy), and (on
CUDA) numerically the reference's numbers."""

import pytest
import torch

from vllm_mxplus.backends import LinearSpec, registered_backends, select
from vllm_mxplus.backends.reference.linear import ReferenceBackend
from vllm_mxplus.backends.triton.linear import TritonDecodeBackend
from vllm_mxplus.formats import SCHEMES, get_scheme, quantize


def test_registered_first_for_cuda_only():
    from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend, TritonFp8PrefillBackend
    from vllm_mxplus.backends.triton.fp4_prefill import TritonFp4PrefillBackend
    from vllm_mxplus.backends.triton.linear import TritonGemmBackend

    # CUTLASS where built (from VLLM_MXPLUS_PREFILL_MIN_M), then sm_100's FP4 MMA (from the
    # decode GEMM's 64-row tile on), then the decode GEMM (the M they leave), then the
    # FP8-chunk pipeline on Triton (large M), then the packed Triton GEMM: the order decides
    assert registered_backends("cuda") == [
        CutlassPrefillBackend,
        TritonFp4PrefillBackend,
        TritonDecodeBackend,
        TritonFp8PrefillBackend,
        TritonGemmBackend,
    ]
    assert all("triton" not in b.name for b in registered_backends("cpu"))


def test_rejections_name_the_reason():
    ok, why = TritonDecodeBackend.is_supported("cpu", None)
    assert not ok and "CUDA" in why
    ok, why = TritonDecodeBackend.can_implement(LinearSpec("mxfp4-mbs", 64, 64, torch.int8))
    assert not ok and "output dtype" in why
    for scheme in SCHEMES:  # every scheme: E8M0 (+ MBS), NVFP4, MX+
        assert TritonDecodeBackend.can_implement(LinearSpec(scheme, 64, 64, torch.bfloat16))[0]
    assert TritonDecodeBackend.supports_m(128) and not TritonDecodeBackend.supports_m(129)


def test_decode_range_follows_the_settings(monkeypatch):
    """Batched decode up to 128 rows by default; 64 with the weight's FP8 form held (that
    pipeline is estimated ahead above); below VLLM_MXPLUS_PREFILL_MIN_M, never under 16."""
    from vllm_mxplus import settings
    from vllm_mxplus.backends.cutlass.linear import TritonFp8PrefillBackend

    assert TritonDecodeBackend.m_range() == (1, 128)
    assert TritonFp8PrefillBackend.m_range() == (129, None)
    monkeypatch.setenv(settings.FP8_WEIGHT_HELD.name, "1")
    assert TritonDecodeBackend.m_range() == (1, 64)
    assert TritonFp8PrefillBackend.m_range() == (65, None)
    monkeypatch.delenv(settings.FP8_WEIGHT_HELD.name)
    monkeypatch.setenv(settings.PREFILL_MIN_M.name, "33")
    assert TritonDecodeBackend.m_range() == (1, 32)
    monkeypatch.setenv(settings.PREFILL_MIN_M.name, "5")
    assert TritonDecodeBackend.m_range() == (1, 16)


@pytest.mark.parametrize(
    "macro_block,k,m,want",
    [
        (128, 256, 40, ("_decode_gemm_kernel", 64)),  # x_hat path: 64-row tiles
        (128, 256, 20, ("_decode_gemm_kernel", 32)),
        (128, 256, 8, ("_decode_gemm_kernel", 16)),
        # macro blocks under the step: an operand row per macro block (`sub_blocks`), so
        # batched rows stay on mx_gemm above 16
        (64, 256, 40, ("_mx_gemm_kernel", None)),
        (64, 256, 8, ("_decode_gemm_kernel", 16)),
        (16, 256, 2, ("_decode_gemm_kernel", 16)),
        (128, 200, 40, ("_mx_gemm_kernel", None)),  # code rows that do not vectorize
    ],
)
def test_batched_decode_takes_the_fast_path_or_mx_gemm(macro_block, k, m, want):
    """What `triton-decode` launches above 16 rows (the GPU's tiles, `capture_launches`):
    the decode GEMM on x_hat with 32- / 64-row tiles where the layer takes x_hat and a K step
    is one macro block, else `mx_gemm` as `triton-gemm` would."""
    from vllm_mxplus.backends.triton.launch import capture_launches, last_gemm

    spec = LinearSpec(get_scheme("mxfp4-mbs", macro_block), 64, k, torch.bfloat16)
    w = quantize(torch.randn(64, k) * 0.1, spec.weight_format, macro_block=macro_block)
    layer = torch.nn.Module()
    backend = TritonDecodeBackend(spec)
    backend.process_weights_after_loading(layer, w)
    with capture_launches() as launches:
        backend.apply(layer, torch.randn(m, k).to(torch.bfloat16), None)
    gemm = last_gemm(launches)
    assert (gemm.kernel.__name__, gemm.kwargs.get("BLOCK_M") if want[1] else None) == want
    if gemm.kernel.__name__ == "_decode_gemm_kernel":
        assert gemm.kwargs["X_HAT"] == (k % 32 == 0)
        assert gemm.kwargs["SUB"] == max(1, 128 // macro_block)
        assert gemm.kwargs["W_FOLD"] == gemm.kwargs["WORDS"]  # trained-size weights fold


def _apply_within_bound(backend_cls, macro_block: int, k: int, m: int, seed: int, device):
    """backend_cls.apply for m rows of a 48 x k `mxfp4-mbs` layer against the float64 product
    of the `formats` operands: the decode GEMM's 2^-16 bound plus the bf16 output rounding."""
    n = 48
    spec = LinearSpec(get_scheme("mxfp4-mbs", macro_block), n, k, torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.1
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    qw = quantize(w.to(device), spec.weight_format, macro_block=macro_block)
    layer = torch.nn.Module()
    backend = backend_cls(spec)
    assert backend.supports_m(m)
    backend.process_weights_after_loading(layer, qw)
    y = backend.apply(layer, x.to(device), None).double().cpu()
    qx = quantize(x.to(device), spec.activation_format, macro_block=macro_block)
    xh, wh = qx.dequantize().double().cpu(), qw.dequantize().double().cpu()
    y64, scale = xh @ wh.T, xh.abs() @ wh.abs().T
    assert ((y - y64).abs() <= 2.0**-16 * scale + 2.0**-8 * y64.abs()).all()
    return backend


def test_batched_decode_matches_formats(triton_device):
    """TritonDecodeBackend.apply for 40 rows (the batched x_hat path) within the bound."""
    _apply_within_bound(TritonDecodeBackend, 128, 512, 40, 1, triton_device)


@pytest.mark.parametrize(
    "macro_block,ok",
    [
        (16, True),
        (32, True),
        (64, True),
        (128, True),
        (1024, True),
        (2048, True),
        (4096, False),
        (96, False),
        (48, False),
    ],
)
def test_macro_blocks_the_kernels_cannot_tile_are_rejected(macro_block, ok):
    """can_implement rejects what the kernels cannot compile, so the selector falls back."""
    spec = LinearSpec(get_scheme("mxfp4-mbs", macro_block), 64, 4096, torch.bfloat16)
    got, why = TritonDecodeBackend.can_implement(spec)
    assert got == ok and (ok or f"macro block {macro_block}" in why)
    # a scheme without MBS has no macro block to choose (the one validity rule)
    if macro_block != 128:
        with pytest.raises(ValueError, match="has no macro blocks"):
            get_scheme("mxfp4-16-oas", macro_block)
    plain = LinearSpec(get_scheme("mxfp4-16-oas"), 64, 4096, torch.bfloat16)
    assert TritonDecodeBackend.can_implement(plain)[0]


def test_cpu_selection_has_no_triton():
    chosen = [b.name for b in select(LinearSpec("mxfp4-mbs", 64, 576, torch.bfloat16), "cpu", None)]
    assert chosen in (["cpu-packed"], ["reference"]) and "triton-decode" not in chosen


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-mbs-s", "mxfp4-16-oas", "mxfp4-ocp"])
@pytest.mark.parametrize("m", [1, 4, 16])
def test_cuda_decode_matches_reference(scheme, m):
    spec = LinearSpec(scheme, 1536, 576, torch.bfloat16, device_type="cuda")
    chosen = select(spec, "cuda", 10 * torch.cuda.get_device_capability()[0])
    assert chosen[0].name == "triton-decode"
    w = torch.randn(1536, 576, device="cuda", dtype=torch.bfloat16)
    qw = quantize(w, spec.weight_format)
    layer = torch.nn.Module()
    for b in (chosen[0], ReferenceBackend(spec)):
        b.process_weights_after_loading(layer, qw)
    x = torch.randn(m, 576, device="cuda", dtype=torch.bfloat16)
    y = chosen[0].apply(layer, x, None).float()
    ref = ReferenceBackend(spec).apply(layer, x, None).float()
    # both compute exact products of the same quantized operands; fp32 accumulation order and
    # the bf16 output rounding differ: allow 2 bf16 ulps of the output scale
    assert torch.allclose(y, ref, rtol=2**-7, atol=2**-7 * ref.abs().max().item())


# ----------------------------------------------------------------------------- which path per N
def _cuda_selection(
    monkeypatch, macro_block: int, cutlass: bool, scheme: str = "mxfp4-mbs"
) -> list[str]:
    """Backend names the selector picks for an MBS layer on a mocked sm_90 CUDA platform
    (the Triton kernels run in the interpreter here; the CUTLASS prefill's availability
    mocked; self-tests off: the kernels' numbers are the tests above and below)."""
    from vllm_mxplus import settings
    from vllm_mxplus.backends import selection as dispatch
    from vllm_mxplus.backends.cutlass.linear import CutlassPrefillBackend

    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setenv(settings.SELFTEST.name, "0")
    monkeypatch.setattr(
        CutlassPrefillBackend,
        "is_supported",
        classmethod(lambda cls, p, c: (True, "") if cutlass else (False, "not built")),
    )
    spec = LinearSpec(get_scheme(scheme, macro_block), 64, 4096, torch.bfloat16)
    return [b.name for b in select(spec, "cuda", 90)]


@pytest.mark.parametrize("cutlass", [True, False], ids=["cutlass", "no-cutlass"])
@pytest.mark.parametrize("macro_block", [16, 32, 64, 256])
def test_small_macro_blocks_get_triton_for_every_m(
    monkeypatch, triton_device, macro_block, cutlass
):
    """N != 128: the CUTLASS prefill GEMM takes only 128, so Triton serves decode and
    prefill (no reference backend, hence no fp32 weight copy), CUTLASS built or not."""
    chosen = _cuda_selection(monkeypatch, macro_block, cutlass)
    assert chosen == ["triton-decode", "triton-gemm"]


@pytest.mark.parametrize("cutlass", [True, False], ids=["cutlass", "no-cutlass"])
def test_macro_block_128_prefill_is_cutlass_where_built_else_triton(
    monkeypatch, triton_device, cutlass
):
    """N = 128: decode Triton (batched up to 128 rows); prefill CUTLASS where built (first in
    the priority order, its M range from VLLM_MXPLUS_PREFILL_MIN_M), else the FP8-chunk
    pipeline on Triton's FP8 GEMM from FP8_PREFILL_MIN_M rows; the packed Triton GEMM is
    then covered, never the reference."""
    chosen = _cuda_selection(monkeypatch, 128, cutlass)
    without = ["triton-decode", "triton-fp8-prefill"]
    assert chosen == (["cutlass_prefill", "triton-decode"] if cutlass else without)


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_scheme_gets_triton_for_every_m_without_cutlass(monkeypatch, triton_device, scheme):
    """No scheme needs the reference (a 4-byte fp32 weight copy) on CUDA any more; the E8M0
    block-16 schemes also get the FP8-chunk pipeline for large M."""
    from vllm_mxplus.backends.cutlass.linear import TritonFp8PrefillBackend

    fp8 = TritonFp8PrefillBackend.can_implement(
        LinearSpec(get_scheme(scheme, 128), 64, 4096, torch.bfloat16)
    )[0]
    want = ["triton-decode", "triton-fp8-prefill"] if fp8 else None
    assert _cuda_selection(monkeypatch, 128, False, scheme) == (
        want or ["triton-decode", "triton-gemm"]
    )


def test_untileable_macro_block_fails_with_reason(monkeypatch, triton_device):
    """N = 48 (a multiple of 16, not a power of two): both Triton backends refuse it and the
    reference serves a CUDA layer only when VLLM_MXPLUS_BACKEND asks, so the layer fails to
    load with each backend's reason and the setting that would allow the reference."""
    from vllm_mxplus.backends.selection import BackendUnavailable

    with pytest.raises(BackendUnavailable) as err:
        _cuda_selection(monkeypatch, 48, cutlass=False)
    msg = str(err.value)
    assert "triton-decode: macro block 48" in msg and "power" in msg
    assert "VLLM_MXPLUS_BACKEND=linear:reference" in msg


@pytest.mark.parametrize(
    "scheme,macro_block",
    [("mxfp4-mbs", 16), ("mxfp4-mbs", 32), ("mxfp4-mbs", 64), ("mxfp4-mbs", 128)]
    + [("nvfp4", 128), ("mxplus", 128), ("mxfp4-ocp", 128)],
)
def test_triton_backends_pass_the_self_test(triton_device, scheme, macro_block):
    """The real self-test (selftest.run_self_test: activation codes bit for bit, outputs in
    the bound, M in each backend's range) of both Triton backends, every kind of format."""
    from vllm_mxplus.backends.selftest import run_self_test
    from vllm_mxplus.backends.triton.linear import TritonGemmBackend

    spec = LinearSpec(get_scheme(scheme, macro_block), 64, 4096, torch.bfloat16)
    for cls in (TritonDecodeBackend, TritonGemmBackend):
        assert run_self_test(cls, spec, triton_device) is None


def test_triton_gemm_backend_matches_formats_for_prefill_rows(triton_device):
    """TritonGemmBackend.apply for 40 rows at N = 32 against the float64 product of the
    `formats` operands (the decode GEMM's 2^-16 bound, plus the bf16 output rounding)."""
    from vllm_mxplus.backends.triton.linear import TritonGemmBackend

    backend = _apply_within_bound(TritonGemmBackend, 32, 200, 40, 0, triton_device)
    assert not backend.supports_m(16)
