"""Grouped E8M0 experts on the decode kernel's word path (`moe_decode`), under the interpreter
here (on a GPU, the same tests run the compiled kernel).

- `moe_decode_gemm` (both stems' shapes, row tiles of 16 / 32 / 64 pairs, the E8M0 scale
  folded or not, expert parallelism) within the bound the decode GEMM holds to
  (docs/numerics.md, "Kernel numerics and error bounds"; the same bound as
  test_triton_experts.py's grouped GEMM): |y - y64| <= 2^-16 * sum|x||w| + 2^-24 * |y64|
  per pair, against the float64 product of the pair's token with its own expert's weight,
  and exactly 0 for pairs of other ranks' experts. A row read from the wrong token or the
  wrong expert is off by the size of the product, far outside the bound.
- The expert layer takes that path for every E8M0 scheme whose stems allow it (and only
  then), and agrees with `moe_experts_reference` as the mx_gemm path does.
- Bad arguments name what is wrong; the custom op passes opcheck.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_mxplus.formats import get_scheme, quantize

E, TOPK = 4, 2
H, INTER = 256, 128  # w13: K = 256 (two steps of 128), w2: K = 128
E8M0_SCHEMES = [("mxfp4-mbs", 128), ("mxfp4-mbs", 256), ("mxfp4-16-oas", 128), ("mxfp4-ocp", 128)]


def _packed(q, small: bool | None = None):
    from vllm_mxplus.backends.triton.decode_gemm import small_weight_scales
    from vllm_mxplus.backends.triton.linear import weight_operands
    from vllm_mxplus.backends.triton.moe_gemm import PackedExpertWeights

    codes, scales, extra, g = weight_operands(q)
    fold = small_weight_scales(scales) if small is None else small
    return PackedExpertWeights(codes, scales, extra, g, E, q.shape[0] // E, q.shape[-1], fold)


def _routing(m: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    tw, ti = torch.topk(torch.randn(m, E, generator=gen).softmax(-1), TOPK)
    return tw.to(device), ti.to(device)


@pytest.mark.parametrize("scheme,macro", E8M0_SCHEMES, ids=[f"{s}-{m}" for s, m in E8M0_SCHEMES])
@pytest.mark.parametrize("m", [5, 40, 160])
def test_grouped_decode_within_bound(triton_device, scheme, macro, m):
    """w13 (rows gathered per token, top-2) at 10 / 80 / 320 pairs: row tiles of 16, 32 and
    64 pairs (`moe_block_m` with the wide tile allowed); at M = 40 experts 1 and 3 live on
    another rank; at M = 160 the weight's scales are not folded (codes above 128 are)."""
    from vllm_mxplus.backends.triton.moe_decode import moe_decode_gemm, moe_takes_hat
    from vllm_mxplus.backends.triton.moe_gemm import moe_align, moe_block_m
    from vllm_mxplus.backends.triton.mx_gemm import operand_format
    from vllm_mxplus.backends.triton.ops import act_quant_hat_op

    gen = torch.Generator().manual_seed(m)
    s = get_scheme(scheme, macro)
    w = torch.randn(E * 2 * INTER, H, generator=gen) * 0.2
    if m == 160:  # large blocks: scale codes above 128, where folding is not allowed
        w[: 2 * INTER] *= 64.0
    q = quantize(w.to(triton_device), s.weight_format, macro_block=macro)
    packed = _packed(q)
    assert packed.small_scales == (m != 160)
    assert moe_takes_hat(packed, _packed(q), macro, s.has_mbs)
    x = (torch.randn(m, H, generator=gen) * 2).to(torch.bfloat16).to(triton_device)
    _, ti = _routing(m, gen, triton_device)
    emap = torch.tensor([0, -1, 1, -1], device=triton_device) if m == 40 else None
    experts = 2 if m == 40 else E
    p = m * TOPK
    block_m = moe_block_m(p, experts, wide=True)
    assert block_m == {5: 16, 40: 32, 160: 64}[m]
    pairs, tile_expert = moe_align(ti, emap, experts, block_m)
    _, _, x_mbs, _, x_hat, _ = act_quant_hat_op(x, s.activation_format, macro_block=macro)
    _, bs = operand_format(s.weight_format)
    rows = 2 * INTER
    if emap is not None:  # the local experts' rows only, as the layer holds them
        keep = torch.cat([torch.arange(e * rows, (e + 1) * rows) for e in (0, 2)])
        local_w = tuple(None if t is None else t[keep.to(t.device)] for t in packed.operands[:3])
    else:
        local_w = packed.operands[:3]
    y = moe_decode_gemm(
        x_hat, x_mbs, local_w, pairs, tile_expert, experts=experts, n=rows, k=H, num_pairs=p,
        topk=TOPK, out_dtype=torch.float32, block_size=bs, macro_block=macro,
        block_m=block_m, w_small_scales=packed.small_scales,
    ).double().cpu()  # fmt: skip
    assert y.shape == (p, rows)

    xh = quantize(x, s.activation_format, macro_block=macro, per_row=True).dequantize()
    xp = xh.double().cpu()[torch.arange(p) // TOPK]
    wh = q.dequantize().double().cpu().view(E, rows, H)
    ids = ti.reshape(-1).cpu()
    y64 = torch.einsum("pk,pnk->pn", xp, wh[ids])
    scale = torch.einsum("pk,pnk->pn", xp.abs(), wh[ids].abs())
    local = torch.ones(p, dtype=torch.bool) if emap is None else emap.cpu()[ids] >= 0
    assert (y[~local] == 0).all()  # other ranks' pairs: in no tile, never written
    err = (y - y64).abs()[local]
    assert (err <= 2.0**-16 * scale[local] + 2.0**-24 * y64.abs()[local]).all(), err.max()


@pytest.mark.parametrize("scheme,macro", E8M0_SCHEMES, ids=[f"{s}-{m}" for s, m in E8M0_SCHEMES])
@pytest.mark.parametrize("m", [1, 40])
def test_layer_takes_the_decode_kernel_and_matches_reference(
    triton_device, monkeypatch, scheme, macro, m
):
    """moe_experts_triton with the hat quantizer: both stems on `moe_decode_gemm` (w2's rows
    one per pair), the layer within the tolerance of the mx_gemm path against the reference
    (test_triton_experts.py: 2^-6, one code step of a requantized h)."""
    from vllm_mxplus.backends.reference.experts import moe_experts_reference
    from vllm_mxplus.backends.triton import moe_decode
    from vllm_mxplus.backends.triton.gemm_ops import act_operands
    from vllm_mxplus.backends.triton.moe_gemm import moe_experts_triton
    from vllm_mxplus.backends.triton.ops import act_quant_hat_op

    calls: list[int] = []
    real = moe_decode.moe_decode_gemm

    def spy(*a, **kw):  # noqa: ANN002, ANN003, ANN202
        calls.append(kw["topk"])
        return real(*a, **kw)

    monkeypatch.setattr(moe_decode, "moe_decode_gemm", spy)
    gen = torch.Generator().manual_seed(m)
    s = get_scheme(scheme, macro)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.2
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.2
    q13 = quantize(w13.reshape(-1, H).to(triton_device), s.weight_format, macro_block=macro)
    q2 = quantize(w2.reshape(-1, INTER).to(triton_device), s.weight_format, macro_block=macro)
    x = torch.randn(m, H, generator=gen).to(torch.bfloat16).to(triton_device)
    tw, ti = _routing(m, gen, triton_device)
    afmt = s.activation_format
    y = moe_experts_triton(
        x, _packed(q13), _packed(q2), tw, ti, weight=s.weight,
        activation_mbs=bool(s.activation.mbs),
        quantize_rows=lambda r, g: act_operands(r, afmt, macro, g),
        macro_block=macro, activation=F.silu,
        quantize_hat=lambda r: act_quant_hat_op(r, afmt, macro_block=macro),
    )  # fmt: skip
    assert calls == [TOPK, 1]
    ref = moe_experts_reference(
        x, q13.dequantize(torch.float32).view(E, 2 * INTER, H),
        q2.dequantize(torch.float32).view(E, H, INTER), tw, ti, afmt,
        per_row=s.activations_per_row, activation=F.silu, macro_block=macro,
    )  # fmt: skip
    r = ref.float().cpu()
    torch.testing.assert_close(y.float().cpu(), r, rtol=2**-6, atol=2**-6 * r.abs().max().item())


def test_formats_and_shapes_off_the_path_keep_mx_gemm():
    """NVFP4 / MX+ experts, macro blocks under the x_hat step, and rows that do not vectorize
    stay on mx_gemm (`moe_takes_hat` false, or not an E8M0 kind)."""
    from vllm_mxplus.backends.triton.moe_decode import moe_takes_hat

    def packed(scheme: str, macro: int, k: int):
        s = get_scheme(scheme, macro)
        return s, _packed(quantize(torch.randn(E * 16, k), s.weight_format, macro_block=macro))

    s, w = packed("mxfp4-mbs", 128, 128)
    assert moe_takes_hat(w, w, 128, s.has_mbs)
    s, w = packed("mxfp4-mbs", 32, 128)
    assert not moe_takes_hat(w, w, 32, s.has_mbs)  # 4 macro blocks per step: pairs, not SUB rows
    s, w = packed("mxfp4-16-oas", 128, 48)
    assert not moe_takes_hat(w, w, 128, s.has_mbs)  # 24-byte rows do not vectorize


def test_bad_arguments_name_the_fault(triton_device):
    from vllm_mxplus.backends.triton.moe_decode import moe_decode_gemm
    from vllm_mxplus.backends.triton.moe_gemm import moe_align
    from vllm_mxplus.backends.triton.ops import act_quant_hat_op

    s = get_scheme("mxfp4-mbs", 128)
    q = quantize(torch.randn(E * 16, 128).to(triton_device), s.weight_format, macro_block=128)
    w = _packed(q)
    ti = torch.tensor([[0, 1]], device=triton_device)
    pairs, tile_expert = moe_align(ti, None, E, 16)
    x = torch.randn(1, 128, device=triton_device, dtype=torch.bfloat16)
    _, _, x_mbs, _, x_hat, _ = act_quant_hat_op(x, s.activation_format, macro_block=128)
    kw = dict(experts=E, n=16, k=128, num_pairs=2, topk=TOPK, out_dtype=torch.bfloat16,
              block_size=16, macro_block=128, block_m=16)  # fmt: skip
    with pytest.raises(ValueError, match="x_hat must be"):
        moe_decode_gemm(x_hat.float(), x_mbs, w.operands[:3], pairs, tile_expert, **kw)
    with pytest.raises(ValueError, match="block_size must be one of"):
        moe_decode_gemm(x_hat, x_mbs, w.operands[:3], pairs, tile_expert, **{**kw, "block_size": 8})


def test_custom_op_passes_opcheck(triton_device):
    from vllm_mxplus.backends.triton.moe_gemm import moe_align
    from vllm_mxplus.backends.triton.ops import act_quant_hat_op

    s = get_scheme("mxfp4-mbs", 128)
    q = quantize(torch.randn(E * 16, 128).to(triton_device), s.weight_format, macro_block=128)
    w = _packed(q)
    ti = torch.tensor([[0, 2], [1, 2]], device=triton_device)
    pairs, tile_expert = moe_align(ti, None, E, 16)
    x = torch.randn(2, 128, device=triton_device, dtype=torch.bfloat16)
    _, _, x_mbs, _, x_hat, _ = act_quant_hat_op(x, s.activation_format, macro_block=128)
    torch.library.opcheck(
        torch.ops.vllm_mxplus.triton_moe_decode_gemm.default,
        (x_hat, x_mbs, list(w.operands[:3]), pairs, tile_expert, E, 16, 128),
        dict(
            num_pairs=4,
            topk=TOPK,
            out_dtype=torch.bfloat16,
            block_size=16,
            macro_block=128,
            block_m=16,
            w_small_scales=w.small_scales,
        ),  # fmt: skip
        test_utils=("test_schema", "test_faketensor"),
    )
