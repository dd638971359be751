"""The decode GEMM's prepared activation (`x_hat`): `act_quant_hat` writes x_hat = E2M1
value * block scale in bf16, permuted into the GEMM's word order, bit for bit what the
reference dequantization gives; the decode GEMM reading it gives the same bits as reading
the codes, within the bound of test_triton_decode_gemm; a misordered x_hat is caught.

Runs on CPU under TRITON_INTERPRET=1 (tests/backends/conftest.py) or on CUDA when compiled.
"""

from __future__ import annotations

import pytest
import torch
from test_triton_act_quant import activations, assert_same_bits
from test_triton_decode_gemm import PAIRS, assert_within_bound, reference, run

from vllm_mxplus.backends.triton.act_quant import act_quant, act_quant_hat
from vllm_mxplus.backends.triton.decode_gemm import decode_gemm, takes_x_hat
from vllm_mxplus.backends.triton.launch import capture_launches, last_gemm
from vllm_mxplus.backends.triton.x_hat import HAT_CHUNK, hat_cols, to_hat_order
from vllm_mxplus.formats import get_format, quantize
from vllm_mxplus.formats.e2m1 import e2m1_decode, unpack_fp4
from vllm_mxplus.formats.e8m0 import e8m0_to_float
from vllm_mxplus.formats.mx import mbs_factor as formats_mbs_factor

FORMATS = ("mxfp4-mbs-s", "mxfp4-16-oas", "mxfp4-ocp", "nvfp4")


def hat_reference(codes: torch.Tensor, scales: torch.Tensor, k: int, fmt: str) -> torch.Tensor:
    """x_hat from `formats`' fields: E2M1 value * 2^(scale - 127) (NVFP4: * the E4M3 scale,
    without the global scale), bf16, in word order."""
    spec = get_format(fmt)
    s = scales.cpu()
    s = s.to(torch.float32) if spec.has_global_scale else e8m0_to_float(s)
    scale = s.repeat_interleave(spec.block_size, -1)[:, :k]
    return to_hat_order((e2m1_decode(unpack_fp4(codes.cpu(), k)) * scale).to(torch.bfloat16))


def assert_same_hat(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-equal bf16, except that any NaN matches any NaN (the payload is not specified)."""
    got = got.cpu()
    assert torch.equal(got.isnan(), want.isnan()), "NaN pattern differs"
    num = ~want.isnan()
    assert_same_bits("x_hat", got[num].view(torch.int16), want[num].view(torch.int16))


def test_word_order_by_formula():
    """Element 8j + 4h + p of every 128-element chunk sits at 32p + 2j + h (the decode GEMM's
    dot p takes elements 8j + p and 8j + p + 4 of word j); rows pad with zeros."""
    k = 300
    x = torch.arange(1, k + 1, dtype=torch.float32)[None, :]
    got = to_hat_order(x)
    assert got.shape == (1, hat_cols(k)) == (1, 384)
    for c in range(3):
        for j in range(16):
            for h in range(2):
                for p in range(4):
                    e = c * HAT_CHUNK + 8 * j + 4 * h + p
                    assert got[0, c * HAT_CHUNK + 32 * p + 2 * j + h] == (e + 1 if e < k else 0)


@pytest.mark.parametrize("k", [100, 576, 1024, 1536])
@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("fmt", FORMATS)
def test_act_quant_hat_bit_exact(fmt, m, k, triton_device):
    x = activations(m, k, torch.bfloat16, triton_device, seed=m + k)
    codes, scales, mbs, gs, x_hat, sigma = act_quant_hat(x, fmt, macro_block=128)
    want = act_quant(x, fmt, macro_block=128)
    assert_same_bits("codes", codes, want[0])
    assert_same_bits("scales", scales.view(torch.uint8), want[1].view(torch.uint8))
    assert (mbs is None) == (want[2] is None)
    if mbs is not None:
        assert_same_bits("mbs", mbs, want[2])
    assert (gs is None) == (want[3] is None) == (fmt != "nvfp4")
    ref = quantize(x, fmt, macro_block=128, per_row=True)
    if gs is not None:
        assert_same_bits("global scales", gs, want[3])
        assert_same_bits("global scales vs formats", gs.reshape(-1), ref.global_scale.reshape(-1))
    assert_same_bits("codes vs formats", codes, ref.codes)
    assert_same_hat(x_hat, hat_reference(ref.codes, ref.scales, k, fmt))
    # the decode GEMM's sigma = fp32(1 / F) of each MBS byte (an IEEE division, as torch's)
    assert (sigma is None) == (mbs is None)
    if sigma is not None:
        f = formats_mbs_factor(ref.mbs.cpu())
        assert_same_bits("sigma", sigma.cpu(), torch.ones_like(f) / f)
        assert (ref.mbs != 0).any()  # the check can fail: some sigma is not 1


@pytest.mark.parametrize("macro_block", [16, 32, 64])
def test_act_quant_hat_small_macro_blocks(macro_block, triton_device):
    """The decode GEMM's operand rows per macro block (`decode_gemm.sub_blocks`) read x_hat
    and one sigma per row and macro block at macro blocks under the K step: both bit for bit
    (K = 352 ends inside a chunk and inside a macro block at 64)."""
    x = activations(3, 352, torch.float32, "cpu", seed=macro_block)  # macro blocks differ:
    x = x * torch.exp2(torch.randint(-3, 3, x.shape, generator=torch.Generator().manual_seed(1)))
    x = x.to(torch.bfloat16).to(triton_device)
    codes, scales, mbs, _, x_hat, sigma = act_quant_hat(x, "mxfp4-mbs-s", macro_block=macro_block)
    ref = quantize(x, "mxfp4-mbs-s", macro_block=macro_block)
    assert_same_bits("codes", codes, ref.codes)
    assert_same_bits("mbs", mbs, ref.mbs)
    assert mbs.shape[-1] == -(-352 // macro_block) and (ref.mbs != 0).any()
    assert_same_hat(x_hat, hat_reference(ref.codes, ref.scales, 352, "mxfp4-mbs-s"))
    f = formats_mbs_factor(ref.mbs.cpu())
    assert_same_bits("sigma", sigma.cpu(), torch.ones_like(f) / f)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_act_quant_hat_special_rows(dtype, triton_device):
    """Zero and NaN rows, a NaN block, Inf, -0.0 and tiny values (scale codes near 0, whose
    x_hat is a bf16 subnormal) from fp16 / fp32 inputs."""
    x = activations(6, 640, torch.float32, "cpu", seed=5)
    x[0] = 0.0
    x[1] = float("nan")
    x[2, 17] = float("nan")
    x[3, 300] = float("inf")
    x[4] = -0.0
    if dtype == torch.float32:
        x[5] = x[5] * 2.0**-125
    x = x.to(dtype).to(triton_device)
    codes, scales, _, _, x_hat, _ = act_quant_hat(x, "mxfp4-mbs-s", macro_block=128)
    ref = quantize(x, "mxfp4-mbs-s", macro_block=128)
    assert_same_bits("codes", codes, ref.codes)
    assert_same_hat(x_hat, hat_reference(ref.codes, ref.scales, 640, "mxfp4-mbs-s"))
    if dtype == torch.float32:
        assert (ref.scales[5].cpu() < 8).any(), "no tiny block scale in row 5"


def test_act_quant_hat_rejects(triton_device):
    x = torch.randn(2, 3, 256, device=triton_device)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        act_quant_hat(x, "mxfp4-mbs-s", macro_block=128)
    with pytest.raises(ValueError, match="no Triton kernel"):
        act_quant_hat(x[0], "mxfp4-mbs-d", macro_block=128)  # a weight-only search


def _hat_operands(m, k, n, pair, device, seed):
    from test_triton_decode_gemm import operands

    qx, qw = operands(m, k, n, pair, device, seed=seed)
    _, xf = PAIRS[pair]
    x = qx.dequantize().to(torch.float32)  # quantizes to the same fields
    codes, scales, mbs, _, x_hat, _ = act_quant_hat(x, xf, macro_block=128)
    return qx, qw, x_hat


@pytest.mark.parametrize(
    "m,k,n,split",
    [(5, 1024, 512, 1), (16, 1088, 300, 1), (3, 2048, 256, 3), (1, 4096, 256, 1), (3, 320, 40, 1)],
    ids=["whole-tiles", "edges", "split-k", "K4096", "K-under-a-step"],
)  # fmt: skip
@pytest.mark.parametrize("pair", ["mbs-h", "oas16", "ocp32"])
def test_decode_reads_x_hat(pair, m, k, n, split, triton_device):
    """The GEMM on x_hat: within the bound, and the same bits as on the codes (the same
    values in the same order), with the GPU's launch reading x_hat."""
    qx, qw, x_hat = _hat_operands(m, k, n, pair, triton_device, seed=m + k)
    ref = quantize(qx.dequantize().to(torch.float32), PAIRS[pair][1], macro_block=128)
    assert torch.equal(ref.codes, qx.codes), "x_hat's activation is not the test's"
    kw = {"out_dtype": torch.float32, "split_k": split}
    with capture_launches() as launches:
        run(qx, qw, k, x_hat=x_hat, **kw)
    assert launches[0].kwargs["X_HAT"] == takes_x_hat(k) is True
    # past the rows' whole chunks (the interpreter's K steps reach 512) nothing is read:
    # NaN in the memory after x_hat would show in the output
    x_hat = torch.cat([x_hat, torch.full_like(x_hat, float("nan"))], 1)[:, : x_hat.shape[1]]
    y = run(qx, qw, k, x_hat=x_hat, **kw)
    assert_within_bound(y, *reference(qx, qw), torch.float32)
    assert torch.equal(y, run(qx, qw, k, **kw))


def test_decode_x_hat_tiny_rows(triton_device):
    """Rows whose block scales are near code 0 (x_hat bf16 subnormals, e.g. 1.5 * 2^-127):
    the same bits as the codes path, which builds every value from its bits."""
    from test_triton_decode_gemm import operands

    qx, qw = operands(4, 1024, 256, "oas16", triton_device, seed=3)
    x = qx.dequantize().to(torch.float32)
    x[1:3] *= 2.0**-125
    qx = quantize(x, "mxfp4-16-oas")
    assert (qx.scales[1].cpu() < 4).any()
    _, _, _, _, x_hat, _ = act_quant_hat(x, "mxfp4-16-oas", macro_block=128)
    kw = {"out_dtype": torch.float32}
    assert torch.equal(run(qx, qw, 1024, x_hat=x_hat, **kw), run(qx, qw, 1024, **kw))


def test_misordered_x_hat_is_caught(triton_device):
    """x_hat in natural order (no word permutation) gives wrong sums: the bound sees it."""
    qx, qw, x_hat = _hat_operands(4, 1024, 256, "oas16", triton_device, seed=2)
    natural = torch.zeros_like(x_hat)
    natural[:, :1024] = (qx.dequantize()).to(torch.bfloat16)
    y = run(qx, qw, 1024, out_dtype=torch.float32, x_hat=natural)
    with pytest.raises(AssertionError, match="out of bound"):
        assert_within_bound(y, *reference(qx, qw), torch.float32)


def test_x_hat_checked(triton_device):
    qx, qw, x_hat = _hat_operands(2, 512, 64, "oas16", triton_device, seed=1)
    for bad in (x_hat.float(), x_hat[:, :256], x_hat[:1]):
        with pytest.raises(ValueError, match="x_hat"):
            decode_gemm(qx.codes, qx.scales, None, qw.codes, qw.scales, None, 512,
                        x_hat=bad, macro_block=128)  # fmt: skip


def test_takes_x_hat():
    assert takes_x_hat(4096) and takes_x_hat(320)  # every macro block (`sub_blocks`)
    assert not takes_x_hat(1000)  # code rows do not vectorize


def test_hat_op_matches_and_traces(triton_device):
    """The custom op `triton_act_quant_hat` (fake shapes for torch.compile) and the decode op
    taking x_hat: same results as the functions, one traced graph."""
    from test_triton_decode_gemm import operands

    from vllm_mxplus.backends.triton.ops import act_quant_hat_op, decode_gemm_op

    _, qw = operands(3, 1024, 256, "mbs-h", triton_device, seed=6)
    x = torch.randn(3, 1024, device=triton_device)
    want = act_quant_hat(x, "mxfp4-mbs-s", macro_block=128)
    got = act_quant_hat_op(x, "mxfp4-mbs-s", macro_block=128)
    for g, w in zip(got, want, strict=True):
        assert (g is None and w is None) or torch.equal(g, w)
    for fmt in ("mxfp4-16-oas", "nvfp4", "mxplus"):
        torch.library.opcheck(torch.ops.vllm_mxplus.triton_act_quant_hat.default, (x, fmt, 128))

    def layer(t):
        codes, scales, mbs, _, x_hat, sigma = act_quant_hat_op(t, "mxfp4-mbs-s", macro_block=128)
        return decode_gemm_op(codes, scales, mbs, qw.codes, qw.scales, qw.mbs, 1024,
                              out_dtype=torch.float32, x_hat=x_hat, x_sigma=sigma,
                              macro_block=128, w_small_scales=True)  # fmt: skip

    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


# ----------------------------------------------------------------------------- GPU, real sizes
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("pair", ["mbs-s", "oas16"])
def test_gpu_x_hat_and_folded_scales(pair, m, cuda_device):
    """On the GPU at Llama-like sizes: x_hat bit for bit (tiny rows: bf16 subnormals), and
    the serving path (x_hat, folded scales through fma.rn.bf16x2) the same bits as the codes
    path, within the bound."""
    from test_triton_decode_gemm import operands

    k, n = 4096, 4096
    qx, qw = operands(m, k, n, pair, cuda_device, seed=m)
    x = qx.dequantize().to(torch.float32)
    x[-1] *= 2.0**-125
    xf = PAIRS[pair][1]
    qx = quantize(x, xf)
    codes, scales, _, _, x_hat, _ = act_quant_hat(x, xf, macro_block=128)
    assert_same_bits("codes", codes, qx.codes)
    assert_same_hat(x_hat, hat_reference(qx.codes, qx.scales, k, xf))
    kw = {"out_dtype": torch.float32}
    served = run(qx, qw, k, x_hat=x_hat, w_small_scales=True, **kw)
    assert torch.equal(served, run(qx, qw, k, **kw))
    assert_within_bound(served, *reference(qx, qw), torch.float32)


@pytest.mark.parametrize("major,want", [(8, 32), (9, 64), (10, 64)])
def test_widest_row_tile_needs_sm90(major, want):
    """The 64-row tile (wgmma) runs on sm_90 and later only: on sm_80 its mma.sync form spills
    (unfolded weight scales, grouped experts), so 33+ rows get 32-row tiles there; the AOT
    compiles it for those targets only."""
    from vllm_mxplus.backends.triton import decode_gemm as dg
    from vllm_mxplus.kernel_tools.aot import config_of
    from vllm_mxplus.kernel_tools.aot_drivers import min_target

    with capture_launches(major * 10):  # that GPU's tile choices
        ok = dg.sm90_or_later(torch.device("cuda"))
    assert ok == (major >= dg.WIDE_MIN_CAPABILITY)
    assert dg.gpu_block_m(40, True, ok) == want
    assert dg.gpu_block_m(20, True, ok) == 32 and dg.gpu_block_m(8, True, ok) == 16
    assert dg.gpu_block_m(40, False, ok) == 16  # the codes path keeps 16-row tiles
    assert dg.sm90_or_later(torch.device("cpu"))
    k, n = 1024, 256
    w = (torch.empty((n, k // 2), dtype=torch.uint8, device="meta"),
         torch.empty((n, k // 16), dtype=torch.uint8, device="meta"))  # fmt: skip
    for rows, target in ((64, 90), (32, 0)):
        x = (torch.empty((rows, k // 2), dtype=torch.uint8, device="meta"),
             torch.empty((rows, k // 16), dtype=torch.uint8, device="meta"))  # fmt: skip
        with capture_launches() as launches:
            dg.decode_gemm(*x, None, *w, None, k, macro_block=128, w_small_scales=True,
                           x_hat=torch.empty((rows, hat_cols(k)), dtype=torch.bfloat16,
                                             device="meta"))  # fmt: skip
        # meta tensors (the AOT's) get every tile; the 64-row one is compiled for sm_90+
        assert last_gemm(launches).kwargs["BLOCK_M"] == rows
        assert min_target(config_of(last_gemm(launches))) == target
