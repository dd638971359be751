"""Self-test at first use: wrong fake kernels are rejected with the first differing element
named, a right one passes, the verdict is cached, VLLM_MXPLUS_SELFTEST=0 skips it, and the
real CPU kernels pass."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from vllm_mxplus import settings
from vllm_mxplus.backends import selection as dispatch
from vllm_mxplus.backends import selftest
from vllm_mxplus.backends.base import LinearBackend, LinearSpec
from vllm_mxplus.backends.checks import output_bound
from vllm_mxplus.backends.reference.linear import ReferenceBackend
from vllm_mxplus.backends.selection import BackendUnavailable, register_backend, select
from vllm_mxplus.backends.selftest import run_self_test
from vllm_mxplus.formats import SCHEMES, fake_quantize, quantize

CPU = torch.device("cpu")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class _Exact(LinearBackend):
    """A 'kernel' computing y from formats in float64, rounded once to the output dtype;
    subclasses corrupt it the ways real kernels go wrong."""

    name = "fake-exact"
    kernel = True
    runs = 0

    @classmethod
    def is_supported(cls, platform: str, capability: int | None):
        return True, ""

    def process_weights_after_loading(self, layer, qweight):

        layer.w_hat = qweight.dequantize(torch.float32)

    def apply(self, layer, x, bias, act_global_scale=None):

        spec = self.spec
        type(self).runs += 1
        xq = fake_quantize(
            x.float(),
            spec.activation_format,
            macro_block=spec.macro_block,
            per_row=spec.activation_per_row,
        ).double()
        w = layer.w_hat.double()
        b = torch.zeros(spec.n, dtype=torch.float64) if bias is None else bias.double()
        y64 = xq @ w.T + b
        bound = output_bound(xq.abs() @ w.abs().T, y64, b.abs(), spec.k, spec.out_dtype)
        self.exact_data = bias is None  # the self-test's exact check passes no bias
        return self.corrupt(y64.to(spec.out_dtype), y64, bound)

    def corrupt(self, y: torch.Tensor, y64: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
        return y


def _step_out(
    y: torch.Tensor, y64: torch.Tensor, bound: torch.Tensor, r: int, c: int, beyond: bool
) -> torch.Tensor:
    """Move y[r, c] up one output-dtype ulp at a time: to the first value beyond the bound
    (beyond=True) or the last one within it."""
    inf = torch.tensor(float("inf"), dtype=y.dtype)
    v = y[r, c]
    while True:
        nxt = torch.nextafter(v, inf)
        if float(nxt.double() - y64[r, c]) > float(bound[r, c]):
            break
        v = nxt
    y = y.clone()
    y[r, c] = torch.nextafter(v, inf) if beyond else v
    return y


class _OneUlpBeyond(_Exact):
    name = "fake-one-ulp-beyond"

    def corrupt(self, y, y64, bound):
        return _step_out(y, y64, bound, y.shape[0] - 1, 5, beyond=True)


class _AtTheBound(_Exact):
    """Right: the largest value the bound allows, in the last row, on random data. On the
    exact check's data every partial sum is exact: a right kernel has no error to spend
    there and gives the one rounding of y64."""

    name = "fake-at-the-bound"

    def corrupt(self, y, y64, bound):
        if self.exact_data:
            return y
        return _step_out(y, y64, bound, y.shape[0] - 1, 5, beyond=False)


class _NaN(_Exact):
    name = "fake-nan"

    def corrupt(self, y, y64, bound):
        y = y.clone()
        y[0, 3] = float("nan")
        return y


class _WrongColumn(_Exact):
    name = "fake-wrong-column"

    def corrupt(self, y, y64, bound):
        y = y.clone()
        y[:, 7] = y[:, 8]
        return y


class _WrongCodes(_Exact):
    """Right output, but the activation codes it exposes have one element off by one code."""

    name = "fake-wrong-codes"

    def selftest_activation(self, x):

        spec = self.spec
        q = quantize(x.float(), spec.activation_format, macro_block=spec.macro_block)
        q.codes[0, 1] ^= 0x10  # element 3: code +1 (or -1) in the high nibble
        return q


class _RightCodes(_Exact):
    name = "fake-right-codes"

    def selftest_activation(self, x):

        spec = self.spec
        return quantize(x.float(), spec.activation_format, macro_block=spec.macro_block)


class _WrongValues(_Exact):
    """Exposes fake-quantized values (fp32) with a -0 where formats says +0."""

    name = "fake-wrong-values"

    def selftest_activation(self, x):

        spec = self.spec
        v = fake_quantize(x.float(), spec.activation_format, macro_block=spec.macro_block)
        v[0, 0] = -0.0  # row 0 starts with an all-zero block: formats gives +0
        return v


class _Raises(_Exact):
    name = "fake-raises"

    def apply(self, layer, x, bias, act_global_scale=None):

        raise RuntimeError("kernel launch failed: no kernel image for this device")


class _DecodeOnly(_Exact):
    name = "fake-decode-only"
    min_m, max_m = 1, 16
    seen_m: list[int] = []

    def apply(self, layer, x, bias, act_global_scale=None):

        type(self).seen_m.append(x.shape[0])
        return super().apply(layer, x, bias, act_global_scale)


WRONG = {
    "one-ulp-beyond": (_OneUlpBeyond, r"y\[(\d+), 5\] = .+, want .+ ± "),
    "nan": (_NaN, r"y\[0, 3\] = nan, want "),
    "wrong-column": (_WrongColumn, r"y\[0, 7\] = "),
    "wrong-codes": (_WrongCodes, r"activation codes\[0, 1\] = "),
    "wrong-values": (_WrongValues, r"activation values\[0, 0\] = -0\.0, want 0\.0"),
    "raises": (_Raises, r"raised RuntimeError: kernel launch failed"),
}


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(dispatch, "_REGISTRY", {"linear": {"cuda": []}, "experts": {}})
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    monkeypatch.setattr(selftest, "_VERDICTS", {})
    monkeypatch.delenv(settings.SELFTEST.name, raising=False)
    monkeypatch.setattr(logging.getLogger("vllm_mxplus"), "propagate", True)


def _spec(dtype: torch.dtype, scheme: str = "mxfp4-mbs") -> LinearSpec:
    return LinearSpec(scheme=scheme, n=4096, k=4096, out_dtype=dtype)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("wrong", list(WRONG), ids=list(WRONG))
def test_wrong_kernel_rejected_next_candidate_serves(fresh, caplog, wrong, dtype):
    cls, pattern = WRONG[wrong]
    register_backend("cuda", cls)
    register_backend("cuda", _AtTheBound)
    caplog.set_level(logging.INFO, logger="vllm_mxplus")
    chosen = select(_spec(dtype), "cuda", 90)
    assert [b.name for b in chosen] == ["fake-at-the-bound"]
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"{cls.name} REJECTED" in errors[0]
    assert re.search(pattern, errors[0]), errors[0]
    assert "K=320" in errors[0] or wrong == "raises"  # a partial macro block was tested


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("cls", [_Exact, _AtTheBound, _RightCodes], ids=lambda c: c.name)
def test_right_kernel_passes(fresh, cls, dtype):
    assert run_self_test(cls, _spec(dtype), CPU) is None


def test_verdict_cached_per_device_scheme_dtype(fresh, caplog):
    register_backend("cuda", _WrongColumn)
    caplog.set_level(logging.ERROR, logger="vllm_mxplus")
    _WrongColumn.runs = 0
    for _ in range(3):  # rejected; the reference serves a CUDA layer only when asked
        with pytest.raises(BackendUnavailable, match="fake-wrong-column: self-test failed"):
            select(_spec(torch.bfloat16), "cuda", 90)
    runs = _WrongColumn.runs
    assert runs > 0 and len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1
    with pytest.raises(BackendUnavailable):
        select(_spec(torch.float16), "cuda", 90)  # another dtype: tested again
    assert _WrongColumn.runs > runs


def test_env_zero_skips_the_self_test(fresh, monkeypatch):
    monkeypatch.setenv(settings.SELFTEST.name, "0")
    register_backend("cuda", _WrongColumn)
    _WrongColumn.runs = 0
    assert [b.name for b in select(_spec(torch.bfloat16), "cuda", 90)] == ["fake-wrong-column"]
    assert _WrongColumn.runs == 0


def test_rows_within_the_backend_range_only(fresh):
    _DecodeOnly.seen_m = []
    assert run_self_test(_DecodeOnly, _spec(torch.bfloat16), CPU) is None
    assert _DecodeOnly.seen_m == [1, 3, 16] * 2  # random data, then the exact data


def test_non_kernel_backends_are_not_self_tested(fresh):
    class _NotKernel(_WrongColumn):
        name, kernel = "fake-not-kernel", False

    register_backend("cuda", _NotKernel)
    assert [b.name for b in select(_spec(torch.bfloat16), "cuda", 90)] == ["fake-not-kernel"]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("scheme", list(SCHEMES), ids=list(SCHEMES))
def test_reference_backend_meets_the_bound(scheme, dtype):
    """The bound holds for a real fp32 GEMM (torch's order, not float64): not too tight."""
    assert run_self_test(ReferenceBackend, _spec(dtype, scheme), CPU) is None


@pytest.fixture(scope="module")
def cpu_packed():
    from vllm_mxplus.backends.cpu import kernels as cpu_kernels
    from vllm_mxplus.backends.cpu.linear import CpuPackedBackend

    ok, why = cpu_kernels.load()
    if not ok:
        pytest.skip(f"CPU kernels unavailable: {why}")

    class _WithActivation(CpuPackedBackend):
        """cpu-packed exposing its C++ activation fake-quant for the bit-exact check."""

        def selftest_activation(self, x):

            spec = self.spec
            return cpu_kernels.act_fake_quant(x, spec.activation_format, spec.macro_block)

    return _WithActivation


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(
    "scheme", ["mxfp4-ocp", "mxfp4-16-oas", "mxfp4-mbs-s", "mxfp4-mbs", "mxplus"]
)
def test_real_cpu_kernels_pass(cpu_packed, scheme, dtype):
    assert run_self_test(cpu_packed, _spec(dtype, scheme), CPU) is None


@pytest.fixture(scope="module")
def triton_decode(triton_device):
    """The Triton decode backend, a self-tested kernel that exposes its activation codes
    (interpreter off-GPU, compiled kernels on CUDA)."""
    from vllm_mxplus.backends.triton.linear import TritonDecodeBackend

    return TritonDecodeBackend, triton_device


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("scheme", ["mxfp4-ocp", "mxfp4-mbs"])
def test_triton_decode_kernels_pass(triton_decode, scheme, dtype):
    cls, device = triton_decode
    assert run_self_test(cls, _spec(dtype, scheme), device) is None


# ----------------------------------------------------------------------------- exact data
@pytest.mark.parametrize(
    "scheme,macro_block",
    [(s, 128) for s in SCHEMES] + [("mxfp4-mbs", 32), ("mxfp4-mbs-s", 256)],
)
def test_exact_data_is_lossless_and_every_partial_sum_exact(scheme, macro_block):
    """selftest.exact_operands, every scheme: quantization is lossless (MBS bytes 0), every
    product of an output is an integer number of one unit and, per 128-K chunk, the sum of
    their magnitudes stays under 2^11 units (exact in a 13-bit accumulator in any order);
    and the low blocks are FP8 subnormals in the sm_90a re-encoding (E8M0 schemes)."""
    from vllm_mxplus.backends.cutlass.fp8_chunks import encode_fp8_chunks
    from vllm_mxplus.backends.selftest import exact_operands
    from vllm_mxplus.formats import get_scheme

    spec = LinearSpec(get_scheme(scheme, macro_block), 40, 320, torch.bfloat16)
    x, w = exact_operands(spec, 33, torch.Generator().manual_seed(1))
    for fmt, t, per_row in (
        (spec.weight_format, w, False),
        (spec.activation_format, x, spec.activation_per_row),
    ):
        q = quantize(t, fmt, macro_block=macro_block, per_row=per_row)
        assert torch.equal(q.dequantize(), t)
        assert q.mbs is None or not q.mbs.any()
    assert torch.equal(x.to(torch.bfloat16).float(), x)  # the bf16 input holds it exactly
    p = x[:, None, :].double() * w[None, :, :].double()
    unit = torch.where(p != 0, p.abs(), torch.inf).amin(-1, keepdim=True)
    units = p / unit
    assert torch.equal(units, units.round())
    chunks = torch.nn.functional.pad(units.abs(), (0, 384 - 320)).view(33, 40, 3, 128)
    assert chunks.sum(-1).max() < 2**11
    wf = get_scheme(scheme).weight
    if wf.block_size == 16 and wf.scale_is_e8m0 and macro_block == 128:  # the sm_90a path
        q = quantize(w, spec.weight_format, macro_block=macro_block)
        fp8 = encode_fp8_chunks(q.codes, q.scales, q.mbs, 320).fp8.float()
        assert ((fp8 != 0) & (fp8.abs() < 2.0**-6)).any()  # FP8 subnormals present


def test_cutlass_accumulator_bits_per_architecture(monkeypatch):
    """sm_90a's FP8 MMA is held to 13 bits, sm_100a's FP4 MMA to fp32's 24."""
    from vllm_mxplus.backends.cutlass import linear as cutlass_linear
    from vllm_mxplus.backends.selftest import accumulator_bits_of

    cls = cutlass_linear.CutlassPrefillBackend
    for arch, bits in (("sm90a", 13), ("sm100a", 24), (None, 13)):
        monkeypatch.setattr(cutlass_linear, "arch_of", lambda device, a=arch: a)
        assert accumulator_bits_of(cls, torch.device("cuda")) == bits
    assert accumulator_bits_of(_Exact, CPU) == 24
