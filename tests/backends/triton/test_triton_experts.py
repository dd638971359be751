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
def test_grouped_gemm_within_bound(triton_device, scheme, macro):
    """moe_gemm for w13 (rows gathered per token, top-2) at M = 17 against the float64
    product of each pair's token with its expert's weight; rows of pairs are computed
    once, in the tile of their expert."""
    from vllm_mxplus.backends.triton.moe_gemm import moe_align, moe_block_m, moe_gemm
    from vllm_mxplus.backends.triton.mx_gemm import operand_format

    m = 17
    s, q13, _, x, _, ti = _layer(scheme, macro, m, seed=1, device=triton_device)
    w = _packed(q13, E)
    fmt, bs = operand_format(s.weight_format)
    block_m = moe_block_m(m * TOPK, E)
    pairs, tile_expert = moe_align(ti, None, E, block_m)
    a = _quantizer(s.activation_format, macro)(x, None)
    y = moe_gemm(
        a, w, pairs, tile_expert, num_pairs=m * TOPK, topk=TOPK, out_dtype=torch.float32,
        fmt=fmt, block_size=bs, macro_block=macro, block_m=block_m,
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
@pytest.mark.parametrize("m", [1, 5, 40])
def test_experts_match_reference(triton_device, scheme, macro, m):
    from vllm_mxplus.backends.reference.experts import moe_experts_reference
    from vllm_mxplus.backends.triton.moe_gemm import moe_experts_triton

    s, q13, q2, x, tw, ti = _layer(scheme, macro, m, seed=m, device=triton_device)
    emap = torch.tensor([0, 3, 1, 2], device=triton_device) if m == 5 else None
    y = moe_experts_triton(
        x, _packed(q13, E), _packed(q2, E), tw, ti, weight_format=s.weight_format,
        quantize_rows=_quantizer(s.activation_format, macro), macro_block=macro,
        activation=F.silu, expert_map=emap,
    )  # fmt: skip
    d13 = q13.dequantize(torch.float32).view(E, 2 * INTER, H)
    d2 = q2.dequantize(torch.float32).view(E, H, INTER)
    ref = moe_experts_reference(
        x, d13, d2, tw, ti, s.activation_format, per_row=s.activation_format == "nvfp4",
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
        x, _packed(q13, E), _packed(q2, E), tw, ti,
        weight_format=s.weight_format, quantize_rows=_quantizer(s.activation_format, 128),
        macro_block=128, activation=F.silu, expert_map=emap,
    )  # fmt: skip
    ref = moe_experts_reference(
        x, q13.dequantize(torch.float32).view(E, 2 * INTER, H),
        q2.dequantize(torch.float32).view(E, H, INTER), tw, ti, s.activation_format,
        per_row=False, activation=F.silu, expert_map=emap,
    )  # fmt: skip
    assert torch.equal(y[0].float().cpu(), torch.zeros(H))
    r = ref.float().cpu()
    torch.testing.assert_close(y.float().cpu(), r, rtol=2**-6, atol=2**-6 * r.abs().max().item())


def test_nvfp4_down_rows_take_the_given_global_scale(triton_device):
    """NVFP4 under TP: the down projection's input rows are quantized with the whole row's
    global scale (`row_global_scale`), here twice the shard's own."""
    from vllm_mxplus.backends.reference.experts import moe_experts_reference
    from vllm_mxplus.backends.reference.linear import nvfp4_row_global_scale
    from vllm_mxplus.backends.triton.moe_gemm import moe_experts_triton

    s, q13, q2, x, tw, ti = _layer("nvfp4", 128, 5, seed=3, device=triton_device)

    def row_g(h):
        return 2 * nvfp4_row_global_scale(h)

    kw = dict(activation=F.silu, row_global_scale=row_g)
    y = moe_experts_triton(
        x, _packed(q13, E), _packed(q2, E), tw, ti, weight_format="nvfp4",
        quantize_rows=_quantizer("nvfp4", 128), macro_block=128, **kw,
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


@pytest.mark.parametrize("scheme,macro", SCHEMES, ids=[f"{s}-{mb}" for s, mb in SCHEMES])
def test_backend_passes_the_expert_self_test(triton_device, scheme, macro):
    """The real first-use self-test (selftest_experts.py: stage 1 exact, stage 2 in the
    linear bound, M 1 / 5 / 33) through TritonExperts' process_weights + apply."""
    from vllm_mxplus.backends.base import ExpertSpec
    from vllm_mxplus.backends.selftest_experts import run_expert_self_test
    from vllm_mxplus.backends.triton.experts import TritonExperts

    spec = ExpertSpec(get_scheme(scheme, macro), device_type=triton_device.type)
    assert TritonExperts.can_implement(spec)[0]
    assert run_expert_self_test(TritonExperts, spec, triton_device) is None


@pytest.mark.parametrize("m", [1, 2, 16, 24, 512])
@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4", "mxplus"])
def test_apply_is_capturable_at_vllm_graph_sizes(scheme, m):
    """TritonExperts.apply on fake CUDA tensors under the capture guard: no host sync, no
    host <-> device copy, no data-dependent shape, no CPU tensor built per call (EP map
    and NVFP4's TP row scales included)."""
    from vllm_mxplus.backends.base import ExpertSpec
    from vllm_mxplus.backends.graph_guard import cuda_empty, fake_cuda, guarded
    from vllm_mxplus.backends.triton.experts import PACKED_ATTR, TritonExperts
    from vllm_mxplus.backends.triton.moe_gemm import PackedExpertWeights

    s = get_scheme(scheme)
    nvfp4, mxplus = scheme == "nvfp4", scheme == "mxplus"
    bs = 32 if mxplus else 16
    e, h, inter = 8, 256, 128
    with fake_cuda():

        def packed(n: int, k: int) -> PackedExpertWeights:
            rows = e * n
            extra = None
            if mxplus:
                extra = cuda_empty((rows, k // 32), torch.uint8)
            elif scheme == "mxfp4-mbs":
                extra = cuda_empty((rows, k // 128), torch.uint8)
            g = cuda_empty((rows,)) if nvfp4 else None
            codes = cuda_empty((rows, k // 2), torch.uint8)
            return PackedExpertWeights(
                codes, cuda_empty((rows, k // bs), torch.uint8), extra, g, e, n, k
            )

        layer = torch.nn.Module()
        setattr(layer, PACKED_ATTR, {"w13": packed(2 * inter, h), "w2": packed(h, inter)})
        layer.expert_map = cuda_empty((16,), torch.int32)
        layer.mxplus_row_global_scale = (
            (lambda t: t.abs().amax(-1, keepdim=True)) if nvfp4 else None
        )
        backend = TritonExperts(ExpertSpec(s, device_type="cuda"))
        x = cuda_empty((m, h), torch.bfloat16)
        tw, ti = cuda_empty((m, 2)), cuda_empty((m, 2), torch.int32)
        y, guard = guarded(backend.apply, layer, x, tw, ti, F.silu)
    assert y.shape == (m, h) and y.dtype == torch.bfloat16
    assert guard.ops.count("vllm_mxplus.triton_moe_gemm.default") == 2
