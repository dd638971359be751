"""Grouped MoE experts on the GPU (`moe_gemm`, `triton-grouped`), under the interpreter here.

- `moe_align`: every local (token, slot) pair in exactly one row tile of its expert, no pair
  of another rank's expert anywhere, tiles padded with the sentinel, the capacity a bound
  from the shapes.
- The grouped GEMM (both stems) within the `mx_gemm` bound (docs/numerics.md, "Kernel
  numerics and error bounds"; test_triton_mx_gemm.py) of the float64 product per pair.
- The whole expert layer against `moe_experts_reference`: each GEMM output is in that bound
  before it is rounded to the model dtype; where two fp32 sums straddle a bf16 rounding
  boundary the rounded h differs by one ulp, which can move one element of Q_act(h) across
  a quantization threshold (one code step of its block). So the layers agree to
  rtol = atol / max = 2^-6, the tolerance of the CPU experts against the same reference
  (tests/backends/cpu/test_cpu_experts.py); here they agree exactly where the sums coincide.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_mxplus.formats import get_scheme, quantize

SCHEMES = [
    ("mxfp4-mbs", 128),
    ("mxfp4-mbs", 32),
    ("mxfp4-mbs-s", 16),
    ("mxfp4-16-oas", 128),
    ("mxfp4-ocp", 128),
    ("nvfp4", 128),
    ("mxplus", 128),
]
E, H, INTER, TOPK = 4, 64, 32, 2


def _packed(q, experts: int):
    from vllm_mxplus.backends.triton.linear import weight_operands
    from vllm_mxplus.backends.triton.moe_gemm import PackedExpertWeights

    codes, scales, extra, g = weight_operands(q)
    if scales.dtype == torch.float8_e4m3fn:
        scales = scales.view(torch.uint8)
    return PackedExpertWeights(codes, scales, extra, g, experts, q.shape[0] // experts, q.shape[-1])


def _quantizer(act_format: str, macro: int):
    from vllm_mxplus.backends.triton.gemm_ops import act_operands

    def quantize_rows(rows, g):
        c, s, extra, gs = act_operands(rows, act_format, macro, g)
        s = s.view(torch.uint8) if s.dtype == torch.float8_e4m3fn else s
        return c, s, extra, None if gs is None else gs.reshape(-1)

    return quantize_rows


def _layer(scheme: str, macro: int, m: int, seed: int, device):
    gen = torch.Generator().manual_seed(seed)
    s = get_scheme(scheme)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.2
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.2
    q13 = quantize(w13.reshape(E * 2 * INTER, H).to(device), s.weight_format, macro_block=macro)
    q2 = quantize(w2.reshape(E * H, INTER).to(device), s.weight_format, macro_block=macro)
    x = torch.randn(m, H, generator=gen).to(torch.bfloat16).to(device)
    tw, ti = torch.topk(torch.randn(m, E, generator=gen).softmax(-1), TOPK)
    return s, q13, q2, x, tw.to(device), ti.to(device)


def _formats(s) -> dict:
    """moe_experts_triton's format arguments for scheme s."""
    return {"weight": s.weight, "activation_mbs": bool(s.activation.mbs)}


# ----------------------------------------------------------------------------- moe_align
@pytest.mark.parametrize("m,block_m", [(1, 16), (5, 16), (40, 64), (40, 16)])
@pytest.mark.parametrize("ep", [False, True], ids=["all-local", "ep"])
def test_moe_align_places_every_local_pair_once(m, block_m, ep):
    from vllm_mxplus.backends.triton.moe_gemm import moe_align, moe_capacity

    gen = torch.Generator().manual_seed(m)
    n_global = 6
    ids = torch.stack([torch.randperm(n_global, generator=gen)[:TOPK] for _ in range(m)])
    emap = torch.tensor([0, -1, 1, 2, -1, 3]) if ep else None
    experts = 4 if ep else n_global
    pairs, tile_expert = moe_align(ids, emap, experts, block_m)
    p = m * TOPK
    assert pairs.dtype == tile_expert.dtype == torch.int32
    assert pairs.shape == (moe_capacity(p, experts, block_m),)
    assert tile_expert.shape == (pairs.shape[0] // block_m,)
    local = (emap[ids.reshape(-1)] if ep else ids.reshape(-1)).tolist()
    placed = pairs[pairs < p].tolist()
    assert sorted(placed) == [i for i in range(p) if local[i] >= 0]  # each once
    tiles = pairs.view(-1, block_m)
    for t, e in enumerate(tile_expert.tolist()):
        members = [q for q in tiles[t].tolist() if q < p]
        if e >= experts:
            assert not members  # tiles past the last expert hold only padding
        else:
            assert all(local[q] == e for q in members)
            assert members == sorted(members)  # stable: pair order kept within an expert


# ----------------------------------------------------------------------------- grouped GEMM
@pytest.mark.parametrize("scheme,macro", SCHEMES, ids=[f"{s}-{mb}" for s, mb in SCHEMES])
@pytest.mark.parametrize("m", [17, 160])
def test_grouped_gemm_within_bound(triton_device, scheme, macro, m):
    """moe_gemm for w13 (rows gathered per token, top-2) at M = 17 and 160 against the
    float64 product of each pair's token with its expert's weight; rows of pairs are
    computed once, in the tile of their expert. M = 160 (80 pairs per expert on average)
    takes the wide row tile where `moe_wide` allows it (code rows of 32 bytes: they
    vectorize; not under macro blocks of 16 / 32)."""
    from vllm_mxplus.backends.triton.moe_gemm import (
        MOE_WIDE_BLOCK_M,
        moe_align,
        moe_block_m,
        moe_gemm,
        moe_wide,
    )
    from vllm_mxplus.backends.triton.mx_gemm import GATHER_BLOCK_M, operand_format

    s, q13, q2, x, _, ti = _layer(scheme, macro, m, seed=1, device=triton_device)
    w = _packed(q13, E)
    fmt, bs = operand_format(s.weight_format)
    wide = moe_wide(w, _packed(q2, E), s.has_mbs, macro)
    assert wide == (not s.has_mbs or macro >= 64)
    block_m = moe_block_m(m * TOPK, E, wide)
    if m > 100:
        assert block_m == (MOE_WIDE_BLOCK_M if wide else GATHER_BLOCK_M)
    pairs, tile_expert = moe_align(ti, None, E, block_m)
    a = _quantizer(s.activation_format, macro)(x, None)
    y = moe_gemm(
        a, w, pairs, tile_expert, num_pairs=m * TOPK, topk=TOPK, out_dtype=torch.float32,
        fmt=fmt, has_mbs=s.has_mbs, block_size=bs, macro_block=macro, block_m=block_m,
    ).double().cpu()  # fmt: skip
    qx = quantize(x, s.activation_format, macro_block=macro, per_row=True)
    xh = qx.dequantize().double().cpu()
    wh = q13.dequantize().double().cpu().view(E, 2 * INTER, H)
    ids = ti.reshape(-1).cpu()
    xp = xh[torch.arange(m * TOPK) // TOPK]
    y64 = torch.einsum("pk,pnk->pn", xp, wh[ids])
    scale = torch.einsum("pk,pnk->pn", xp.abs(), wh[ids].abs())
    err = (y - y64).abs()
    assert (err <= 2.0**-16 * scale + 2.0**-24 * y64.abs()).all(), err.max()


# ----------------------------------------------------------------------------- whole layer
@pytest.mark.parametrize("scheme,macro", SCHEMES, ids=[f"{s}-{mb}" for s, mb in SCHEMES])
@pytest.mark.parametrize("m", [1, 5, 40, 160])
def test_experts_match_reference(triton_device, scheme, macro, m):
    from vllm_mxplus.backends.reference.experts import moe_experts_reference
    from vllm_mxplus.backends.triton.moe_gemm import moe_experts_triton

    s, q13, q2, x, tw, ti = _layer(scheme, macro, m, seed=m, device=triton_device)
    emap = torch.tensor([0, 3, 1, 2], device=triton_device) if m == 5 else None
    y = moe_experts_triton(
        x, _packed(q13, E), _packed(q2, E), tw, ti, **_formats(s),
        quantize_rows=_quantizer(s.activation_format, macro), macro_block=macro,
        activation=F.silu, expert_map=emap,
    )  # fmt: skip
    d13 = q13.dequantize(torch.float32).view(E, 2 * INTER, H)
    d2 = q2.dequantize(torch.float32).view(E, H, INTER)
    ref = moe_experts_reference(
        x, d13, d2, tw, ti, s.activation_format, per_row=s.activations_per_row,
        activation=F.silu, macro_block=macro, expert_map=emap,
    )  # fmt: skip
    assert y.shape == ref.shape == (m, H) and y.dtype == x.dtype
    r = ref.float().cpu()
    torch.testing.assert_close(y.float().cpu(), r, rtol=2**-6, atol=2**-6 * r.abs().max().item())


def test_expert_parallel_drops_other_ranks_pairs(triton_device):
    """Experts 1 and 3 live on another rank (-1): their pairs contribute nothing, as in the
    reference; a token routed only to them gets 0."""
    from vllm_mxplus.backends.reference.experts import moe_experts_reference
    from vllm_mxplus.backends.triton.moe_gemm import moe_experts_triton

    s, q13, q2, x, tw, ti = _layer("mxfp4-mbs", 128, 6, seed=9, device=triton_device)
    ti = ti.clone()
    ti[0] = torch.tensor([1, 3])
    emap = torch.tensor([0, -1, 1, -1], device=triton_device)  # two local experts
    y = moe_experts_triton(
        x, _packed(q13, E), _packed(q2, E), tw, ti, **_formats(s),
        quantize_rows=_quantizer(s.activation_format, 128),
        macro_block=128, activation=F.silu, expert_map=emap,
    )  # fmt: skip
    ref = moe_experts_reference(
        x, q13.dequantize(torch.float32).view(E, 2 * INTER, H),
        q2.dequantize(torch.float32).view(E, H, INTER), tw, ti, s.activation_format,
        per_row=False, activation=F.silu, macro_block=128, expert_map=emap,
    )  # fmt: skip
    assert torch.equal(y[0].float().cpu(), torch.zeros(H))
    r = ref.float().cpu()
    torch.testing.assert_close(y.float().cpu(), r, rtol=2**-6, atol=2**-6 * r.abs().max().item())


@pytest.mark.parametrize(
    "activation,bias", [("silu", False), ("swigluoai", True)], ids=["silu", "swigluoai-bias"]
)
def test_nvfp4_down_rows_take_the_given_global_scale(triton_device, activation, bias):
    """NVFP4 under TP: the down projection's input rows are quantized with the whole row's
    global scale (`row_global_scale`), here twice the shard's own; gpt-oss's layer too."""
    from vllm_mxplus.backends.expert_layer import expert_activation
    from vllm_mxplus.backends.reference.experts import moe_experts_reference
    from vllm_mxplus.backends.reference.linear import nvfp4_row_global_scale
    from vllm_mxplus.backends.triton.moe_gemm import moe_experts_triton

    s, q13, q2, x, tw, ti = _layer("nvfp4", 128, 5, seed=3, device=triton_device)

    def row_g(h):
        return 2 * nvfp4_row_global_scale(h)

    gen = torch.Generator().manual_seed(4)
    biases = {}
    if bias:
        biases = {
            "w13_bias": (torch.randn(E, 2 * INTER, generator=gen) * 0.1).to(x.dtype),
            "w2_bias": (torch.randn(E, H, generator=gen) * 0.1).to(x.dtype),
        }
    kw = dict(
        activation=expert_activation(activation), row_global_scale=row_g, macro_block=128,
        **{k: v.to(triton_device) for k, v in biases.items()},
    )  # fmt: skip
    y = moe_experts_triton(
        x, _packed(q13, E), _packed(q2, E), tw, ti, **_formats(s),
        quantize_rows=_quantizer("nvfp4", 128), **kw,
    )  # fmt: skip
    ref = moe_experts_reference(
        x, q13.dequantize(torch.float32).view(E, 2 * INTER, H),
        q2.dequantize(torch.float32).view(E, H, INTER), tw, ti, "nvfp4", per_row=True, **kw,
    )  # fmt: skip
    r = ref.float().cpu()
    torch.testing.assert_close(y.float().cpu(), r, rtol=2**-6, atol=2**-6 * r.abs().max().item())


# ----------------------------------------------------------------------------- the backend
def test_registered_for_cuda_experts_only():
    from vllm_mxplus.backends import selection
    from vllm_mxplus.backends.triton.experts import TritonExperts

    assert selection.registered_backends("cuda", "experts")[0] is TritonExperts
    assert TritonExperts not in selection.registered_backends("cpu", "experts")
    ok, why = TritonExperts.is_supported("cpu", None)
    assert not ok and "CUDA" in why


# each scheme with one (activation, biases) kind, so that every kind runs on some scheme
KINDS = [
    ("silu", False),
    ("gelu", True),
    ("swigluoai", True),
    ("gelu_tanh", False),
    ("swigluoai", False),
    ("silu", True),
    ("swigluoai", True),
]


@pytest.mark.parametrize(
    "scheme,macro,activation,bias",
    [(*sm, *kind) for sm, kind in zip(SCHEMES, KINDS, strict=True)],
    ids=[f"{s}-{mb}-{a}{'-bias' if b else ''}" for (s, mb), (a, b) in zip(SCHEMES, KINDS)],
)
def test_backend_passes_the_expert_self_test(triton_device, scheme, macro, activation, bias):
    """The real first-use self-test (selftest_experts.py: stage 1 exact, stage 2 in the
    linear bound, M 1 / 5 / 33, the layer's activation and biases) through TritonExperts'
    process_weights + apply."""
    from vllm_mxplus.backends.base import ExpertSpec
    from vllm_mxplus.backends.selftest_experts import run_expert_self_test
    from vllm_mxplus.backends.triton.experts import TritonExperts

    spec = ExpertSpec(
        get_scheme(scheme, macro), device_type=triton_device.type, activation=activation,
        has_bias=bias,
    )  # fmt: skip
    assert TritonExperts.can_implement(spec) == (True, "")
    assert run_expert_self_test(TritonExperts, spec, triton_device) is None


def test_every_expert_activation_and_biases_accepted():
    """gpt-oss layers (swigluoai + biases) and every other activation stay on the grouped
    kernel; an activation no backend computes is refused with its name."""
    from vllm_mxplus.backends.base import ExpertSpec
    from vllm_mxplus.backends.expert_layer import EXPERT_ACTIVATIONS
    from vllm_mxplus.backends.triton.experts import TritonExperts

    for scheme, macro in SCHEMES:
        for act in EXPERT_ACTIVATIONS:
            for bias in (False, True):
                spec = ExpertSpec(get_scheme(scheme, macro), activation=act, has_bias=bias)
                assert TritonExperts.can_implement(spec) == (True, ""), (scheme, act, bias)
    ok, why = TritonExperts.can_implement(ExpertSpec(get_scheme("nvfp4"), activation="relu2"))
    assert not ok and "'relu2'" in why and "swigluoai" in why
