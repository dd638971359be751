"""NVFP4 on the Triton decode GEMM: E4M3 block scales under fp32 global scales, read from the
codes or from `act_quant_hat`'s x_hat (value * s, the global scale left out), the sums
multiplied by g_x[m] * g_w[n] as `mx_gemm` does.

Checked against the float64 product of the `formats` dequantizations (the spec's x_hat =
fp32(fp32(v * s) * g)) within test_triton_decode_gemm's bound: 2^-16 * |x_hat| @ |W_hat|^T
covers the fp32 sums of K exact products plus the two products by g per term (mx_gemm's
docstring), and the output dtype's rounding. The x_hat path gives the same bits as the codes
path (the same values in the same order). Runs on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_decode_gemm import assert_within_bound, reference

from vllm_mxplus.backends.base import LinearSpec
from vllm_mxplus.backends.triton.act_quant import act_quant_hat
from vllm_mxplus.backends.triton.decode_gemm import decode_gemm
from vllm_mxplus.backends.triton.launch import capture_launches, last_gemm
from vllm_mxplus.backends.triton.linear import TritonDecodeBackend
from vllm_mxplus.formats import get_scheme, quantize


def operands(m: int, k: int, n: int, device, seed: int = 0):
    """NVFP4 activations (a global scale per row, as served) and a weight (one global scale,
    repeated per row as the backends hold it), rows of very different magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=gen))
    w = torch.randn(n, k, generator=gen) * 0.02
    w[:, :: max(1, k // 7)] *= 20.0
    qx = quantize(x.to(torch.bfloat16).to(device), "nvfp4", per_row=True)
    qw = quantize(w.to(torch.bfloat16).to(device), "nvfp4")
    return qx, qw


def w_global(qw) -> torch.Tensor:
    return qw.global_scale.to(torch.float32).reshape(-1).expand(qw.codes.shape[0]).contiguous()


def run(qx, qw, k, x_hat=None, **kw):
    kw.setdefault("macro_block", 128)
    return decode_gemm(
        qx.codes, qx.scales, None, qw.codes, qw.scales, None, k, x_hat=x_hat,
        x_global=qx.global_scale, w_global=w_global(qw), **kw,
    )  # fmt: skip


def decode_layer(scheme: str, k: int, m: int, device):
    """A 48 x k layer of `scheme` loaded by `triton-decode`, and m bf16 rows for it:
    (layer, backend, packed weight, x)."""
    n = 48
    spec = LinearSpec(get_scheme(scheme), n, k, torch.bfloat16)
    gen = torch.Generator().manual_seed(m)
    qw = quantize((torch.randn(n, k, generator=gen) * 0.1).to(device), spec.weight_format)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).to(device)
    layer = torch.nn.Module()
    backend = TritonDecodeBackend(spec)
    backend.process_weights_after_loading(layer, qw)
    return layer, backend, qw, x


SHAPES = [(1, 100, 64), (5, 1024, 300), (16, 576, 256), (33, 4096, 64), (3, 1201, 80)]


@pytest.mark.parametrize("m,k,n", SHAPES, ids=[f"M{m}-K{k}-N{n}" for m, k, n in SHAPES])
def test_matches_float64_reference(m, k, n, triton_device):
    qx, qw = operands(m, k, n, triton_device, seed=m + k)
    with capture_launches() as launches:  # recorded with the GPU's tiles, not run
        run(qx, qw, k, out_dtype=torch.float32)
    assert last_gemm(launches).kwargs["NVFP4"] is True
    y = run(qx, qw, k, out_dtype=torch.float32)
    assert y.shape == (m, n)
    assert_within_bound(y, *reference(qx, qw), torch.float32)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bias_split_k_and_output_dtype(out_dtype, split_k, triton_device):
    qx, qw = operands(4, 1201, 96, triton_device, seed=split_k)
    bias = (torch.randn(96) * 0.5).to(out_dtype).to(triton_device)
    y = run(qx, qw, 1201, bias=bias, out_dtype=out_dtype, split_k=split_k)
    assert y.dtype == out_dtype
    assert_within_bound(y, *reference(qx, qw, bias), out_dtype)


@pytest.mark.parametrize("m,k", [(1, 1024), (7, 640), (20, 4096)])
def test_x_hat_path_same_bits_as_codes(m, k, triton_device):
    """`act_quant_hat` of nvfp4 gives the served activation's codes, scales and global scales,
    and the GEMM reading its x_hat returns the same bits as reading the codes."""
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16).to(triton_device)
    _, qw = operands(1, k, 128, triton_device, seed=1)
    codes, scales, mbs, gs, x_hat, _ = act_quant_hat(x, "nvfp4", macro_block=128)
    qx = quantize(x, "nvfp4", per_row=True)
    assert mbs is None and torch.equal(codes, qx.codes) and torch.equal(gs, qx.global_scale)
    kw = {"out_dtype": torch.float32}
    with capture_launches() as launches:  # recorded with the GPU's tiles, not run
        run(qx, qw, k, x_hat=x_hat, **kw)
    assert last_gemm(launches).kwargs["X_HAT"] is True
    served = run(qx, qw, k, x_hat=x_hat, **kw)
    assert torch.equal(served, run(qx, qw, k, **kw))
    assert_within_bound(served, *reference(qx, qw), torch.float32)


@pytest.mark.parametrize("weight_a", [True, False], ids=["weight-A", "weight-B"])
def test_x_hat_path_either_operand_within_bound(weight_a, triton_device):
    """NVFP4 on the x_hat word path with the weight as either operand of the dots: within
    the bound. The GPUs' 16-row launch (`decode_gemm.slim_tile`: two warps, the weight as A,
    on every GPU) is the first; the override the second."""
    m, k = 5, 1024
    gen = torch.Generator().manual_seed(11)
    x = (torch.randn(m, k, generator=gen) * 3).to(torch.bfloat16).to(triton_device)
    _, qw = operands(1, k, 192, triton_device, seed=4)
    _, _, _, _, x_hat, _ = act_quant_hat(x, "nvfp4", macro_block=128)
    qx = quantize(x, "nvfp4", per_row=True)
    for cap in (80, 90, 100):
        with capture_launches(cap) as launches:  # recorded with that GPU's tiles, not run
            run(qx, qw, k, x_hat=x_hat)
        gemm = last_gemm(launches)
        assert gemm.kwargs["W_A"] and gemm.kwargs["NVFP4"] and gemm.kwargs["num_warps"] == 2
    y = run(qx, qw, k, x_hat=x_hat, weight_a=weight_a, out_dtype=torch.float32)
    assert_within_bound(y, *reference(qx, qw), torch.float32)


@pytest.mark.parametrize("hat", [False, True], ids=["codes", "x_hat"])
def test_every_weight_scale_byte_folds(hat, triton_device):
    """The word path folds every E4M3 weight scale into the weight's values, built from the
    scale's bits (`gemm_blocks.e4m3_fold_scales`): each of the 254 finite bytes (zero, the
    seven subnormals, every normal up to 448, the negative ones) lies on some block and the
    output is within the bound of the float64 reference; a NaN byte (0x7F, 0xFF) makes its
    weight row's output column NaN and no other."""
    m, k, n = 3, 512, 64
    qx, qw = operands(m, k, n, triton_device, seed=9)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    blocks = qw.scales.numel()
    order = torch.randperm(blocks, generator=torch.Generator().manual_seed(2))
    scales = finite[order % finite.numel()].reshape(qw.scales.shape)
    qw.scales.view(torch.uint8).copy_(scales.to(triton_device))
    x_hat = None
    if hat:
        x = (torch.randn(m, k, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
        codes, xs, _, gs, x_hat, _ = act_quant_hat(x.to(triton_device), "nvfp4", macro_block=128)
        qx = quantize(x.to(triton_device), "nvfp4", per_row=True)
    with capture_launches() as launches:  # recorded, not run: the path the run below takes
        run(qx, qw, k, x_hat=x_hat, out_dtype=torch.float32)
    assert last_gemm(launches).kwargs["W_FOLD"] and last_gemm(launches).kwargs["NVFP4"]
    assert last_gemm(launches).kwargs["X_HAT"] is hat
    y = run(qx, qw, k, x_hat=x_hat, out_dtype=torch.float32)
    assert not y.isnan().any()
    assert_within_bound(y, *reference(qx, qw), torch.float32)
    qw.scales.view(torch.uint8)[5, 3] = 0x7F
    qw.scales.view(torch.uint8)[9, 0] = 0xFF
    y = run(qx, qw, k, x_hat=x_hat, out_dtype=torch.float32).cpu()
    assert y[:, [5, 9]].isnan().all()
    keep = [c for c in range(n) if c not in (5, 9)]
    assert not y[:, keep].isnan().any()


def test_nan_inf_and_zero_rows(triton_device):
    """A NaN or Inf block gets the NaN scale (0x7F): its output row is NaN, as the spec's
    x_hat makes it; a zero row (global scale 0) gives exactly the bias."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 300, generator=gen)
    x[1] = 0.0
    x[2, 40] = float("nan")
    x[3, 7] = float("inf")
    qx = quantize(x.to(triton_device), "nvfp4", per_row=True)
    _, qw = operands(1, 300, 48, triton_device, seed=2)
    bias = torch.randn(48).to(triton_device)
    y = run(qx, qw, 300, bias=bias, out_dtype=torch.float32).cpu()
    assert y[2].isnan().all() and y[3].isnan().all()
    assert torch.equal(y[1], bias.cpu())
    assert not y[0].isnan().any()
    assert_within_bound(y[[0, 1]], *(t[[0, 1]] for t in reference(qx, qw, bias)), torch.float32)


def test_bad_arguments_name_the_operand(triton_device):
    qx, qw = operands(2, 256, 32, triton_device)
    g = w_global(qw)
    args = (qx.codes, qx.scales, None, qw.codes, qw.scales, None, 256)
    with pytest.raises(ValueError, match="x_global"):
        decode_gemm(*args, macro_block=128, w_global=g)
    with pytest.raises(ValueError, match="w_global"):
        decode_gemm(*args, macro_block=128, x_global=qx.global_scale, w_global=g[:5])
    with pytest.raises(ValueError, match="x_scales must be float8_e4m3fn"):
        decode_gemm(qx.codes, qx.scales.view(torch.uint8), *args[2:], macro_block=128,
                    x_global=qx.global_scale, w_global=g)  # fmt: skip
    with pytest.raises(ValueError, match="MBS"):
        mbs = torch.zeros((32, 2), dtype=torch.uint8, device=triton_device)
        decode_gemm(*args[:5], mbs, 256, macro_block=128, x_global=qx.global_scale, w_global=g)
    e8 = quantize(torch.randn(32, 256).to(triton_device), "mxfp4-16-oas")
    e8x = quantize(torch.randn(2, 256).to(triton_device), "mxfp4-16-oas")
    with pytest.raises(ValueError, match="NVFP4's"):
        decode_gemm(e8x.codes, e8x.scales, None, e8.codes, e8.scales, None, 256,
                    macro_block=128, x_global=qx.global_scale)  # fmt: skip


@pytest.mark.parametrize(
    "m,given,want",
    [
        (1, False, ("_decode_gemm_kernel", 16)),
        (16, False, ("_decode_gemm_kernel", 16)),
        (40, False, ("_decode_gemm_kernel", 64)),  # the x_hat path's wide tile
        (8, True, ("_mx_gemm_kernel", None)),  # given global scales: mx_gemm's quantizer
    ],
)
def test_nvfp4_layer_runs_the_decode_gemm(m, given, want, triton_device):
    """`triton-decode` on an nvfp4 layer: the decode GEMM (E4M3 scales, x_hat where K takes
    it), or `mx_gemm` for rows with given global scales; within the bound either way."""
    layer, backend, qw, x = decode_layer("nvfp4", 512, m, triton_device)
    qx = quantize(x, "nvfp4", per_row=True)
    g = qx.global_scale if given else None
    with capture_launches() as launches:  # recorded with the GPU's tiles, not run
        backend.apply(layer, x, None, act_global_scale=g)
    y = backend.apply(layer, x, None, act_global_scale=g)
    gemm = last_gemm(launches)
    assert (gemm.kernel.__name__, gemm.kwargs.get("BLOCK_M") if want[1] else None) == want
    if want[1]:
        assert gemm.kwargs["NVFP4"] and gemm.kwargs["X_HAT"] and gemm.kwargs["W_FOLD"]
    assert_within_bound(y, *reference(qx, qw), torch.bfloat16)
