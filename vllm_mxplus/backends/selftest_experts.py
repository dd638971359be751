"""Self-test of an expert backend at first use: one small MoE layer through its real
`process_weights_after_loading` + `apply`, checked against `vllm_mxplus.formats`, with the
layer's own expert activation (`ExpertSpec.activation`: silu, gelu, gelu_tanh, swigluoai) and,
when the layer has them, expert biases: one test kind per activation, which a backend that
computes another activation (silu for gelu, gpt-oss's interleaved gate / up read as halves,
swigluoai without its clamp, its +1 or its alpha) or drops a bias fails
(tests/backends/test_selection_experts.py). Not gelu against its tanh approximation: they
differ by < 5e-4, which moves about one activation code in 10^4 on this data.

An MoE layer chains two GEMMs through an activation and a second activation quantization,
so a rounding difference in the first GEMM could flip a code of the second quantization and
no tight bound would hold. The test problem is built so that the first stage is EXACT for any
correct backend, and the second is checked within the linear self-test's bound:

1. Stage 1 is exact. Every activation and w13 block is on the format's grid (E2M1 values
   times a power of two, each block holding a +-6 element; for NVFP4 the row amax is
   5.25 * 2^j so the global scale is a power of two), so quantization is lossless (x̂ = x,
   Ŵ13 = w13, MBS bytes 0) and every product x̂ Ŵ13 is a dyadic number of at most 8
   significant bits. With block exponents in [-1, 1] (w13: [-5, -3], scaled by 2^-4 so that
   g|u straddles swigluoai's clamp limit; NVFP4: 0 and -4) and H = 128, every partial sum
   fits in 21 bits: any fp32 summation order gives the exact g|u. The w13 biases lie on the
   grid 2^-6 * [-64, 64], so g|u + b13 is exact in fp32 too, and its model-dtype cast is the
   same for every correct backend.
2. The activation, `expert_layer.gated(act, g|u)` in the model dtype, is computed for the
   expected value by the same torch function on the backend's device from identical
   operands (the backends compute it so), so h has the same bits; a backend computing any
   other function changes Q(h) by whole code steps, far outside stage 2's bound.
3. Stage 2, y_e = Q(h) Ŵ2[e]^T (+ b2[e]): Q(h) is the spec's quantization of identical
   values (`formats.fake_quantize`, per token), Ŵ2 the spec's dequantized weight (random
   data, scales spread), and y_e is compared in float64 within `checks.output_bound`
   (K = INTER, the bias included).
4. The combine out = sum_k w_k fp32(y_k) in fp32, then the model dtype: the error is at most
   sum_k |w_k| b_k + k u32 sum_k |w_k y_k| (summation) + u_o |out| (the final cast), with
   b_k the stage-2 bound of slot k (its cast to the model dtype, u_o, included); the test
   allows twice the summation term (the products w_k y_k round too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_mxplus.backends.base import Activation, ExpertBackend, ExpertSpec, ExpertWeights, Layer
from vllm_mxplus.backends.checks import first_outside_bound, output_bound
from vllm_mxplus.backends.expert_layer import expert_activation, gated
from vllm_mxplus.formats import fake_quantize, logical_amax, quantize, quantize_nvfp4_logical
from vllm_mxplus.formats.constants import E2M1_MAX

E, TOPK = 4, 2  # local experts (expert 3 gets no token), slots per token
H, INTER = 128, 96  # hidden size (one macro block), intermediate size (a partial macro block)
TEST_MS = (1, 5, 33)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_ROW_AMAX = 5.25  # 2688 * 2^-9: the global scale amax / (6 * 448) is 2^-9
W13_SCALE = 2.0**-4  # g|u around swigluoai's clamp limit 7 (a power of two: still a grid)
BIAS_STEP = 2.0**-6  # b13 on this grid, |b13| <= 1: g|u + b13 stays exact in fp32


def _grid_rows(rows: int, k: int, block: int, nvfp4: bool, gen: torch.Generator) -> torch.Tensor:
    """Rows on the format's grid: E2M1 values with a +-6 in every block, times 2^e per block
    (e in [-1, 1]); NVFP4: e = 0 and every value times 0.875 (row amax 5.25)."""
    grid = torch.tensor(E2M1_GRID)
    v = grid[torch.randint(0, len(grid), (rows, k), generator=gen)]
    v = v * (torch.randint(0, 2, (rows, k), generator=gen) * 2 - 1)
    nb = k // block
    at = torch.randint(0, block, (rows, nb), generator=gen) + torch.arange(nb) * block
    v.scatter_(1, at, E2M1_MAX * (torch.randint(0, 2, (rows, nb), generator=gen) * 2.0 - 1))
    if nvfp4:
        return v * (NVFP4_ROW_AMAX / E2M1_MAX)
    e = torch.randint(-1, 2, (rows, nb), generator=gen).to(torch.float32)
    return v * torch.exp2(e).repeat_interleave(block, dim=1)


def _quantized(w: torch.Tensor, spec: ExpertSpec):
    """All experts' rows [E*N, K] in the weight format (NVFP4: one global scale per expert's
    gate, up and down weight, as the FusedMoE method quantizes them)."""
    e, n, k = w.shape
    flat = w.reshape(e * n, k)
    if not spec.scheme.weight.has_global_scale:
        return quantize(flat, spec.weight_format, macro_block=spec.macro_block)
    parts = 2 if n == 2 * INTER else 1
    amax = logical_amax(w.reshape(e, parts, n // parts, k)).reshape(-1)
    return quantize_nvfp4_logical(flat, amax, [n // parts] * (e * parts))


def run_expert_self_test(
    cls: type[ExpertBackend], spec: ExpertSpec, device: torch.device
) -> str | None:
    """None when the backend agrees with `formats` on the test layer, else what differed."""
    activation = expert_activation(spec.activation)
    if activation is None:
        return f"no expert activation {spec.activation!r} to test (expert_layer.py)"
    gen = torch.Generator(device="cpu").manual_seed(0)
    fmt = spec.scheme.weight
    afmt = spec.scheme.activation
    nvfp4 = fmt.has_global_scale or afmt.has_global_scale
    w13 = _grid_rows(E * 2 * INTER, H, fmt.block_size, nvfp4, gen).reshape(E, 2 * INTER, H)
    w13 = w13 * W13_SCALE
    w2 = torch.randn(E, H, INTER, generator=gen) * torch.exp2(
        torch.randint(-3, 2, (E, H, 1), generator=gen).to(torch.float32)
    )
    biases = grid_biases(gen) if spec.has_bias else None
    q = {"w13": _quantized(w13, spec), "w2": _quantized(w2, spec)}
    hat = {
        s: q[s].dequantize(torch.float32).reshape(t.shape) for s, t in (("w13", w13), ("w2", w2))
    }
    if not torch.equal(hat["w13"], w13):
        return "test construction: w13 is not on the weight format's grid (a test bug)"
    weights = ExpertWeights(
        quantized=lambda stem: (q[stem].to(device), E),
        dequantized=lambda stem: hat[stem].to(device),
    )
    backend = cls(spec)
    layer: Layer = torch.nn.Module()
    layer.expert_map = None
    layer.mxplus_row_global_scale = None
    if biases is not None:
        layer.w13_bias, layer.w2_bias = (b.to(device) for b in biases)
    backend.process_weights_after_loading(layer, weights)
    for m in TEST_MS:
        x = _grid_rows(m, H, afmt.block_size, nvfp4, gen)
        xq = fake_quantize(
            x, afmt.name, macro_block=spec.macro_block, per_row=afmt.has_global_scale
        )
        if not torch.equal(xq, x):
            return f"M={m}: test construction: x is not on the activation grid (a test bug)"
        ids = (torch.arange(m * TOPK).reshape(m, TOPK) % (E - 1)).to(torch.int32)
        wts = torch.rand(m, TOPK, generator=gen)
        failure = _check(backend, layer, (x, ids, wts), hat, activation, biases, device)
        if failure:
            return f"{spec.activation} M={m}, E={E}, H={H}, INTER={INTER}: {failure}"
    return None


def grid_biases(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13_bias [E, 2I] on the grid BIAS_STEP * [-64, 64], w2_bias [E, H] random) in fp32."""
    b13 = torch.randint(-64, 65, (E, 2 * INTER), generator=gen) * BIAS_STEP
    return b13.to(torch.float32), torch.randn(E, H, generator=gen) * 0.05


def expected_layer(
    x: torch.Tensor,
    ids: torch.Tensor,
    wts: torch.Tensor,
    hat: dict[str, torch.Tensor],
    spec: ExpertSpec,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    accumulator_bits: int = 24,
    w2_bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, bound) in float64 for a layer whose stage 1 is exact (module docstring): out =
    sum_k w_k (Q(h_k) Ŵ2[e_k]^T (+ b2[e_k])), h_k = activation(e_k, x Ŵ13[e_k]^T in float64)
    in the model dtype out_dtype, Q the spec's activation quantization; bound the stage-2
    and combine bounds. ids are local experts; a pair of another rank's expert (-1, expert
    parallelism) contributes nothing."""
    m, h_dim = x.shape[0], hat["w2"].shape[1]
    want = torch.zeros(m, h_dim, dtype=torch.float64)
    summed = torch.zeros_like(want)
    bound = torch.zeros_like(want)
    afmt = spec.scheme.activation
    for slot in range(ids.shape[1]):
        local = ids[:, slot].long()
        e = local.clamp(min=0)
        gu = torch.einsum("mk,mnk->mn", x.double(), hat["w13"][e].double())
        h = activation(e, gu)
        hq = fake_quantize(
            h, afmt.name, macro_block=spec.macro_block, per_row=afmt.has_global_scale
        )
        w2 = hat["w2"][e].double()
        b2 = torch.zeros(m, h_dim, dtype=torch.float64) if w2_bias is None else w2_bias[e].double()
        y64 = torch.einsum("mk,mnk->mn", hq.double(), w2) + b2
        a = torch.einsum("mk,mnk->mn", hq.double().abs(), w2.abs())
        b = output_bound(a, y64, b2, w2.shape[-1], out_dtype, accumulator_bits)
        wk = wts[:, slot : slot + 1].double() * (local >= 0)[:, None]
        want += wk * y64
        summed += (wk * y64).abs()
        bound += wk.abs() * b
    u32 = torch.finfo(torch.float32).eps / 2
    u_out = torch.finfo(out_dtype).eps / 2
    bound += 2 * ids.shape[1] * u32 * summed
    bound += u_out * (want.abs() + bound)  # the final cast, of a value within bound of want
    return want, bound


def _check(
    backend: ExpertBackend,
    layer: Layer,
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    hat: dict[str, torch.Tensor],
    activation: Activation,
    biases: tuple[torch.Tensor, torch.Tensor] | None,
    device: torch.device,
) -> str | None:
    x, ids, wts = inputs
    y = backend.apply(layer, x.to(device), wts.to(device), ids.to(device), activation)
    if tuple(y.shape) != tuple(x.shape) or y.dtype != x.dtype:
        return f"output is {tuple(y.shape)} {y.dtype}, want {tuple(x.shape)} {x.dtype}"
    b13 = None if biases is None else biases[0].double()

    def h_on_device(e: torch.Tensor, gu64: torch.Tensor) -> torch.Tensor:
        """h from the exact g|u (+ b13, exact too) in the model dtype, by the activation on
        the backend's device (module docstring, step 2)."""
        gu = gu64 if b13 is None else gu64 + b13[e]
        return gated(activation, gu.to(x.dtype).to(device)).cpu()

    b2 = None if biases is None else biases[1]
    want, bound = expected_layer(
        x, ids, wts, hat, backend.spec, h_on_device, backend.accumulator_bits, w2_bias=b2
    )
    return first_outside_bound(y.double().cpu(), want, bound)
