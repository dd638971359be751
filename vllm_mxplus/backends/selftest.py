"""Self-test of a kernel backend at first use: a small problem through its real
`process_weights_after_loading` + `apply`, checked against `vllm_mxplus.formats`.

Kernels that were compiled but never run on a given GPU (or CPU) may be wrong. The first
time a backend with `kernel = True` is selected for a (device, scheme, dtype), `verdict` runs
one small linear (K = 320: two whole macro blocks and a partial one, unless the backend
cannot take it; M in {1, 3, 16, 17, 33} within the backend's range) and compares:

- activation quantization, where the backend exposes it (`selftest_activation`): codes,
  scales and MBS bytes (or the fake-quantized fp32 values) bit for bit with `formats`;
- the output y against y64 = x̂ Ŵᵀ + b computed in float64 from the fake-quantized operands
  (x̂ = formats.fake_quantize(x), Ŵ = the dequantized weight, both exact fp32 values), on
  random data (block scales spread, MBS factors exercised). With u = 2^-accumulator_bits
  (per device: `accumulator_bits_of`; 2^-24 for fp32), u_o the unit roundoff of the output
  dtype (bf16 2^-8, fp16 2^-11, fp32 2^-24) and A = |x̂| |Ŵ|ᵀ:
      |y - y64| <= γ A + 2 (u + u_o)(1 + u_o) R + t,   γ = (K + 8) u / (1 - (K + 8) u),
      R = |y64| + |b| + γ A,   t = one subnormal ulp of the output dtype.
  γ A bounds any fp32 summation order of K products, each allowed up to 8 further
  roundings (a reciprocal instead of the MBS division, σA·σB per 128-K chunk, scale
  products); the second term covers adding the bias and rounding to the output dtype, each
  possibly done twice (bias added before or after the cast); t covers outputs that round
  into the subnormal range. See docs/numerics.md, "Kernel numerics and error bounds".
- the output on EXACT data (`exact_operands`), bit for bit: x and w on the formats' grids
  (quantization lossless, MBS bytes 0), small codes (one +-6 per block, the others 0, +-0.5,
  +-1; x's +-6 and w's at different positions), block exponents alternating between 0 and
  -13 in opposite phase on x and w, so every product is a multiple of one unit and every
  partial sum, in any order, stays under 2^11 units: exact in the 13 bits Hopper's FP8 MMA
  keeps between promotions, in fp32, in integers. y64 is then exact and y must equal its one
  rounding to the output dtype. The -13 blocks make the sm_90a FP8 re-encoding hold FP8
  subnormals (flushing them changes y), and random data alone would pass a weight MBS byte
  off by one at K = 320, or an all-zero y at K = 4096, within the 13-bit bound.

A failure rejects the backend for that (device, scheme, dtype) with an ERROR log naming the
first differing element, and the selector moves to the next candidate. The verdict is cached
for the process; `VLLM_MXPLUS_SELFTEST=0` skips the self-test.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from vllm_mxplus import settings
from vllm_mxplus.backends.base import (
    Backend,
    ExpertBackend,
    ExpertSpec,
    LinearBackend,
    LinearSpec,
    Spec,
)
from vllm_mxplus.backends.checks import first_bit_difference, first_outside_bound, output_bound
from vllm_mxplus.backends.graph_guard import cuda_graph_replay_mismatch
from vllm_mxplus.backends.selftest_experts import run_expert_self_test
from vllm_mxplus.formats import QuantizedTensor, fake_quantize, get_format, quantize
from vllm_mxplus.formats.constants import E2M1_MAX, SMALL_BLOCK, ceil_div

logger = logging.getLogger(__name__)

# (N, K) of the test problem, first the one the backend can implement: K = 320 holds a
# partial macro block (320 = 2*128 + 64); N = 40 is not a multiple of 16 or 32.
SHAPES = ((40, 320), (48, 256))
TEST_MS = (1, 3, 16, 17, 33)  # decode sizes, the usual decode/prefill border, prefill

_VERDICTS: dict[tuple, tuple[bool, str]] = {}


def device_of(spec: Spec) -> torch.device:
    if spec.device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(spec.device_type)


def verdict(
    cls: type[Backend], spec: Spec, platform: str, capability: int | None
) -> tuple[bool, str]:
    """(True, "") when the backend passed its self-test for this (device, scheme, dtype;
    experts also their activation and biases),
    else (False, why). Runs the test the first time only (a linear problem for a linear
    backend, an MoE layer for an expert backend); logs a failure as an ERROR."""
    device = device_of(spec)
    key = (
        f"{cls.__module__}.{cls.__qualname__}",
        str(device),
        platform,
        capability,
        spec.scheme,
        getattr(spec, "out_dtype", None),
        # experts: the activation and the biases are part of what was tested
        getattr(spec, "activation", None),
        getattr(spec, "has_bias", None),
    )
    if key in _VERDICTS:
        return _VERDICTS[key]
    t0 = time.perf_counter()
    try:
        if isinstance(spec, LinearSpec) and issubclass(cls, LinearBackend):
            failure = run_self_test(cls, spec, device)
        elif isinstance(spec, ExpertSpec) and issubclass(cls, ExpertBackend):
            failure = run_expert_self_test(cls, spec, device)
        else:
            raise TypeError(f"{cls.name} ({cls.kind}) cannot be tested on a {spec.kind} spec")
    except Exception as e:  # a kernel that cannot run is as unusable as a wrong one
        failure = f"raised {type(e).__name__}: {e}"
    ms = 1e3 * (time.perf_counter() - t0)
    if failure is None:
        logger.info(
            "mxplus self-test: %s passed for %s, %s on %s (%.0f ms)",
            cls.name,
            spec.scheme,
            getattr(spec, "out_dtype", "experts"),
            device,
            ms,
        )
        result = (True, "")
    else:
        logger.error(
            "mxplus self-test: %s REJECTED for %s, %s on %s: %s. The next backend "
            "serves; please report this with the GPU / CPU model and versions "
            "(%s=0 skips the self-test).",
            cls.name,
            spec.scheme,
            getattr(spec, "out_dtype", "experts"),
            device,
            failure,
            settings.SELFTEST.name,
        )
        result = (False, f"self-test failed: {failure}")
    _VERDICTS[key] = result
    return result


def _test_spec(cls: type[LinearBackend], spec: LinearSpec) -> LinearSpec:
    for n, k in SHAPES + ((spec.n, spec.k),):
        small = dataclasses.replace(spec, n=n, k=k)
        if cls.can_implement(small)[0]:
            return small
    return spec


def _test_ms(cls: type[LinearBackend]) -> list[int]:
    lo, hi = cls.m_bounds()
    wanted = set(TEST_MS) | {lo} | ({hi} if hi else set())
    ms = sorted(m for m in wanted if m >= 1 and cls.supports_m(m))
    return ms or [lo]


def test_data(rows: int, k: int, gen: torch.Generator, lo: int, hi: int) -> torch.Tensor:
    """fp32 N(0, 1) values times 2^e per 16-block, e uniform in [lo, hi]: block scales spread
    over the exponent range, MBS factors exercised. Explicit device / dtype, because vLLM
    may call this under a default device / dtype context."""
    base = torch.randn(rows, k, generator=gen, device="cpu", dtype=torch.float32)
    e = torch.randint(lo, hi + 1, (rows, ceil_div(k, SMALL_BLOCK)), generator=gen, device="cpu")
    return base * torch.exp2(e.repeat_interleave(SMALL_BLOCK, dim=1)[:, :k].to(torch.float32))


EXACT_LOW = -13  # the low blocks' exponent: 13 binades under the others (FP8 subnormals)
EXACT_SMALL = (0.0, 0.5, 1.0)  # magnitudes of every element but the block's +-6
NVFP4_ROW_AMAX = 5.25  # 2688 * 2^-9: NVFP4's global scale amax / (6 * 448) is a power of two


def exact_operands(
    spec: LinearSpec, m: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [m, K], w [N, K]) fp32 for the exact check (module docstring): on the formats' grids,
    every partial sum of x̂ Ŵᵀ an integer number of one unit below 2^11 units.

    Per block (the format's block size): magnitudes from EXACT_SMALL and one E2M1_MAX (x at
    the block's element 0, w at element 1, so a product is at most 6 units of the block's
    scale), random signs; block exponents alternate 0, EXACT_LOW on x and EXACT_LOW, 0 on w
    (products all ~2^-13), NVFP4 0 and -3 (E4M3 block scales) with every value times
    NVFP4_ROW_AMAX / 6 (a power-of-two global scale); odd E8M0 weight rows without their
    EXACT_LOW blocks and their others at 2^0, 2^-1 in turn; rows times 2^r, r in [-2, 2]."""
    out = []
    for rows, fmt, at, phase in (
        (m, spec.activation_format, 0, 0),
        (spec.n, spec.weight_format, 1, 1),
    ):
        f = get_format(fmt)
        bs, k = f.block_size, spec.k
        nb = ceil_div(k, bs)
        mag = torch.tensor(EXACT_SMALL)[torch.randint(0, 3, (rows, nb * bs), generator=gen)]
        mag.view(rows, nb, bs)[:, :, at] = E2M1_MAX
        sign = torch.randint(0, 2, (rows, nb * bs), generator=gen) * 2.0 - 1
        low = (torch.arange(nb) + phase) % 2 == 1
        e = torch.where(low, -3.0 if f.has_global_scale else float(EXACT_LOW), 0.0)
        v = mag * sign * torch.exp2(e).repeat_interleave(bs)
        if phase and not f.has_global_scale:
            # odd weight rows: the low blocks zero and the others at 2^0 / 2^-1 in turn, so
            # a chunk's nonzero blocks lie within one binade (the packed-weight FP8 GEMM
            # serves such rows itself rather than its exact fallback) and several block
            # exponents meet in one chunk; products still ~2^-13 or 2^-14, under 2^11 of
            # the finer unit per chunk
            odd = v[1::2].view(-1, nb, bs)
            odd[:, low] = 0.0
            odd[:, ~low] *= torch.exp2(-((torch.arange(nb)[~low] // 2) % 2).float())[:, None]
        if f.has_global_scale:
            v = v * (NVFP4_ROW_AMAX / E2M1_MAX)
        r = torch.randint(-2, 3, (rows, 1), generator=gen).to(torch.float32)
        out.append((v * torch.exp2(r))[:, :k].contiguous())
    return out[0], out[1]


def accumulator_bits_of(cls: type[Backend], device: torch.device) -> int:
    """The backend's accumulator bits on `device`: `accumulator_bits_on(device)` where the
    class has it (per GPU architecture), else its `accumulator_bits`."""
    per_device = getattr(cls, "accumulator_bits_on", None)
    return int(per_device(device)) if per_device is not None else cls.accumulator_bits


def run_exact_check(
    backend: LinearBackend, spec: LinearSpec, ms: list[int], device: torch.device
) -> str | None:
    """The exact check (module docstring) at every M of `ms`: None, or what differed."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    x, w = exact_operands(spec, max(ms), gen)
    qw = quantize(w, spec.weight_format, macro_block=spec.macro_block)
    qx = quantize(x, spec.activation_format, macro_block=spec.macro_block,
                  per_row=spec.activation_per_row)  # fmt: skip
    for name, q, t in (("weight", qw, w), ("activation", qx, x)):
        lossless = torch.equal(q.dequantize(torch.float32), t)
        if not lossless or (q.mbs is not None and bool(q.mbs.any())):
            return f"exact check: the {name} is not on its format's grid (a test bug)"
    layer = torch.nn.Module()
    backend.process_weights_after_loading(layer, qw.to(device))
    want = x.double() @ w.double().T  # exact: every partial sum is
    for m in ms:
        y = backend.apply(layer, x[:m].to(device=device, dtype=spec.out_dtype), None)
        failure = first_bit_difference("y", y, want[:m].to(spec.out_dtype))
        if failure:
            return f"M={m}, N={spec.n}, K={spec.k}, exact data: {failure}"
    return None


def run_self_test(cls: type[LinearBackend], spec: LinearSpec, device: torch.device) -> str | None:
    """None when the backend agrees with `formats` on the test problem, else what differed."""
    small = _test_spec(cls, spec)
    ms = _test_ms(cls)
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = test_data(max(ms), small.k, gen, -6, 6)
    x[0, :SMALL_BLOCK] = 0.0  # an all-zero block: code 0, zero elements
    x = x.to(device=device, dtype=small.out_dtype)
    w = test_data(small.n, small.k, gen, -5, 1).to(device)
    bias = torch.randn(small.n, generator=gen, device="cpu", dtype=torch.float32)
    bias = bias.to(device=device, dtype=small.out_dtype)
    qweight = quantize(w, small.weight_format, macro_block=small.macro_block)
    w_hat = qweight.dequantize(torch.float32).to(torch.float64)

    backend = cls(small)
    layer = torch.nn.Module()
    backend.process_weights_after_loading(layer, qweight)
    where = f"N={small.n}, K={small.k}"
    for m in ms:
        xm = x[:m]
        act = backend.selftest_activation(xm)
        if act is not None:
            failure = check_activation(act, xm, small)
            if failure:
                return f"M={m}, {where}: activation {failure}"
        y = backend.apply(layer, xm, bias)
        failure = check_output(
            y, xm, w_hat, bias, small, accumulator_bits_of(cls, device), cls.accumulation_chunk
        )
        if failure:
            return f"M={m}, {where}: {failure}"
    failure = run_exact_check(backend, small, ms, device)
    if failure:
        return failure
    if device.type == "cuda":  # vLLM runs every linear inside CUDA graphs: capture + replay
        mg = max(ms)  # 33 for a prefill backend (above 16), the largest M it serves otherwise
        failure = cuda_graph_replay_mismatch(
            lambda t: backend.apply(layer, t, bias), x[:mg].clone(), x[:mg].flip(0).contiguous()
        )
        if failure:
            return f"M={mg}, {where}: {failure}"
    return None


def check_activation(act, x: torch.Tensor, spec: LinearSpec) -> str | None:
    """Compare a backend's activation quantization with `formats`, bit for bit."""
    fmt = spec.activation_format
    x32 = x.to(torch.float32)
    if isinstance(act, QuantizedTensor):
        q = quantize(x32, fmt, macro_block=spec.macro_block, per_row=spec.activation_per_row)
        for field in ("codes", "scales", "mbs"):
            failure = first_bit_difference(field, getattr(act, field), getattr(q, field))
            if failure:
                return failure
        return None
    want = fake_quantize(x32, fmt, macro_block=spec.macro_block, per_row=spec.activation_per_row)
    return first_bit_difference("values", act, want)


def check_output(
    y: torch.Tensor,
    x: torch.Tensor,
    w_hat64: torch.Tensor,
    bias: torch.Tensor | None,
    spec: LinearSpec,
    accumulator_bits: int = 24,
    chunk: int | None = None,
) -> str | None:
    """None when y is within `output_bound` (accumulator bits, chunk) of float64 x̂ Ŵᵀ + b
    everywhere, else the first element outside it (a NaN where a number is expected is
    outside)."""
    m = x.shape[0]
    if tuple(y.shape) != (m, spec.n) or y.dtype != spec.out_dtype:
        return f"y is {tuple(y.shape)} {y.dtype}, want {(m, spec.n)} {spec.out_dtype}"
    xq = fake_quantize(
        x.to(torch.float32),
        spec.activation_format,
        macro_block=spec.macro_block,
        per_row=spec.activation_per_row,
    )
    xq64, w64 = xq.to(torch.float64).cpu(), w_hat64.cpu()
    b64 = torch.zeros(spec.n, dtype=torch.float64) if bias is None else bias.to(torch.float64).cpu()
    y64 = xq64 @ w64.T + b64
    a = xq64.abs() @ w64.abs().T
    bound = output_bound(a, y64, b64, spec.k, spec.out_dtype, accumulator_bits, chunk)
    return first_outside_bound(y.to(torch.float64).cpu(), y64, bound, nan_ok=True)
