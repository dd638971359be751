"""gpt-oss experts: the clamped, interleaved `swigluoai` activation and expert biases, per
expert backend, against a float64 reference written from the formula.

swigluoai(g|u) with gate g in the even and up u in the odd columns of w13's output:
    g = min(g, limit); u = clamp(u, -limit, limit); h = (u + 1) * g * sigmoid(alpha * g)
(vLLM 0.32's SwigluOAIAndMul, alpha 1.702, limit 7.0). Biases: g|u = Q(x) Ŵ13ᵀ + b13,
y = Q(h) Ŵ2ᵀ + b2, out = Σ_k w_k y_k.

The layer test follows the expert self-test's construction (selftest_experts.py): x and w13
on the formats' grids, so stage 1 (and, with biases on a coarse dyadic grid, g|u + b13) is
exact for every correct backend; h is then the formula's value, quantized by
`vllm_mxplus.formats` (codes bit for bit), and stage 2 is held to the linear bound of
docs/numerics.md. w13 is scaled by 2^-4 so that g|u straddles the clamp limit.
"""

from __future__ import annotations

import math
import shutil
import types

import pytest
import torch

from vllm_mxplus.backends.base import ExpertBackend, ExpertSpec, ExpertWeights
from vllm_mxplus.backends.expert_layer import (
    SWIGLUOAI_ALPHA,
    SWIGLUOAI_LIMIT,
    SwigluOAI,
    expert_activation,
)
from vllm_mxplus.backends.reference.experts import ReferenceExperts
from vllm_mxplus.backends.selftest_experts import _grid_rows, _quantized, expected_layer
from vllm_mxplus.formats import fake_quantize, get_scheme, quantize

SCHEMES = ["mxfp4-ocp", "mxplus", "mxfp4-16-oas", "mxfp4-mbs-s", "mxfp4-mbs", "nvfp4"]
E, TOPK, H, INTER = 4, 2, 128, 96  # INTER: K of the down GEMM, a partial macro block
W13_SCALE = 2.0**-4  # g|u ~ the clamp limit (a power of two: the grid stays a grid)
BIAS_STEP = 2.0**-6  # b13 on this grid: g|u + b13 stays exact in fp32


def swigluoai64(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """The formula in float64, element by element from the definition."""
    gu = gate_up.double()
    g, u = gu[..., 0::2], gu[..., 1::2]
    g = torch.minimum(g, torch.full_like(g, limit))
    u = torch.maximum(torch.minimum(u, torch.full_like(u, limit)), torch.full_like(u, -limit))
    return (u + 1) * g / (1 + torch.exp(-alpha * g))


# ------------------------------------------------------------------------ the activation
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swigluoai_matches_float64_formula(dtype):
    gen = torch.Generator().manual_seed(0)
    gu = (torch.randn(33, 2 * 160, generator=gen) * 6).to(dtype)  # many beyond +-7
    gu[0, :8] = torch.tensor([50.0, 50.0, -50.0, -50.0, 7.0, 7.0, -7.0, -7.0], dtype=dtype)
    h = SwigluOAI()(gu)
    assert h.dtype == dtype and h.shape == (33, 160)
    want = swigluoai64(gu, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT)
    # A handful of roundings (3 products, 1 sum, sigmoid) of the formula's value, plus the
    # rounding of alpha * g, which exp magnifies |alpha * g| times; results below the
    # normal range round absolutely.
    u = torch.finfo(dtype).eps / 2
    ag = SWIGLUOAI_ALPHA * gu.double()[:, 0::2].clamp(max=SWIGLUOAI_LIMIT).abs()
    tol = (8 + ag) * u * want.abs() + torch.finfo(dtype).tiny
    err = (h.double() - want).abs()
    assert bool((err <= tol).all()), f"max err {err.max().item()} (tol {tol.max().item()})"
    # the clamp: gate 50 acts as 7 (up 50 as 7); gate -50 is not clamped below
    assert h[0, 0].item() == pytest.approx(8 * 7 / (1 + math.exp(-SWIGLUOAI_ALPHA * 7)), rel=4 * u)
    assert abs(h[0, 1].item()) < 1e-30  # -50 * sigmoid(-85) * (-6): underflows
    # the interleave matters: the halves read as gate | up give other numbers
    g, u_ = gu.chunk(2, dim=-1)
    assert not torch.equal(SwigluOAI()(torch.stack([g, u_], -1).flatten(-2)), h)


def test_swigluoai_is_vllms_own():
    """Bit for bit vLLM's SwigluOAIAndMul.forward_native (its CPU / reference path) on the
    same fp32 and bf16 inputs, at the defaults and at a layer's own alpha / limit."""
    from vllm.model_executor.layers.activation import SwigluOAIAndMul

    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        gu = (torch.randn(17, 64, generator=gen) * 8).to(dtype)
        for alpha, limit in ((None, None), (1.5, 5.0)):
            ours = expert_activation("swigluoai", alpha, limit)
            a = SWIGLUOAI_ALPHA if alpha is None else alpha
            lim = SWIGLUOAI_LIMIT if limit is None else limit
            theirs = SwigluOAIAndMul.forward_native(types.SimpleNamespace(alpha=a, limit=lim), gu)
            assert ours is not None and torch.equal(ours(gu), theirs)


def test_other_activations_unchanged_and_unknown_refused():
    assert expert_activation("silu") is torch.nn.functional.silu
    assert expert_activation("relu2_no_mul") is None


# ------------------------------------------------------------------------- the layer
def _backends() -> list[type[ExpertBackend]]:
    out: list[type[ExpertBackend]] = [ReferenceExperts]
    if shutil.which("c++"):
        from vllm_mxplus.backends.cpu.experts import CpuPackedExperts

        out.append(CpuPackedExperts)
    return out


class _Problem:
    """One gpt-oss expert layer on the formats' grids (module docstring)."""

    def __init__(self, scheme: str, seed: int = 0):
        self.scheme = get_scheme(scheme)
        self.spec = ExpertSpec(self.scheme, activation="swigluoai", has_bias=True)
        gen = torch.Generator().manual_seed(seed)
        fmt, afmt = self.scheme.weight, self.scheme.activation
        self.nvfp4 = fmt.has_global_scale or afmt.has_global_scale
        w13 = _grid_rows(E * 2 * INTER, H, fmt.block_size, self.nvfp4, gen) * W13_SCALE
        self.w13 = w13.reshape(E, 2 * INTER, H)
        self.w2 = torch.randn(E, H, INTER, generator=gen) * 0.1
        self.b13 = torch.randint(-64, 65, (E, 2 * INTER), generator=gen) * BIAS_STEP
        self.b2 = torch.randn(E, H, generator=gen) * 0.05
        self.q = {"w13": _quantized(self.w13, self.spec), "w2": _quantized(self.w2, self.spec)}
        self.hat = {
            "w13": self.q["w13"].dequantize().reshape(self.w13.shape),
            "w2": self.q["w2"].dequantize().reshape(self.w2.shape),
        }
        assert torch.equal(self.hat["w13"], self.w13), "w13 off the grid (a test bug)"
        self.gen = gen

    def inputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        afmt = self.scheme.activation
        x = _grid_rows(m, H, afmt.block_size, self.nvfp4, self.gen)
        ids = torch.stack([torch.randperm(E - 1, generator=self.gen)[:TOPK] for _ in range(m)])
        wts = torch.softmax(torch.randn(m, TOPK, generator=self.gen), -1)
        return x, ids.to(torch.int32), wts

    def run(
        self, cls: type[ExpertBackend], x, ids, wts, activation=None, biases: bool = True
    ) -> torch.Tensor:
        backend = cls(self.spec)
        layer = torch.nn.Module()
        layer.expert_map = None
        layer.mxplus_row_global_scale = None
        if biases:
            layer.w13_bias, layer.w2_bias = self.b13, self.b2
        backend.process_weights_after_loading(
            layer,
            ExpertWeights(
                quantized=lambda stem: (self.q[stem], E), dequantized=lambda stem: self.hat[stem]
            ),
        )
        return backend.apply(layer, x, wts, ids, activation or SwigluOAI())

    def want(self, x, ids, wts) -> tuple[torch.Tensor, torch.Tensor]:
        """(out64, bound): the float64 layer from the formula and its error bound."""
        afmt = self.scheme.activation
        per_row = afmt.has_global_scale
        assert torch.equal(fake_quantize(x, afmt.name, per_row=per_row), x), "x off the grid"

        def swigluoai_biased(e: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
            gu = gu + self.b13[e].double()
            assert torch.equal(gu.float().double(), gu), "g|u + b13 not exact (a test bug)"
            h = swigluoai64(gu, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT).float()
            # the codes of h: the formula's fp32 value and the activation's, bit for bit
            q_act = quantize(SwigluOAI()(gu.float()), afmt.name, per_row=per_row)
            q_formula = quantize(h, afmt.name, per_row=per_row)
            assert torch.equal(q_act.codes, q_formula.codes)
            assert torch.equal(q_act.scales, q_formula.scales)
            return h

        return expected_layer(x, ids, wts, self.hat, self.spec, swigluoai_biased, w2_bias=self.b2)


@pytest.mark.parametrize("backend", _backends(), ids=lambda c: c.name)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_expert_layer_matches_float64_formula(backend, scheme):
    p = _Problem(scheme)
    clamped = 0
    for m in (1, 5, 33):
        x, ids, wts = p.inputs(m)
        y = p.run(backend, x, ids, wts)
        assert y.dtype == torch.float32 and y.shape == (m, H)
        want, bound = p.want(x, ids, wts)
        err = (y.double() - want).abs()
        assert bool((err <= bound).all()), f"M={m}: max err {err.max()} vs bound {bound.max()}"
        gu = torch.einsum("mk,mnk->mn", x, p.w13[ids[:, 0].long()])
        clamped += int((gu.abs() > SWIGLUOAI_LIMIT).sum())
    assert clamped > 0  # the clamp is exercised


@pytest.mark.parametrize("backend", _backends(), ids=lambda c: c.name)
def test_the_bound_catches_halves_or_missing_biases(backend):
    """The test can fail: gate | up read as halves, or the biases left out, leave it."""

    class Halves:
        takes_gate_up = True

        def __call__(self, gu: torch.Tensor) -> torch.Tensor:
            g, u = gu.chunk(2, dim=-1)
            return SwigluOAI()(torch.stack([g, u], -1).flatten(-2))

    p = _Problem("mxfp4-mbs", seed=3)
    x, ids, wts = p.inputs(5)
    want, bound = p.want(x, ids, wts)
    for kw in ({"activation": Halves()}, {"biases": False}):
        y = p.run(backend, x, ids, wts, **kw)
        assert not bool(((y.double() - want).abs() <= bound).all()), kw


# ------------------------------------------------------------------- backend selection
def test_cpu_and_reference_experts_take_gpt_oss_layers():
    spec = ExpertSpec(get_scheme("nvfp4"), activation="swigluoai", has_bias=True)
    assert ReferenceExperts.can_implement(spec)[0]
    from vllm_mxplus.backends.cpu.experts import CpuPackedExperts

    assert CpuPackedExperts.can_implement(spec)[0]
