"""MX+ on the Triton decode GEMM: the activation read as x_hat (`act_quant_mxplus_hat`,
block maxima included), the weight decoded as plain E2M1 on the word path, and each weight
block max added as x_hat[m, k] * delta with delta = +-((8 + j) / 2 - E2M1(j)) * X.

Checked against the float64 product of the `formats` dequantizations within
test_triton_decode_gemm's bound (2^-16 * |x_hat| @ |W_hat|^T: delta has the plain value's sign,
so the split terms keep S; K/32 more fp32 additions), plus the output dtype's rounding. x_hat
is checked bit for bit against `formats`. Runs on CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_act_quant import assert_same_bits
from test_triton_decode_gemm import assert_within_bound, reference
from test_triton_decode_nvfp4 import decode_layer

from vllm_mxplus.backends.triton.act_quant_plus import act_quant_mxplus_hat
from vllm_mxplus.backends.triton.decode_gemm import decode_gemm
from vllm_mxplus.backends.triton.launch import capture_launches, last_gemm
from vllm_mxplus.backends.triton.plus_words import block_max_words
from vllm_mxplus.backends.triton.x_hat import to_hat_order
from vllm_mxplus.formats import quantize
from vllm_mxplus.formats.constants import NO_BLOCK_MAX


def operands(m: int, k: int, n: int, device, seed: int = 0):
    """MX+ activations from x (with their x_hat) and weights, rows of very different
    magnitudes; a few weight blocks all zero (no block max: index 255)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 6, (m, 1), generator=gen))
    w = torch.randn(n, k, generator=gen) * 0.02
    w[:, :: max(1, k // 7)] *= 20.0
    w[1, :64] = 0.0
    x = x.to(torch.bfloat16).to(device)
    qx = quantize(x, "mxplus")
    qw = quantize(w.to(torch.bfloat16).to(device), "mxplus")
    return x, qx, qw


def words(qw):
    return block_max_words(qw.codes, qw.scales, qw.block_max_index)


def run(x, qw, k, **kw):
    kw.setdefault("macro_block", 128)
    codes, scales, bm, x_hat = act_quant_mxplus_hat(x)
    return decode_gemm(codes, scales, None, qw.codes, qw.scales, None, k, x_hat=x_hat,
                       w_block_max=words(qw), **kw)  # fmt: skip


@pytest.mark.parametrize("m,k", [(1, 1024), (5, 320), (33, 4096)])
def test_x_hat_of_mxplus_is_the_spec_bit_for_bit(m, k, triton_device):
    x, qx, _ = operands(m, k, 8, triton_device, seed=k)
    codes, scales, bm, x_hat = act_quant_mxplus_hat(x)
    assert_same_bits("codes", codes, qx.codes)
    assert_same_bits("scales", scales, qx.scales)
    assert_same_bits("block-max indices", bm, qx.block_max_index)
    want = to_hat_order(qx.dequantize().to(torch.float32).cpu().to(torch.bfloat16))
    assert (qx.block_max_index != NO_BLOCK_MAX).any()
    assert_same_bits("x_hat", x_hat.cpu().view(torch.int16), want.view(torch.int16))


SHAPES = [(1, 1024, 64), (5, 1024, 300), (16, 576, 256), (33, 4096, 64), (3, 320, 80)]


@pytest.mark.parametrize("m,k,n", SHAPES, ids=[f"M{m}-K{k}-N{n}" for m, k, n in SHAPES])
def test_matches_float64_reference(m, k, n, triton_device):
    x, qx, qw = operands(m, k, n, triton_device, seed=m + k)
    assert (qw.block_max_index == NO_BLOCK_MAX).any() and (qw.block_max_index != NO_BLOCK_MAX).any()
    with capture_launches() as launches:  # recorded with the GPU's tiles, not run
        run(x, qw, k, out_dtype=torch.float32)
    assert last_gemm(launches).kwargs["PLUS"] and last_gemm(launches).kwargs["X_HAT"]
    y = run(x, qw, k, out_dtype=torch.float32)
    assert_within_bound(y, *reference(qx, qw), torch.float32)


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bias_split_k_and_output_dtype(out_dtype, split_k, m, triton_device):
    x, qx, qw = operands(m, 1280, 96, triton_device, seed=split_k)
    bias = (torch.randn(96) * 0.5).to(out_dtype).to(triton_device)
    y = run(x, qw, 1280, bias=bias, out_dtype=out_dtype, split_k=split_k)
    assert y.dtype == out_dtype
    assert_within_bound(y, *reference(qx, qw, bias), out_dtype)


@pytest.mark.parametrize("m", [1, 3])
def test_block_max_terms_matter(m, triton_device):
    """Without the weight's block maxima (every word 0) the same call leaves the bound:
    the correction is what makes the result the spec's, summed apart across the K loop per
    row (M = 3: `_block_max_rows`) or into one vector (M = 1: the kernel's ONE_ROW)."""
    x, qx, qw = operands(m, 1024, 64, triton_device, seed=9)
    with capture_launches() as launches:  # recorded, not run: the path the call below takes
        run(x, qw, 1024, out_dtype=torch.float32)
    assert last_gemm(launches).kwargs["ONE_ROW"] is (m == 1)
    assert_within_bound(run(x, qw, 1024, out_dtype=torch.float32), *reference(qx, qw),
                        torch.float32)  # fmt: skip
    none = torch.zeros_like(words(qw))
    codes, scales, _, x_hat = act_quant_mxplus_hat(x)
    y = decode_gemm(codes, scales, None, qw.codes, qw.scales, None, 1024, x_hat=x_hat,
                    w_block_max=none, out_dtype=torch.float32, macro_block=128)  # fmt: skip
    with pytest.raises(AssertionError, match="out of bound"):
        assert_within_bound(y, *reference(qx, qw), torch.float32)


def test_nan_and_zero_rows(triton_device):
    """A NaN block makes its output row NaN (scale code 255); a zero row gives the bias."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 320, generator=gen)
    x[1] = 0.0
    x[2, 40] = float("nan")
    x = x.to(triton_device)
    qx = quantize(x, "mxplus")
    _, _, qw = operands(1, 320, 48, triton_device, seed=2)
    bias = torch.randn(48).to(triton_device)
    y = run(x, qw, 320, bias=bias, out_dtype=torch.float32).cpu()
    assert y[2].isnan().all() and not y[[0, 1, 3]].isnan().any()
    assert torch.equal(y[1], bias.cpu())
    keep = [0, 1, 3]
    assert_within_bound(y[keep], *(t[keep] for t in reference(qx, qw, bias)), torch.float32)


def test_bad_arguments_name_the_operand(triton_device):
    x, qx, qw = operands(2, 256, 32, triton_device)
    codes, scales, _, x_hat = act_quant_mxplus_hat(x)
    args = (codes, scales, None, qw.codes, qw.scales, None, 256)
    with pytest.raises(ValueError, match="needs x_hat"):
        decode_gemm(*args, macro_block=128, w_block_max=words(qw))
    with pytest.raises(ValueError, match="w_block_max must be the block-max words int16"):
        decode_gemm(*args, macro_block=128, x_hat=x_hat, w_block_max=words(qw)[:, :3])
    with pytest.raises(ValueError, match="block_max_words"):  # the indices, not the words
        decode_gemm(*args, macro_block=128, x_hat=x_hat, w_block_max=qw.block_max_index)
    with pytest.raises(ValueError, match="block 32 without MBS"):
        e8 = quantize(torch.randn(32, 256).to(triton_device), "mxfp4-16-oas")
        decode_gemm(codes, e8.scales[:2], None, e8.codes, e8.scales, None, 256, block_size=16,
                    macro_block=128, x_hat=x_hat, w_block_max=words(qw))  # fmt: skip


@pytest.mark.parametrize(
    "m,k,want",
    [
        (1, 512, ("_decode_gemm_kernel", 16)),
        (16, 512, ("_decode_gemm_kernel", 16)),
        (40, 512, ("_mx_gemm_kernel", None)),  # above 16 rows: mx_gemm (wider tiles spill)
        (4, 200, ("_mx_gemm_kernel", None)),  # rows off the x_hat path: mx_gemm
    ],
)
def test_mxplus_layer_runs_the_decode_gemm(m, k, want, triton_device):
    """`triton-decode` on an MX+ layer: the decode GEMM (16-row tiles) where K takes x_hat
    and M <= 16, else `mx_gemm`; within the bound either way."""
    layer, backend, qw, x = decode_layer("mxplus", k, m, triton_device)
    with capture_launches() as launches:  # recorded with the GPU's tiles, not run
        backend.apply(layer, x, None)
    y = backend.apply(layer, x, None)
    gemm = last_gemm(launches)
    assert (gemm.kernel.__name__, gemm.kwargs.get("BLOCK_M") if want[1] else None) == want
    if want[1]:
        assert gemm.kwargs["PLUS"] and gemm.kwargs["X_HAT"] and gemm.kwargs["W_FOLD"]
    assert_within_bound(y, *reference(quantize(x, "mxplus"), qw), torch.bfloat16)


@pytest.mark.parametrize("major", [8, 9, 10])
def test_mxplus_decode_needs_sm90(major):
    """On sm_80 MX+ keeps `mx_gemm` (ptxas spills its split-K decode tile there); E8M0 and
    NVFP4 take the decode GEMM on every generation; above 16 rows or off x_hat, MX+ never."""
    from vllm_mxplus.backends.triton.linear import decode_reads

    cuda = torch.device("cuda")
    with capture_launches(major * 10):  # that GPU's choices
        assert decode_reads("mxplus", "mxplus", True, 1, cuda) == (major >= 9)
        assert not decode_reads("mxplus", "mxplus", True, 17, cuda)
        assert not decode_reads("mxplus", "mxplus", False, 1, cuda)
        assert decode_reads("nvfp4", "nvfp4", False, 1, cuda)
        assert decode_reads("mxfp4-mbs-d", "mxfp4-mbs-s", True, 100, cuda)
