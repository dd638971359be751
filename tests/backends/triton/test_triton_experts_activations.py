"""`triton-grouped` experts with every expert activation and expert biases, every scheme, under
the interpreter here, against the float64 layer of `selftest_experts.expected_layer` (the
construction the CPU experts' gpt-oss tests use).

The problem is built so that stage 1 is exact for any correct backend: x and w13 on the
formats' grids (`selftest_experts._grid_rows`, w13 scaled by 2^-4 so that g|u straddles
swigluoai's clamp limit 7), w13 biases on the grid 2^-6 * [-64, 64]; so g|u + b13 is exact
in fp32 and its cast to the model dtype, and the activation computed from it by the same torch
function (`expert_layer.gated`), have the same bits in the kernel path and in the reference.
Q(h) is then the spec's quantization of identical values, and each expert's down GEMM (+ b2)
is held to the linear bound of docs/numerics.md ("Kernel numerics and error bounds":
`checks.output_bound`, K = INTER, the bias and the model-dtype cast included), the top-k
combine to its fp32 summation and final-cast terms (`expected_layer`'s docstring). No
tolerance is loosened beyond that bound; in bf16 the bound carries bf16's own rounding of
y_k and of the output.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_experts import SCHEMES  # tests/backends/triton, on sys.path

from vllm_mxplus.backends.base import ExpertSpec, ExpertWeights
from vllm_mxplus.backends.expert_layer import EXPERT_ACTIVATIONS, expert_activation, gated
from vllm_mxplus.backends.selftest_experts import (
    BIAS_STEP,
    W13_SCALE,
    _grid_rows,
    _quantized,
    expected_layer,
)
from vllm_mxplus.formats import get_scheme

ACTIVATIONS = ["silu", "gelu", "swigluoai"]
E, H, INTER, TOPK = 4, 64, 32, 2  # small: the interpreter runs every program in Python
SWIGLUOAI_LIMIT = 7.0


class _Problem:
    """One expert layer on the formats' grids (module docstring), global experts `n_global`
    mapped to the E local ones by `expert_map` (None: all local)."""

    def __init__(self, scheme, activation: str, bias: bool, seed: int, expert_map=None):
        self.spec = ExpertSpec(scheme, activation=activation, has_bias=bias, device_type="cpu")
        gen = torch.Generator().manual_seed(seed)
        fmt, afmt = scheme.weight, scheme.activation
        self.nvfp4 = fmt.has_global_scale or afmt.has_global_scale
        self.block = afmt.block_size
        w13 = _grid_rows(E * 2 * INTER, H, fmt.block_size, self.nvfp4, gen) * W13_SCALE
        w2 = torch.randn(E, H, INTER, generator=gen) * 0.1
        self.q = {"w13": _quantized(w13.reshape(E, 2 * INTER, H), self.spec)}
        self.q["w2"] = _quantized(w2, self.spec)
        self.hat = {
            "w13": self.q["w13"].dequantize(torch.float32).reshape(E, 2 * INTER, H),
            "w2": self.q["w2"].dequantize(torch.float32).reshape(E, H, INTER),
        }
        assert torch.equal(self.hat["w13"].reshape(-1, H), w13), "w13 off the grid (test bug)"
        self.b13 = self.b2 = None
        if bias:
            self.b13 = torch.randint(-64, 65, (E, 2 * INTER), generator=gen) * BIAS_STEP
            self.b2 = torch.randn(E, H, generator=gen) * 0.05
        self.expert_map = expert_map
        self.n_global = E if expert_map is None else expert_map.numel()
        self.act = expert_activation(activation)
        self.gen = gen

    def inputs(self, m: int, dtype: torch.dtype):
        x = _grid_rows(m, H, self.block, self.nvfp4, self.gen)
        ids = torch.stack(
            [torch.randperm(self.n_global, generator=self.gen)[:TOPK] for _ in range(m)]
        ).to(torch.int32)
        wts = torch.softmax(torch.randn(m, TOPK, generator=self.gen), -1)
        return x.to(dtype), ids, wts

    def run(self, device, x, ids, wts) -> torch.Tensor:
        from vllm_mxplus.backends.triton.experts import TritonExperts

        backend = TritonExperts(self.spec)
        layer = torch.nn.Module()
        layer.expert_map = None if self.expert_map is None else self.expert_map.to(device)
        layer.mxplus_row_global_scale = None
        if self.b13 is not None:
            layer.w13_bias = self.b13.to(x.dtype).to(device)
            layer.w2_bias = self.b2.to(x.dtype).to(device)
        weights = ExpertWeights(
            quantized=lambda stem: (self.q[stem].to(device), E),
            dequantized=lambda stem: self.hat[stem].to(device),
        )
        backend.process_weights_after_loading(layer, weights)
        return backend.apply(layer, x.to(device), wts.to(device), ids.to(device), self.act)

    def want(self, x, ids, wts):
        """(out64, bound, g|u + b13 of every pair) of the float64 layer (module docstring)."""
        dtype = x.dtype
        local = ids.long() if self.expert_map is None else self.expert_map[ids.long()]
        b13 = None if self.b13 is None else self.b13.to(dtype).double()
        seen = []

        def h(e: torch.Tensor, gu64: torch.Tensor) -> torch.Tensor:
            gu = gu64 if b13 is None else gu64 + b13[e]
            # exact in fp32 (the kernel's sum), so both sides round the same value to dtype
            assert torch.equal(gu.float().double(), gu), "g|u + b13 not exact (a test bug)"
            seen.append(gu)
            return gated(self.act, gu.to(dtype))

        b2 = None if self.b2 is None else self.b2.to(dtype)
        out, bound = expected_layer(
            x.float(), local, wts, self.hat, self.spec, h, w2_bias=b2, out_dtype=dtype
        )
        return out, bound, torch.cat(seen)


def _check(triton_device, scheme, macro, activation, bias, m, dtype=torch.float32, emap=None):
    p = _Problem(get_scheme(scheme, macro), activation, bias, seed=m + 7, expert_map=emap)
    x, ids, wts = p.inputs(m, dtype)
    y = p.run(triton_device, x, ids, wts)
    assert y.shape == (m, H) and y.dtype == dtype
    want, bound, gu = p.want(x, ids, wts)
    err = (y.double().cpu() - want).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"element {divmod(worst, H)}: |y - y64| = {err.view(-1)[worst]:.3g} > bound "
        f"{bound.view(-1)[worst]:.3g} (max |y64| {want.abs().max():.3g})"
    )
    return gu


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("scheme,macro", SCHEMES, ids=[f"{s}-{mb}" for s, mb in SCHEMES])
def test_every_activation_bias_and_scheme_within_bound(
    triton_device, scheme, macro, activation, bias
):
    """M = 5 (the decode row tile), fp32 model dtype: every combination."""
    gu = _check(triton_device, scheme, macro, activation, bias, m=5)
    if activation == "swigluoai":
        assert bool((gu.abs() > SWIGLUOAI_LIMIT).any()), "the clamp is not exercised"
        assert bool((gu.abs() < SWIGLUOAI_LIMIT).any())


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_prefill_tile_bf16_with_biases(triton_device, activation):
    """M = 40 (80 pairs: the prefill row tile), bf16 model dtype, biases; MBS-H at macro 32."""
    _check(triton_device, "mxfp4-mbs", 32, activation, True, m=40, dtype=torch.bfloat16)


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4"])
def test_expert_parallel_swigluoai_with_biases(triton_device, scheme):
    """EP: 6 global experts, 2 on another rank (-1); their pairs, biases included, contribute
    nothing (the float64 layer drops them)."""
    emap = torch.tensor([0, -1, 1, 2, -1, 3])
    _check(triton_device, scheme, 128, "swigluoai", True, m=9, emap=emap)


def test_gelu_tanh_is_served(triton_device):
    """vLLM's gelu_tanh (GeGLU with the tanh approximation) too: every EXPERT_ACTIVATIONS."""
    assert "gelu_tanh" in EXPERT_ACTIVATIONS
    _check(triton_device, "mxfp4-mbs", 128, "gelu_tanh", True, m=3)


def test_the_bound_catches_a_wrong_activation_or_a_dropped_bias(triton_device):
    """The check can fail: the same layer computed with gate | up read as halves, with silu
    for gelu, or without the w2 bias leaves the bound."""
    p = _Problem(get_scheme("mxfp4-mbs"), "swigluoai", True, seed=3)
    x, ids, wts = p.inputs(5, torch.float32)
    want, bound, _ = p.want(x, ids, wts)

    def outside(y: torch.Tensor) -> bool:
        return not bool(((y.double().cpu() - want).abs() <= bound).all())

    good = p.run(triton_device, x, ids, wts)
    assert not outside(good)

    swigluoai = p.act

    class Halves:
        takes_gate_up = True

        def __call__(self, gu: torch.Tensor) -> torch.Tensor:
            g, u = gu.chunk(2, dim=-1)
            return swigluoai(torch.stack([g, u], -1).flatten(-2))

    p.act = Halves()
    assert outside(p.run(triton_device, x, ids, wts))
    p.act = swigluoai
    p.b2 = torch.zeros_like(p.b2)
    assert outside(p.run(triton_device, x, ids, wts))
