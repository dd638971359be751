"""Triton decode GEMM vs. the float64 product of the reference dequantizations.

y_ref = x_hat @ W_hat^T (+ bias) in float64, x_hat and W_hat from `formats` dequantize. The
kernel forms exact products (value * 2^e is exact in bf16/fp32) and accumulates in fp32, so
the only error is fp32 rounding in the sums and in the per-macro-block scaling by
sigma_x * sigma_w = fp32(1/Fx) * fp32(1/Fw). Stated bound, fp32 output:
    |y - y_ref| <= 2^-16 * (|x_hat| @ |W_hat|^T + |bias|)
which allows ~K/64 + 12 fp32 roundings of a sum of absolute terms (K <= 4096: < 2^-17.6);
measured errors are ~2^-25. bf16 / fp16 output adds the half-ulp of the cast (2^-9 / 2^-12
relative, plus fp16's subnormal step).

Runs on CPU under TRITON_INTERPRET=1 (tests/backends/conftest.py) or on CUDA when compiled.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vllm_mxplus.backends.triton.decode_gemm import decode_gemm
from vllm_mxplus.formats import quantize

# (weight format, activation format): the paper's schemes with an E8M0 layout.
PAIRS = {
    "mbs-h": ("mxfp4-mbs-d", "mxfp4-mbs-s"),
    "mbs-s": ("mxfp4-mbs-s", "mxfp4-mbs-s"),
    "oas16": ("mxfp4-16-oas", "mxfp4-16-oas"),
    "ocp32": ("mxfp4-ocp", "mxfp4-ocp"),
}
ACC_BOUND = 2.0**-16  # relative to |x_hat| @ |W_hat|^T; see the module docstring
OUT_ROUNDING = {
    torch.float32: (0.0, 0.0),
    torch.bfloat16: (2.0**-8, 0.0),
    torch.float16: (2.0**-10, 2.0**-24),
}

# Every listed M, K and N appears; the largest products only for the cheaper formats
# (MBS-D's exact search on a 1536 x 4096 weight takes ~40 s on this CPU).
SHAPES = [  # (M, K, N)
    (1, 100, 64),
    (33, 576, 64),
    (100, 1536, 64),
    (1, 4096, 64),
    (33, 100, 1536),
    (1, 576, 1536),
    (16, 4096, 1536),
]
CASES = [(p, *s) for s in SHAPES for p in PAIRS if not (p == "mbs-h" and s[2] * s[1] > 1 << 20)]


def operands(m: int, k: int, n: int, pair: str, device, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-4, 4, (m, 1), generator=gen))
    w = torch.randn(n, k, generator=gen) * 0.02
    w[:, :: max(1, k // 7)] *= 20.0  # outlier columns, as LLM weights have
    wf, xf = PAIRS[pair]
    qx = quantize(x.to(torch.bfloat16).to(device), xf)
    qw = quantize(w.to(torch.bfloat16).to(device), wf)
    return qx, qw


def reference(qx, qw, bias=None):
    xh, wh = qx.dequantize().double(), qw.dequantize().double()
    y = xh @ wh.T
    scale = xh.abs() @ wh.abs().T
    if bias is not None:
        y = y + bias.double()
        scale = scale + bias.double().abs()
    return y, scale


def run(qx, qw, k, **kw):
    kw.setdefault("macro_block", 128)
    return decode_gemm(qx.codes, qx.scales, qx.mbs, qw.codes, qw.scales, qw.mbs, k, **kw)


def assert_within_bound(y, y_ref, scale, out_dtype):
    rel, absolute = OUT_ROUNDING[out_dtype]
    y = y.double().cpu()
    y_ref, scale = y_ref.cpu(), scale.cpu()
    bound = ACC_BOUND * scale + rel * y_ref.abs() + absolute
    err = (y - y_ref).abs()
    nan_ref = y_ref.isnan()
    assert torch.equal(y.isnan(), nan_ref), "NaN pattern differs from the reference"
    bad = (err > bound) & ~nan_ref
    assert not bad.any(), (
        f"{int(bad.sum())} outputs out of bound, first at {tuple(bad.nonzero()[0].tolist())}: "
        f"err {err[bad].max().item():.3g}, bound there {bound[bad].min().item():.3g}"
    )


@pytest.mark.parametrize("pair,m,k,n", CASES, ids=[f"{p}-M{m}-K{k}-N{n}" for p, m, k, n in CASES])
def test_matches_float64_reference(pair, m, k, n, triton_device):
    qx, qw = operands(m, k, n, pair, triton_device, seed=m + k + n)
    y = run(qx, qw, k, out_dtype=torch.float32)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_within_bound(y, *reference(qx, qw), torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("pair", list(PAIRS))
def test_bias_and_output_dtype(pair, out_dtype, triton_device):
    qx, qw = operands(5, 576, 96, pair, triton_device, seed=1)
    bias = (torch.randn(96) * 0.5).to(out_dtype).to(triton_device)
    y = run(qx, qw, 576, bias=bias, out_dtype=out_dtype)
    assert y.dtype == out_dtype
    assert_within_bound(y, *reference(qx, qw, bias), out_dtype)


@pytest.mark.parametrize("split_k", [2, 3, 5], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("pair", ["mbs-s", "oas16"])
def test_split_k_and_odd_k(pair, split_k, triton_device):
    """Split-K slices (partial sums reduced in fp32) and K odd (half-filled last byte),
    not a multiple of 16 (partial block) nor of 128 (partial macro block)."""
    k = 1201
    qx, qw = operands(3, k, 80, pair, triton_device, seed=split_k)
    bias = torch.randn(80).to(triton_device)
    y = run(qx, qw, k, bias=bias, out_dtype=torch.float32, split_k=split_k)
    assert_within_bound(y, *reference(qx, qw, bias), torch.float32)


def test_nan_and_zero_rows(triton_device):
    """A NaN block in x makes its output row NaN (E8M0 255 dequantizes to NaN); a zero row
    gives exactly bias."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 300, generator=gen)
    x[1] = 0.0
    x[2, 40] = float("nan")
    w = torch.randn(48, 300, generator=gen) * 0.1
    qx = quantize(x.to(triton_device), "mxfp4-mbs-s")
    qw = quantize(w.to(triton_device), "mxfp4-mbs-s")
    bias = torch.randn(48).to(triton_device)
    y = run(qx, qw, 300, bias=bias, out_dtype=torch.float32)
    assert y[2].isnan().all() and not y[[0, 1, 3]].isnan().any()
    assert torch.equal(y[1].cpu(), bias.cpu())
    assert_within_bound(y, *reference(qx, qw, bias), torch.float32)


def test_block_size_inference_and_errors(triton_device):
    qx, qw = operands(2, 256, 32, "ocp32", triton_device)
    y = run(qx, qw, 256, out_dtype=torch.float32)  # 8 scales for K=256: block 32
    assert_within_bound(y, *reference(qx, qw), torch.float32)
    with pytest.raises(ValueError, match="w_codes"):
        decode_gemm(
            qx.codes, qx.scales, None, qw.codes[:, :-1], qw.scales, None, 256, macro_block=128
        )
    with pytest.raises(ValueError, match="fit no block size"):
        decode_gemm(
            qx.codes, qx.scales[:, :5], None, qw.codes, qw.scales, None, 256, macro_block=128
        )
    with pytest.raises(ValueError, match="bias"):
        decode_gemm(
            qx.codes,
            qx.scales,
            None,
            qw.codes,
            qw.scales,
            None,
            256,
            bias=torch.zeros(7, device=triton_device),
            macro_block=128,
        )


def test_custom_op_matches_and_traces(triton_device):
    from vllm_mxplus.backends.triton.ops import decode_gemm_op

    qx, qw = operands(3, 256, 32, "mbs-h", triton_device, seed=4)
    bias = torch.randn(32).to(triton_device)
    args = (qx.codes, qx.scales, qx.mbs, qw.codes, qw.scales, qw.mbs, 256)
    want = decode_gemm(*args, bias=bias, out_dtype=torch.float32, macro_block=128)
    got = decode_gemm_op(*args, bias=bias, out_dtype=torch.float32, macro_block=128)
    assert torch.equal(got, want)
    torch.library.opcheck(
        torch.ops.vllm_mxplus.triton_decode_gemm.default,
        (*args, bias, torch.bfloat16, 16),
        {"macro_block": 128},
    )
    compiled = torch.compile(
        lambda *a: decode_gemm_op(*a, bias=bias, out_dtype=torch.float32, macro_block=128),
        backend="aot_eager",
        fullgraph=True,
    )
    assert torch.equal(compiled(*args), want)


def _launch_flags(qx, qw, k, **kw) -> dict:
    """The constexprs of the launch `run` makes, with the GPU's tiles (`capture_launches`)."""
    from vllm_mxplus.backends.triton.launch import capture_launches

    with capture_launches() as launches:
        run(qx, qw, k, **kw)
    return launches[0].kwargs


@pytest.mark.parametrize(
    "k,n,even", [(1024, 512, True), (1024, 500, False), (1088, 512, False)],
    ids=["whole-tiles", "N-edge", "K-edge"],
)  # fmt: skip
@pytest.mark.parametrize("pair", ["mbs-h", "oas16", "ocp32"])
def test_folded_weight_scales_and_whole_tiles(pair, k, n, even, triton_device):
    """w_small_scales (2^126 folded into the weight's scales) and whole tiles (unmasked
    weight loads): within the bound, and the same bits as the unfolded kernel (the same
    values in the same order). The weight holds blocks at scale codes 0 (2^-127: the folded
    constant 2^-1, products down to 2^-128) and 128 (the largest code that folds)."""
    qx, qw = operands(5, k, n, pair, triton_device, seed=k + n)
    qw.scales[0, :4] = 0
    qw.scales[1, :4] = 128
    assert qw.scales.max() <= 128
    from vllm_mxplus.backends.triton.decode_gemm import small_weight_scales

    assert small_weight_scales(qw.scales)
    kw = {"out_dtype": torch.float32}
    gpu_flags = _launch_flags(qx, qw, k, w_small_scales=True, **kw)
    assert gpu_flags["W_FOLD"] and gpu_flags["EVEN"] == even
    # the interpreter's wider tiles: whole tiles exactly where N and K are multiples of them
    folded = run(qx, qw, k, w_small_scales=True, block_n=256, **kw)
    assert_within_bound(folded, *reference(qx, qw), torch.float32)
    assert torch.equal(folded, run(qx, qw, k, block_n=256, **kw))


def test_folding_needs_small_scales(triton_device):
    """Scale code 129 (2^2) does not fold: 2^(129 - 1) is past fp32's and bf16's range, so a
    caller that skipped `small_weight_scales` would get inf / NaN where the unfolded kernel
    is right. The check names it, and NaN blocks (code 255) do not fold either."""
    from vllm_mxplus.backends.triton.decode_gemm import small_weight_scales

    qx, qw = operands(3, 512, 256, "oas16", triton_device, seed=9)
    qw.scales[0, 0] = 129
    assert not small_weight_scales(qw.scales)
    kw = {"out_dtype": torch.float32, "block_n": 256}
    right = run(qx, qw, 512, **kw)
    assert_within_bound(right, *reference(qx, qw), torch.float32)
    wrong = run(qx, qw, 512, w_small_scales=True, **kw)
    assert not torch.isfinite(wrong[:, 0]).all() or not torch.equal(wrong[:, 0], right[:, 0])
    assert torch.equal(wrong[:, 1:], right[:, 1:])  # only the row holding code 129 differs
    qw.scales[0, 0] = 255
    assert not small_weight_scales(qw.scales)
    assert small_weight_scales(qw.scales[:0])


# ----------------------------------------------------------------------------- GPU, real sizes
GPU_SHAPES = [(1, 4096, 4096), (4, 4096, 14336), (16, 14336, 4096), (7, 5120 + 64, 1000)]


@pytest.mark.gpu
@pytest.mark.parametrize("pair", ["mbs-s", "oas16", "ocp32"])
@pytest.mark.parametrize("m,k,n", GPU_SHAPES, ids=[f"M{m}-K{k}-N{n}" for m, k, n in GPU_SHAPES])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_real_sizes(pair, m, k, n, out_dtype, cuda_device):
    # MBS-D weights share MBS-S's layout; its exact search is slow, so -s weights stand in.
    qx, qw = operands(m, k, n, pair, cuda_device, seed=m)
    bias = torch.randn(n, device=cuda_device)
    y = run(qx, qw, k, bias=bias, out_dtype=out_dtype)
    assert_within_bound(y, *reference(qx, qw, bias), out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("serving", [False, True], ids=["codes", "x_hat-folded"])
def test_gpu_cuda_graph_capture(serving, cuda_device):
    from vllm_mxplus.backends.triton.ops import act_quant_hat_op, act_quant_op, decode_gemm_op

    x = torch.randn(4, 4096, device=cuda_device, dtype=torch.bfloat16)
    qw = quantize(torch.randn(4096, 4096, device=cuda_device) * 0.02, "mxfp4-mbs-s")

    def step(t):
        x_hat = None
        if serving:  # the decode layer's path: x_hat, weight scales checked at load
            codes, scales, mbs, _, x_hat, _ = act_quant_hat_op(t, "mxfp4-mbs-s", macro_block=128)
        else:
            codes, scales, mbs, _ = act_quant_op(t, "mxfp4-mbs-s", macro_block=128)
        return decode_gemm_op(
            codes, scales, mbs, qw.codes, qw.scales, qw.mbs, 4096, x_hat=x_hat,
            macro_block=128, w_small_scales=serving,
        )  # fmt: skip

    step(x)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    qx = quantize(x, "mxfp4-mbs-s")
    assert_within_bound(out, *reference(qx, qw), torch.bfloat16)


def test_weight_row_offsets_are_64_bit(triton_device):
    """Weight row 2048 with a row pitch of 2^20 bytes starts at byte 2^31: a 32-bit
    row * stride wraps there (N*K/2 >= 2^31 on large layers). 2 GiB of virtual memory."""
    if triton_device.type != "cpu":
        pytest.skip("the 2 GiB strided buffer is a CPU (virtual memory) check")
    n, k, m, pitch = 2049, 128, 2, 1 << 20
    qx, qw = operands(m, k, n, "oas16", "cpu", seed=11)
    base = torch.empty((n - 1) * pitch + k // 2, dtype=torch.uint8)
    w_codes = base.as_strided((n, k // 2), (pitch, 1))
    w_codes.copy_(qw.codes)
    y = run(qx, replace(qw, codes=w_codes), k, out_dtype=torch.float32)
    assert_within_bound(y, *reference(qx, qw), torch.float32)


@pytest.mark.parametrize("macro_block", [256, 1024])
def test_macro_block_wider_than_k_step(macro_block, triton_device):
    """A macro block spanning several K steps: each step's partial product is divided by
    the factors of the macro block it lies in."""
    m, k, n = 3, 2 * macro_block + 256, 64
    gen = torch.Generator().manual_seed(macro_block)
    x = torch.randn(m, k, generator=gen).to(triton_device)
    w = torch.randn(n, k, generator=gen).to(triton_device)
    qx = quantize(x, "mxfp4-mbs-s", macro_block=macro_block)
    qw = quantize(w, "mxfp4-mbs-s", macro_block=macro_block)
    y = run(qx, qw, k, out_dtype=torch.float32, macro_block=macro_block)
    assert_within_bound(y, *reference(qx, qw), torch.float32)


def test_mbs_partials_are_scaled_by_sigma_never_divided():
    """The MBS partials are scaled by sigma = fp32(1 / F) (`gemm_blocks.mbs_sigma`, checked on
    every MBS byte against an IEEE division in test_triton_gemm_blocks.py); a bare `/`
    would lower to PTX div.full.f32 (up to 2 ulp) on the GPU."""
    import inspect

    from vllm_mxplus.backends.triton import decode_gemm as dg

    src = inspect.getsource(dg._decode_gemm_kernel.fn) + inspect.getsource(dg._word_step.fn)
    # every path (the word step; macro block >= and < the K step) scales by the two sigmas
    # (the word step's x sigmas read ready where given: `act_quant_hat`'s IEEE division)
    assert src.count("mbs_sigma(fx, X_MBS") == src.count("mbs_sigma(fw, W_MBS, ") == 3
    assert "part / " not in src and "pj / " not in src


def test_tile_offsets_are_32_bit_only_where_they_fit():
    """Only a tile's first row is offset in 64 bits; a row pitch so large that a tile spans
    2^31 bytes gets a compact copy (meta tensors: no memory)."""
    from vllm_mxplus.backends.triton.decode_gemm import MAX_TILE_OFFSET, _tile_addressable

    base = torch.empty(1 << 34, dtype=torch.uint8, device="meta")
    fits = base.as_strided((300, 64), (1 << 20, 1))
    assert _tile_addressable(fits, 256) is fits  # 255 * 2^20 + 64 < 2^31
    wide = base.as_strided((300, 64), (1 << 24, 1))
    packed = _tile_addressable(wide, 256)
    assert packed.stride() == (64, 1) and packed.shape == wide.shape
    assert (256 - 1) * wide.stride(0) >= MAX_TILE_OFFSET
    assert _tile_addressable(None, 256) is None


# ----------------------------------------------------------------------------- small macro blocks
SMALL_MACROS = (16, 32, 64)  # `mxplus quantize --macro-block N` below 128 (docs/numerics.md)


def small_macro_operands(m: int, k: int, n: int, pair: str, macro_block: int, device, seed=0):
    """operands() quantized with macro_block: both sides' MBS bytes per macro_block of K."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-4, 4, (m, 1), generator=gen))
    x *= torch.exp2(torch.randint(-3, 3, (m, k), generator=gen))  # macro blocks differ
    w = torch.randn(n, k, generator=gen) * 0.02
    w[:, :: max(1, k // 7)] *= 20.0
    wf, xf = PAIRS[pair]
    qx = quantize(x.to(torch.bfloat16).to(device), xf, macro_block=macro_block)
    qw = quantize(w.to(torch.bfloat16).to(device), wf, macro_block=macro_block)
    assert qx.mbs.shape[-1] == qw.mbs.shape[-1] == -(-k // macro_block)
    return qx, qw


@pytest.mark.parametrize("macro_block", SMALL_MACROS, ids=lambda b: f"macro{b}")
@pytest.mark.parametrize("m", [1, 3, 16], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("pair", ["mbs-s", "mbs-h"])
def test_small_macro_blocks_within_bound(pair, m, macro_block, triton_device):
    """Macro blocks of 16-64 on the byte path (code rows that do not vectorize: a 64-element
    K step holds 1-4 of them, one dot each, each scaled by its own sigmas): within the 2^-16
    bound for MBS-S x MBS-S and MBS-D weights x MBS-S activations; K = 1201 is odd and a
    multiple of none of 16, 32, 64 (partial last block and macro block); N = 80 leaves a
    partial N tile."""
    k, n = 1201, 80
    qx, qw = small_macro_operands(m, k, n, pair, macro_block, triton_device, seed=m + macro_block)
    y = run(qx, qw, k, out_dtype=torch.float32, macro_block=macro_block)
    assert y.shape == (m, n)
    assert_within_bound(y, *reference(qx, qw), torch.float32)


@pytest.mark.parametrize("macro_block", SMALL_MACROS, ids=lambda b: f"macro{b}")
def test_small_macro_blocks_split_k_bias_bf16(macro_block, triton_device):
    """Split-K slices (whole K steps, so whole macro blocks) and bias, bf16 output."""
    k, n = 1000, 96
    qx, qw = small_macro_operands(5, k, n, "mbs-s", macro_block, triton_device, seed=7)
    bias = (torch.randn(n) * 0.5).to(torch.bfloat16).to(triton_device)
    for split in (None, 3):
        y = run(
            qx, qw, k, bias=bias, out_dtype=torch.bfloat16, split_k=split, macro_block=macro_block
        )
        assert_within_bound(y, *reference(qx, qw, bias), torch.bfloat16)


def serving_activation(qx, fmt: str, macro_block: int):
    """The activation of qx's values as a served layer gets it: `act_quant_hat`'s codes,
    scales, MBS bytes (checked bit for bit against `formats`), x_hat and fp32 sigmas; returns
    (the formats' QuantizedTensor, x_hat, sigma)."""
    from vllm_mxplus.backends.triton.act_quant import act_quant_hat

    x = qx.dequantize().to(torch.float32)
    ref = quantize(x, fmt, macro_block=macro_block)
    codes, scales, mbs, _, x_hat, sigma = act_quant_hat(x, fmt, macro_block=macro_block)
    for name, got, want in (("codes", codes, ref.codes), ("scales", scales, ref.scales),
                            ("mbs", mbs, ref.mbs)):  # fmt: skip
        assert torch.equal(got.cpu(), want.cpu()), f"act_quant_hat's {name} differ"
    return ref, x_hat, sigma


@pytest.mark.parametrize("macro_block", SMALL_MACROS, ids=lambda b: f"macro{b}")
@pytest.mark.parametrize("m", [1, 3, 17], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("pair", ["mbs-s", "mbs-h"])
def test_small_macro_blocks_operand_rows(pair, m, macro_block, triton_device):
    """Code rows that vectorize take the word path at the 128-element step with an operand
    row per macro block of the step (`sub_blocks`: 8 / 4 / 2), on the codes and on x_hat
    with x's sigmas: within the 2^-16 bound, and the two the same bits (same values, same
    order). K = 352 ends inside a step (the last step's macro blocks past K read no MBS byte
    or sigma); N = 80 leaves a partial N tile; M = 17 at macro block 16 spans two row tiles
    (16 activation rows per 128 operand rows here)."""
    from vllm_mxplus.backends.triton.launch import capture_launches

    k, n = 352, 80
    qx, qw = small_macro_operands(m, k, n, pair, macro_block, triton_device, seed=m + macro_block)
    qx, x_hat, sigma = serving_activation(qx, PAIRS[pair][1], macro_block)
    kw = {"out_dtype": torch.float32, "macro_block": macro_block}
    for hat in ({}, {"x_hat": x_hat, "x_sigma": sigma}):
        with capture_launches() as launches:
            run(qx, qw, k, **kw, **hat)
        cx = launches[-1].kwargs
        assert cx["WORDS"] and cx["SUB"] == 128 // macro_block and cx["BLOCK_K"] == 128
        assert cx["X_HAT"] == bool(hat)
    y = run(qx, qw, k, **kw)
    assert y.shape == (m, n)
    assert_within_bound(y, *reference(qx, qw), torch.float32)
    assert torch.equal(run(qx, qw, k, x_hat=x_hat, x_sigma=sigma, **kw), y)


@pytest.mark.parametrize("macro_block", SMALL_MACROS, ids=lambda b: f"macro{b}")
def test_small_macro_operand_rows_split_k_bias_bf16(macro_block, triton_device):
    """The operand rows per macro block with split-K slices (whole steps), bias and a bf16
    output, on x_hat; 16 rows (two row tiles at macro block 16 on the interpreter's
    128 operand rows: 8 x 16 = 128, one)."""
    k, n = 1024, 96
    qx, qw = small_macro_operands(16, k, n, "mbs-h", macro_block, triton_device, seed=11)
    qx, x_hat, sigma = serving_activation(qx, PAIRS["mbs-h"][1], macro_block)
    bias = (torch.randn(n) * 0.5).to(torch.bfloat16).to(triton_device)
    for split in (None, 3):
        y = run(qx, qw, k, bias=bias, out_dtype=torch.bfloat16, split_k=split,
                macro_block=macro_block, x_hat=x_hat, x_sigma=sigma)  # fmt: skip
        assert_within_bound(y, *reference(qx, qw, bias), torch.bfloat16)


@pytest.mark.parametrize("macro_block", [16, 64], ids=lambda b: f"macro{b}")
def test_small_macro_operand_rows_special_rows(macro_block, triton_device):
    """A NaN block and an Inf element (a NaN block by the spec) make their own rows NaN and no
    other row of the tile (each operand row reads its own macro block of its own activation
    row), a zero row gives exactly bias: K = 320 on the word path, codes and x_hat alike."""
    gen = torch.Generator().manual_seed(macro_block)
    x = torch.randn(5, 320, generator=gen)
    x[1] = 0.0
    x[2, 40] = float("nan")
    x[3, 200] = float("inf")
    w = torch.randn(48, 320, generator=gen) * 0.1
    qx = quantize(x.to(triton_device), "mxfp4-mbs-s", macro_block=macro_block)
    qw = quantize(w.to(triton_device), "mxfp4-mbs-d", macro_block=macro_block)
    qx, x_hat, sigma = serving_activation(qx, "mxfp4-mbs-s", macro_block)
    bias = torch.randn(48).to(triton_device)
    kw = {"bias": bias, "out_dtype": torch.float32, "macro_block": macro_block}
    y = run(qx, qw, 320, x_hat=x_hat, x_sigma=sigma, **kw)
    assert y[[2, 3]].isnan().all() and not y[[0, 1, 4]].isnan().any()
    assert torch.equal(y[1].cpu(), bias.cpu())
    assert_within_bound(y, *reference(qx, qw, bias), torch.float32)
    torch.testing.assert_close(run(qx, qw, 320, **kw), y, rtol=0, atol=0, equal_nan=True)


def test_small_macro_block_wrong_factor_is_caught(triton_device):
    """The bound sees a one-step error in one MBS byte of one 32-element macro block (the
    check is not vacuous at this macro block size)."""
    k, n = 320, 48
    qx, qw = small_macro_operands(3, k, n, "mbs-s", 32, triton_device, seed=5)
    y_ref, scale = reference(qx, qw)
    bad_w = qw.mbs.clone()
    bad_w[0, 3] = (bad_w[0, 3].int() + 40).clamp(max=255).to(torch.uint8)
    y = run(qx, replace(qw, mbs=bad_w), k, out_dtype=torch.float32, macro_block=32)
    err = (y.double().cpu() - y_ref.cpu()).abs()
    assert (err[:, 0] > ACC_BOUND * scale[:, 0].cpu()).any()


def test_small_macro_block_nan_rows(triton_device):
    """A NaN block in x makes its row NaN, a zero row gives exactly bias, at macro block 32."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 300, generator=gen)
    x[1] = 0.0
    x[2, 40] = float("nan")
    w = torch.randn(48, 300, generator=gen) * 0.1
    qx = quantize(x.to(triton_device), "mxfp4-mbs-s", macro_block=32)
    qw = quantize(w.to(triton_device), "mxfp4-mbs-s", macro_block=32)
    bias = torch.randn(48).to(triton_device)
    y = run(qx, qw, 300, bias=bias, out_dtype=torch.float32, macro_block=32)
    assert y[2].isnan().all() and not y[[0, 1, 3]].isnan().any()
    assert torch.equal(y[1].cpu(), bias.cpu())
    assert_within_bound(y, *reference(qx, qw, bias), torch.float32)


def test_many_rows_any_m(triton_device, monkeypatch):
    """Prefill-sized M (the `triton-gemm` backend serves M > 16 for macro blocks CUTLASS does
    not take): several row tiles, and more row tiles than one launch's grid allows (the
    limit lowered to 1 tile here) run as consecutive launches."""
    from vllm_mxplus.backends.triton import decode_gemm as dg

    k, n = 333, 40
    qx, qw = small_macro_operands(300, k, n, "mbs-s", 32, triton_device, seed=9)
    want = reference(qx, qw)
    y = run(qx, qw, k, out_dtype=torch.float32, macro_block=32)
    assert_within_bound(y, *want, torch.float32)
    monkeypatch.setattr(dg, "MAX_GRID_M_TILES", 1)
    y2 = run(qx, qw, k, out_dtype=torch.float32, macro_block=32)
    assert y2.shape == (300, n)
    assert_within_bound(y2, *want, torch.float32)


def test_split_k_heuristic_counts_row_tiles():
    """On the GPU (launches captured, meta tensors): decode (one row tile) splits K to fill
    the SMs; prefill's many row tiles need no split, whose fp32 partials would take
    split x M x N x 4 bytes."""
    from vllm_mxplus.backends.triton.launch import capture_launches

    def grid_of(m: int, macro_block: int) -> tuple:
        k, n = 4096, 4096
        meta = {"dtype": torch.uint8, "device": "meta"}
        x = (torch.empty(m, k // 2, **meta), torch.empty(m, k // 16, **meta))
        w = (torch.empty(n, k // 2, **meta), torch.empty(n, k // 16, **meta))
        xm = torch.empty(m, k // macro_block, **meta)
        wm = torch.empty(n, k // macro_block, **meta)
        with capture_launches() as launches:
            decode_gemm(x[0], x[1], xm, w[0], w[1], wm, k, macro_block=macro_block)
        split = launches[0].grid[1]  # K slices > 1: summed in the same launch
        assert len(launches) == 1 and launches[0].kwargs["MACRO"] == macro_block
        assert launches[0].kwargs["REDUCE"] == (split > 1)
        assert launches[0].kwargs["BLOCK_K"] == 128  # the GPU's K step, any macro block
        # 16 operand rows, 4 per activation row at macro block 32 (`sub_blocks`)
        assert launches[0].kwargs["SUB"] == 128 // macro_block
        return launches[0].grid

    assert grid_of(1, 32)[1] > 1
    assert grid_of(4096, 32)[1] == 1 and grid_of(4096, 32)[2] == 4096 // (16 // 4)


@pytest.mark.gpu
@pytest.mark.parametrize("macro_block", SMALL_MACROS, ids=lambda b: f"macro{b}")
@pytest.mark.parametrize("m", [1, 16, 4096], ids=lambda m: f"M{m}")
def test_gpu_small_macro_blocks(macro_block, m, cuda_device):
    k, n = 4096 + 32, 4096
    qx, qw = small_macro_operands(m, k, n, "mbs-s", macro_block, cuda_device, seed=m)
    y = run(qx, qw, k, out_dtype=torch.bfloat16, macro_block=macro_block)
    assert_within_bound(y, *reference(qx, qw), torch.bfloat16)


def test_gpu_tile_is_wide_only_where_code_rows_vectorize():
    """The wide 16 x 128 x 128 tile only where every code row's byte count, pitch and base
    address are multiples of 16 (per-byte masked loads spill it: `mxplus kernels --aot`);
    elsewhere the unaligned tile (meta tensors), whatever the macro block."""
    from vllm_mxplus.backends.triton import decode_gemm as dg

    def codes(rows: int, k: int, pitch: int | None = None, offset: int = 0) -> torch.Tensor:
        kb = -(-k // 2)
        base = torch.empty(offset + rows * (pitch or kb), dtype=torch.uint8, device="meta")
        return base[offset:].as_strided((rows, kb), (pitch or kb, 1))

    wide = (dg.GPU_BLOCK_N, dg.GPU_BLOCK_K)
    unaligned = (dg.UNALIGNED_BLOCK_N, dg.UNALIGNED_BLOCK_K)
    assert dg.gpu_tile(4096, codes(1, 4096), codes(64, 4096)) == wide
    assert dg.gpu_tile(100, codes(1, 100), codes(64, 100)) == unaligned  # 50 B rows
    assert dg.gpu_tile(4096, codes(1, 4096), codes(64, 4096, pitch=2056)) == unaligned
    assert dg.gpu_tile(4096, codes(2, 4096, offset=8), codes(64, 4096)) == unaligned
    # macro blocks narrower than the step: operand rows per macro block (`sub_blocks`)
    assert [dg.sub_blocks(mb, True, dg.GPU_BLOCK_K) for mb in (16, 32, 64, 128, 256)] == [
        8, 4, 2, 1, 1
    ]  # fmt: skip
    assert dg.sub_blocks(16, False, dg.GPU_BLOCK_K) == 1  # no MBS: no macro block


def test_launch_option_overrides():
    """num_warps / num_stages reach the GPU launch (captured, meta tensors) over the
    heuristics' (`gpu_launch_options`); a value Triton cannot launch names the option."""
    from vllm_mxplus.backends.triton import decode_gemm as dg
    from vllm_mxplus.backends.triton.launch import capture_launches, last_gemm

    k, n = 4096, 256
    meta = {"dtype": torch.uint8, "device": "meta"}
    ops = (torch.empty(1, k // 2, **meta), torch.empty(1, k // 16, **meta), None,
           torch.empty(n, k // 2, **meta), torch.empty(n, k // 16, **meta), None, k)  # fmt: skip
    with capture_launches() as launches:
        decode_gemm(*ops, macro_block=128)
    assert last_gemm(launches).kwargs["num_warps"] == dg.GPU_NUM_WARPS
    with capture_launches() as launches:
        decode_gemm(*ops, macro_block=128, num_warps=8, num_stages=4)
    gemm = last_gemm(launches)
    assert gemm.kwargs["num_warps"] == 8 and gemm.kwargs["num_stages"] == 4
    with pytest.raises(ValueError, match="num_warps must be"):
        decode_gemm(*ops, macro_block=128, num_warps=3)
    with pytest.raises(ValueError, match="num_stages must be"):
        decode_gemm(*ops, macro_block=128, num_stages=0)


def test_programs_per_sm_setting_sets_the_split(monkeypatch):
    """VLLM_MXPLUS_GPU_PROGRAMS_PER_SM: the split-K of a decode launch (captured: the GPU's
    choice on an H200's NOMINAL_SMS) aims at that many programs per SM; a bad value names
    the variable."""
    from vllm_mxplus.backends.triton.gemm_launch import MAX_SPLIT_K, NOMINAL_SMS
    from vllm_mxplus.backends.triton.launch import capture_launches, last_gemm

    k, n = 8192, 6144  # 48 tiles of 128 columns, 64 K steps
    meta = {"dtype": torch.uint8, "device": "meta"}
    ops = (torch.empty(1, k // 2, **meta), torch.empty(1, k // 16, **meta), None,
           torch.empty(n, k // 2, **meta), torch.empty(n, k // 16, **meta), None, k)  # fmt: skip

    def split() -> int:
        with capture_launches() as launches:
            decode_gemm(*ops, macro_block=128)
        return last_gemm(launches).grid[1]

    monkeypatch.delenv("VLLM_MXPLUS_GPU_PROGRAMS_PER_SM", raising=False)
    assert split() == -(-2 * NOMINAL_SMS // 48) == 6
    monkeypatch.setenv("VLLM_MXPLUS_GPU_PROGRAMS_PER_SM", "4")
    assert split() == -(-4 * NOMINAL_SMS // 48) == 11
    monkeypatch.setenv("VLLM_MXPLUS_GPU_PROGRAMS_PER_SM", "64")
    assert split() == MAX_SPLIT_K
    monkeypatch.setenv("VLLM_MXPLUS_GPU_PROGRAMS_PER_SM", "zero")
    with pytest.raises(ValueError, match="VLLM_MXPLUS_GPU_PROGRAMS_PER_SM"):
        split()


def test_weight_operand_follows_the_gpu():
    """The word path's weight is the dots' A operand (W_A) on sm_80 / sm_90 for E8M0 row
    tiles of <= 32 rows; at <= 16 rows on every GPU the slim tile (`slim_tile`: 64 weight
    rows, 2 warps, the weight as A, sm_100 included); the B operand on sm_100's 32-row tile
    with four warps (tcgen05 reads A from shared memory; the slim tile takes 32 rows there),
    for NVFP4 and for 64-row tiles
    (captured launches at each capability, meta tensors); `weight_a`, `block_n` and
    `num_warps` override the choices (`gpu_check`'s sweep). The slim tile's split-K plan
    launches twice the programs of the four-warp one, so as many warps per SM."""
    from vllm_mxplus.backends.triton.decode_gemm import SLIM_BLOCK_N, SLIM_NUM_WARPS
    from vllm_mxplus.backends.triton.launch import capture_launches, last_gemm

    k = 4096
    meta = {"dtype": torch.uint8, "device": "meta"}

    def launch_of(m: int, capability: int | None, n: int = 256, **kw):
        ops = (torch.empty(m, k // 2, **meta), torch.empty(m, k // 16, **meta), None,
               torch.empty(n, k // 2, **meta), torch.empty(n, k // 16, **meta), None, k)  # fmt: skip
        hat = torch.empty(m, k, dtype=torch.bfloat16, device="meta")
        with capture_launches(capability) as launches:
            decode_gemm(*ops, macro_block=128, x_hat=hat, w_small_scales=True, **kw)
        gemm = last_gemm(launches)
        assert gemm.kwargs["WORDS"] and gemm.kwargs["X_HAT"]
        return gemm

    def w_a(m: int, capability: int | None, **kw) -> bool:
        return launch_of(m, capability, **kw).kwargs["W_A"]

    def tile(m: int, capability: int | None, **kw) -> tuple:
        g = launch_of(m, capability, **kw)
        return g.kwargs["W_A"], g.kwargs["BLOCK_N"], g.kwargs.get("num_warps")

    assert w_a(1, 90) and w_a(1, 80) and w_a(32, 90) and w_a(1, None)
    assert not w_a(33, 90)  # a 64-row tile
    for cap in (80, 90, 100, 103):
        assert tile(1, cap) == tile(16, cap) == (True, SLIM_BLOCK_N, SLIM_NUM_WARPS), cap
    assert tile(32, 90) == tile(32, 80) == (True, 128, 4)
    for cap in (100, 103):  # 32 rows: the slim tile where four warps would run tcgen05
        assert tile(32, cap) == tile(17, cap) == (True, SLIM_BLOCK_N, SLIM_NUM_WARPS), cap
        assert not w_a(32, cap, block_n=128, num_warps=4, weight_a=None)
    assert not w_a(1, 90, weight_a=False) and w_a(32, 90, weight_a=True)
    assert tile(1, 90, block_n=128, num_warps=4) == (True, 128, 4)
    # twice the programs for the slim tile (n = 4096: 64 vs 32 column tiles, K split alike)
    slim = launch_of(1, 90, n=4096)
    wide = launch_of(1, 90, n=4096, block_n=128, num_warps=4)
    programs = [g.grid[0] * g.grid[1] * g.grid[2] for g in (slim, wide)]
    assert programs[0] == 2 * programs[1], programs
    from vllm_mxplus.backends.triton.decode_gemm import weight_is_a

    with capture_launches(90):
        assert weight_is_a(torch.device("meta"), False, 16)
        assert not weight_is_a(torch.device("meta"), True, 16)  # NVFP4
    from vllm_mxplus.backends.triton.decode_gemm import slim_tile, weight_kind

    dev = torch.device("meta")
    assert weight_kind(True, False, True) == "nvfp4" and weight_kind(False, True, True) == "mx+"
    assert weight_kind(False, False, True) == "e8m0-folded"
    assert weight_kind(False, False, False) == "e8m0"
    for cap in (90, 100):
        with capture_launches(cap):
            assert not slim_tile(16, True, "e8m0", dev)  # unfolded scales: four warps
            assert not slim_tile(16, False, "nvfp4", dev)  # not on x_hat's word path
            assert slim_tile(16, True, "nvfp4", dev) and slim_tile(16, True, "e8m0-folded", dev)
            # MX+ and 32 rows where four warps would run tcgen05 (sm_90's wgmma keeps them)
            assert slim_tile(16, True, "mx+", dev) == (cap == 100)
            assert slim_tile(16, True, "mx+", dev, one_row=True)  # its block maxima apart
            assert slim_tile(32, True, "e8m0-folded", dev) == (cap == 100)
            assert not slim_tile(32, True, "nvfp4", dev) and not slim_tile(64, True, "e8m0", dev)


def test_capture_without_a_capability_asks_no_gpu(monkeypatch):
    """Inside `capture_launches()` without a capability the launchers make sm_90's choices and
    never ask torch.cuda (the fake-CUDA graph guard captures on a machine without CUDA); with
    one, that GPU's choices; outside a capture a CUDA device is asked."""
    from vllm_mxplus.backends.triton import launch

    def no_gpu(device=None):
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    cuda = torch.device("cuda")
    with launch.capture_launches():
        assert launch.target_capability(cuda) is None
    with launch.capture_launches(100):
        assert launch.target_capability(cuda) == 100
    monkeypatch.setattr(launch, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    assert launch.target_capability(cuda) == 89
    assert launch.target_capability(torch.device("cpu")) is None


@pytest.mark.parametrize("m", [1, 24])
def test_x_sigma_same_bits_as_the_mbs_bytes(m, triton_device, monkeypatch):
    """x_sigma (`act_quant_hat`'s fp32 sigmas, read by the word path instead of each sigma
    computed from its MBS byte): the same output bits as without it, and the launch reads
    them (X_SIGMA). Bad sigmas are named in a ValueError."""
    from vllm_mxplus.backends.triton import decode_gemm as dg
    from vllm_mxplus.backends.triton.act_quant import act_quant_hat

    launched = []
    real = dg.launch
    monkeypatch.setattr(dg, "launch", lambda *a, **kw: (launched.append(kw), real(*a, **kw)))
    k, n = 512, 256
    gen = torch.Generator().manual_seed(m + 3)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(triton_device)
    qw = quantize((torch.randn(n, k, generator=gen) * 0.02).to(triton_device), "mxfp4-mbs-s")
    codes, scales, mbs, _, x_hat, sigma = act_quant_hat(x, "mxfp4-mbs-s", macro_block=128)
    assert sigma is not None
    w = (qw.codes, qw.scales, qw.mbs, k, None, torch.float32)

    def run_with(sg):
        return decode_gemm(codes, scales, mbs, *w, x_hat=x_hat, x_sigma=sg, macro_block=128,
                           w_small_scales=True)  # fmt: skip

    y_bytes, y_sigma = run_with(None), run_with(sigma)
    flags = [kw["X_SIGMA"] for kw in launched if "X_SIGMA" in kw]
    assert flags == [False, True]
    assert torch.equal(y_sigma, y_bytes)
    # the check can fail: the kernel reads the sigmas given (one row's first one doubled)
    bad = sigma.clone()
    bad[0, 0] *= 2
    assert not torch.equal(run_with(bad), y_bytes)
    with pytest.raises(ValueError, match="x_sigma must be float32"):
        run_with(sigma.to(torch.float64))
    with pytest.raises(ValueError, match="x_sigma must be float32"):
        run_with(sigma[:, :-1])
    with pytest.raises(ValueError, match="x_sigma comes with"):
        decode_gemm(codes, scales, mbs, *w, x_sigma=sigma, macro_block=128)


@pytest.mark.parametrize("weight_a", [True, False], ids=["weight-A", "weight-B"])
@pytest.mark.parametrize("m", [1, 24])
def test_serving_path_either_operand_within_bound(weight_a, m, triton_device, monkeypatch):
    """The serving path (x_hat, folded weight scales, whole tiles) with the weight as either
    operand of the dots (`weight_is_a`'s choice overridden): the same bound. Runs on CUDA
    too (gpu_check's pytest step), where the two are different machine code (wgmma with the
    weight in registers vs mma.sync on sm_90)."""
    from vllm_mxplus.backends.triton import decode_gemm as dg
    from vllm_mxplus.backends.triton.act_quant import act_quant_hat

    launched = []
    real = dg.launch
    monkeypatch.setattr(dg, "launch", lambda *a, **kw: (launched.append(kw), real(*a, **kw)))
    k, n = 512, 256
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(triton_device)
    qw = quantize((torch.randn(n, k, generator=gen) * 0.02).to(triton_device), "mxfp4-mbs-s")
    codes, scales, mbs, _, x_hat, _ = act_quant_hat(x, "mxfp4-mbs-s", macro_block=128)
    y = decode_gemm(
        codes, scales, mbs, qw.codes, qw.scales, qw.mbs, k, None, torch.float32, x_hat=x_hat,
        macro_block=128, w_small_scales=True, weight_a=weight_a,
    )  # fmt: skip
    assert_within_bound(y, *reference(quantize(x, "mxfp4-mbs-s"), qw), torch.float32)
    gemm = [kw for kw in launched if "W_A" in kw]
    assert len(gemm) == 1 and gemm[0]["WORDS"] and gemm[0]["X_HAT"]
    assert gemm[0]["W_A"] == weight_a
