"""The self-tests fail a wrong kernel: each injected fault is rejected (mutation tests, CPU).

Linears: a fake backend with the sm_90a CUTLASS GEMM's arithmetic (operands re-encoded as
FP8 per (row, 128-K chunk) by `fp8_chunks.encode_fp8_chunks`, each chunk summed in a 14-bit
truncating accumulator and promoted to fp32 with its chunk scales, rows / columns the
encoding cannot hold recomputed exactly, as the fallback does), held to the CUTLASS
backend's 13 accumulator bits. Unfaulted it passes `selftest.run_self_test`; each fault
(a weight MBS byte +-1, an all-zero output, FP8 subnormals flushed to zero, one weight block
scale one binade off, one 16 x 16 output tile transposed) makes it fail. Random data alone
would not catch them all within the 13-bit bound: the exact-by-construction check
(`selftest.run_exact_check`, bit for bit) does.

Experts: `selftest_experts.run_expert_self_test` driven through a fake expert backend (the
reference experts on weights or outputs with the same faults).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vllm_mxplus.backends.base import ExpertSpec, ExpertWeights, LinearBackend, LinearSpec
from vllm_mxplus.backends.cutlass.fp8_chunks import CHUNK, encode_fp8_chunks
from vllm_mxplus.backends.reference.experts import ReferenceExperts
from vllm_mxplus.backends.selftest import check_output, run_exact_check, run_self_test
from vllm_mxplus.backends.selftest_experts import run_expert_self_test
from vllm_mxplus.formats import QuantizedTensor, get_scheme, quantize

CPU = torch.device("cpu")
FP8_MIN_NORMAL = 2.0**-6  # E4M3's smallest normal
KEPT_BITS = 14  # Hopper's FP8 MMA accumulator, truncating (docs/numerics.md)
LINEAR_FAULTS = ["mbs+1", "mbs-1", "zero", "flush_subnormals", "scale_off", "transposed_tile"]


def _faulted_weight(q: QuantizedTensor, fault: str | None) -> QuantizedTensor:
    """q with a weight fault: MBS byte [0, 0] +-1 (mod 256), or block scale [0, 1] + 1."""
    if fault in ("mbs+1", "mbs-1"):
        assert q.mbs is not None, "an MBS fault needs an MBS weight"
        mbs = q.mbs.clone()
        mbs[0, 0] = (mbs[0, 0].to(torch.int32) + (1 if fault == "mbs+1" else -1)) % 256
        return dataclasses.replace(q, mbs=mbs)
    if fault == "scale_off":
        scales = q.scales.clone()
        scales[0, 1] += 1
        return dataclasses.replace(q, scales=scales)
    return q


def _faulted_output(y: torch.Tensor, fault: str | None) -> torch.Tensor:
    if fault == "zero":
        return torch.zeros_like(y)
    if fault == "transposed_tile" and y.shape[0] >= 16 and y.shape[1] >= 16:
        y = y.clone()
        y[:16, :16] = y[:16, :16].T.clone()
    return y


def _truncate(v: torch.Tensor, bits: int) -> torch.Tensor:
    """v (float64) with its significand truncated to `bits` bits (toward zero)."""
    m, e = torch.frexp(v)
    return torch.ldexp(torch.trunc(m * 2.0**bits) / 2.0**bits, e)


class _Sm90Emulated(LinearBackend):
    """The sm_90a CUTLASS prefill GEMM's arithmetic on CPU (module docstring)."""

    name = "fake-sm90-emulated"
    kernel = True
    accumulator_bits = 13  # as CutlassPrefillBackend on sm_90a
    accumulation_chunk = 128  # promoted into fp32 per 128-K chunk, as it is
    fault: str | None = None

    @classmethod
    def is_supported(cls, platform: str, capability: int | None) -> tuple[bool, str]:
        return True, ""

    def process_weights_after_loading(self, layer, qweight: QuantizedTensor) -> None:
        layer.fake_q = _faulted_weight(qweight, self.fault)

    def apply(self, layer, x, bias, act_global_scale=None):
        spec, q = self.spec, layer.fake_q
        k = spec.k
        qx = quantize(x.to(torch.float32), spec.activation_format, macro_block=spec.macro_block)
        xl = encode_fp8_chunks(qx.codes, qx.scales, qx.mbs, k)
        wl = encode_fp8_chunks(q.codes, q.scales, q.mbs, k)
        a, b = xl.fp8.to(torch.float64), wl.fp8.to(torch.float64)
        if self.fault == "flush_subnormals":
            a = torch.where(a.abs() < FP8_MIN_NORMAL, 0.0, a)
            b = torch.where(b.abs() < FP8_MIN_NORMAL, 0.0, b)
        m, n = x.shape[0], spec.n
        y = torch.zeros(m, n, dtype=torch.float32)
        for c in range(xl.scale.shape[0]):
            acc = torch.zeros(m, n, dtype=torch.float64)
            for j in range(c * CHUNK, (c + 1) * CHUNK):
                acc = _truncate(acc + a[:, j, None] * b[None, :n, j], KEPT_BITS)
            sig = xl.scale[c][:, None] * wl.scale[c][None, :n]  # fp32, as the kernel
            y = y + acc.to(torch.float32) * sig
        # the exact fallback: rows / columns the FP8 layout cannot hold, from x_hat and W_hat
        exact64 = qx.dequantize().double() @ q.dequantize().double().T
        rows, cols = ~xl.exact_rows, ~wl.exact_rows[:n]
        y = torch.where(rows[:, None] | cols[None, :], exact64.to(torch.float32), y)
        if bias is not None:
            y = y + bias.to(torch.float32)
        return _faulted_output(y.to(spec.out_dtype), self.fault)


def _linear_spec(scheme: str, dtype=torch.bfloat16) -> LinearSpec:
    return LinearSpec(get_scheme(scheme), 40, 320, dtype)


@pytest.fixture
def emulated():
    yield _Sm90Emulated
    _Sm90Emulated.fault = None


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-16-oas"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_emulated_sm90_passes_unfaulted(emulated, scheme, dtype):
    """The control: the emulation of a correct sm_90a kernel passes the whole self-test."""
    assert run_self_test(emulated, _linear_spec(scheme, dtype), CPU) is None


@pytest.mark.parametrize("fault", LINEAR_FAULTS)
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-16-oas"])
def test_every_fault_fails_the_linear_self_test(emulated, scheme, fault):
    if fault.startswith("mbs") and not get_scheme(scheme).weight.mbs:
        pytest.skip("no MBS bytes in this scheme's weights")
    emulated.fault = fault
    failure = run_self_test(emulated, _linear_spec(scheme), CPU)
    assert failure is not None, f"{fault} passed the self-test"


@pytest.mark.parametrize("fault", ["mbs+1", "zero", "flush_subnormals"])
def test_random_data_alone_misses_faults_the_exact_check_catches(emulated, fault):
    """Why the exact check: at K = 320 against the 13-bit bound, random data (the self-test's
    first part) passes a weight MBS byte off by one and flushed subnormals (none in its data);
    the exact data catches each. An all-zero output at K = 4096 passed the bound of one 13-bit
    accumulator over all K; the chunked bound (fp32 across 128-K chunks) rejects it."""
    spec = _linear_spec("mxfp4-mbs", torch.float32)
    if fault == "zero":  # at K = 4096 the 13-bit bound admits an all-zero y
        spec = dataclasses.replace(spec, k=4096)
    emulated.fault = fault
    backend = emulated(spec)
    layer = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    w = torch.randn(spec.n, spec.k, generator=g)
    x = torch.randn(33, spec.k, generator=g)
    qw = quantize(w, spec.weight_format)
    backend.process_weights_after_loading(layer, qw)
    y = backend.apply(layer, x, None)
    w_hat = qw.dequantize().double()
    bits, chunk = emulated.accumulator_bits, emulated.accumulation_chunk
    if fault == "zero":
        assert check_output(y, x, w_hat, None, spec, bits) is None  # one accumulator: admitted
        assert check_output(y, x, w_hat, None, spec, bits, chunk) is not None
    else:
        assert check_output(y, x, w_hat, None, spec, bits, chunk) is None
    assert run_exact_check(backend, spec, [1, 33], CPU) is not None


# ----------------------------------------------------------------------------- experts
EXPERT_FAULTS = ["mbs+1", "mbs-1", "zero", "scale_off", "transposed_tile"]


class _FaultyExperts(ReferenceExperts):
    """The reference experts (fp32 weights) with a fault in the w2 weight (its
    QuantizedTensor: MBS byte, block scale, FP8-subnormal elements flushed) or the output."""

    name = "fake-faulty-experts"
    kernel = True
    fault: str | None = None

    def process_weights_after_loading(self, layer, weights: ExpertWeights) -> None:
        fault = self.fault

        def dequantized(stem: str) -> torch.Tensor:
            hat = weights.dequantized(stem)
            if stem != "w2" or fault not in ("mbs+1", "mbs-1", "scale_off", "flush_subnormals"):
                return hat
            q, _ = weights.quantized(stem)
            if fault == "flush_subnormals":
                lay = encode_fp8_chunks(q.codes, q.scales, q.mbs, q.shape[-1])
                v = lay.fp8.to(torch.float32)[:, : q.shape[-1]]
                sub = (v != 0) & (v.abs() < FP8_MIN_NORMAL)
                return torch.where(sub.reshape(hat.shape), 0.0, hat)
            return _faulted_weight(q, fault).dequantize(torch.float32).reshape(hat.shape)

        super().process_weights_after_loading(
            layer, ExpertWeights(quantized=weights.quantized, dequantized=dequantized)
        )

    def apply(self, layer, x, topk_weights, topk_ids, act):
        y = super().apply(layer, x, topk_weights, topk_ids, act)
        return _faulted_output(y, self.fault)


@pytest.fixture
def faulty_experts():
    yield _FaultyExperts
    _FaultyExperts.fault = None


def test_fake_experts_pass_unfaulted(faulty_experts):
    assert run_expert_self_test(faulty_experts, ExpertSpec(get_scheme("mxfp4-mbs")), CPU) is None


@pytest.mark.parametrize("fault", EXPERT_FAULTS)
def test_every_fault_fails_the_expert_self_test(faulty_experts, fault):
    faulty_experts.fault = fault
    failure = run_expert_self_test(faulty_experts, ExpertSpec(get_scheme("mxfp4-mbs")), CPU)
    assert failure is not None, f"{fault} passed the expert self-test"


def test_expert_self_test_data_holds_no_fp8_subnormal(faulty_experts):
    """The gap, stated: selftest_experts' data (w2 rows of one scale each, stage-1 blocks over
    2 binades) has no element that the sm_90a FP8 encoding would make subnormal, so flushing
    FP8 subnormals changes nothing there and cannot be caught by it. (Experts run the Triton
    grouped GEMM, which has no FP8 encoding; the linear self-test's exact data holds such
    elements and catches the flush: test_every_fault_fails_the_linear_self_test.) When that
    data changes to hold some, this test fails: move the fault into EXPERT_FAULTS."""
    faulty_experts.fault = "flush_subnormals"
    assert run_expert_self_test(faulty_experts, ExpertSpec(get_scheme("mxfp4-mbs")), CPU) is None
