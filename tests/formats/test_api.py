"""The public API: names, shapes of every field, dtypes, errors, devices."""

import pytest
import torch
from spec_reference import ref_quantize

from vllm_mxplus.formats import (
    FORMATS,
    SCHEMES,
    check_format_macro_block,
    check_macro_block,
    fake_quantize,
    get_format,
    get_scheme,
    qsnr,
    quantize,
)

ALL = list(FORMATS)


def test_names():
    assert set(FORMATS) == {
        "mxfp4-ocp",
        "mxplus",
        "mxfp4-16",
        "mxfp4-16-oas",
        "mxfp4-mbs-s",
        "mxfp4-mbs-d",
        "nvfp4",
    }
    assert get_scheme("mxfp4-mbs") == SCHEMES["mxfp4-mbs"]
    assert (SCHEMES["mxfp4-mbs"].weight_format, SCHEMES["mxfp4-mbs"].activation_format) == (
        "mxfp4-mbs-d",
        "mxfp4-mbs-s",
    )
    assert (SCHEMES["mxfp4-mbs-h"].weight_format, SCHEMES["mxfp4-mbs-h"].activation_format) == (
        "mxfp4-mbs-d",
        "mxfp4-mbs-s",
    )
    for s in SCHEMES.values():
        assert s.weight_format in FORMATS and s.activation_format in FORMATS


@pytest.mark.parametrize("fmt", ALL)
@pytest.mark.parametrize("lead", [(), (3,), (2, 5)], ids=lambda s: f"lead{len(s)}")
@pytest.mark.parametrize("k", [1, 17, 100, 576, 1536], ids=lambda k: f"K{k}")
def test_shapes(fmt, lead, k):
    x = torch.randn(*lead, k)
    q = quantize(x, fmt)
    spec = FORMATS[fmt]
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (*lead, -(-k // 2))
    assert q.scales.shape == (*lead, -(-k // spec.block_size))
    assert q.scales.dtype == (torch.float8_e4m3fn if fmt == "nvfp4" else torch.uint8)
    assert (q.mbs is not None) == bool(spec.mbs)
    if q.mbs is not None:
        assert q.mbs.dtype == torch.uint8 and q.mbs.shape == (*lead, -(-k // 128))
    assert (q.global_scale is not None) == (fmt == "nvfp4")
    assert (q.block_max_index is not None) == (fmt == "mxplus")
    out = q.dequantize()
    assert out.shape == x.shape and out.dtype == torch.float32
    # the dequantized values, re-derived independently (tests/spec_reference.py)
    ref = ref_quantize(x.reshape(-1, k).numpy(), fmt)["x_hat"]
    assert torch.equal(out.reshape(-1, k), torch.from_numpy(ref))
    assert bool(torch.isfinite(out).all())
    if k >= 16:
        assert qsnr(x, out) > 12.0  # 4-bit formats land near 17-21 dB on Gaussian data


@pytest.mark.parametrize("fmt", ALL)
def test_dtypes_convert_exactly(fmt):
    x = torch.randn(4, 200).bfloat16()
    ref = fake_quantize(x.float(), fmt)
    assert torch.equal(fake_quantize(x, fmt), ref)
    h = torch.randn(4, 200).half()
    assert torch.equal(fake_quantize(h, fmt), fake_quantize(h.float(), fmt))
    assert quantize(x, fmt).dequantize(torch.bfloat16).dtype == torch.bfloat16


def test_errors():
    with pytest.raises(ValueError, match="unknown format 'mxfp5'"):
        quantize(torch.randn(4, 16), "mxfp5")
    with pytest.raises(ValueError, match="empty last dim"):
        quantize(torch.randn(4, 0), "mxfp4-ocp")
    with pytest.raises(ValueError, match="empty last dim"):
        quantize(torch.tensor(1.0), "mxfp4-ocp")
    with pytest.raises(ValueError, match="unsupported dtype torch.int32"):
        quantize(torch.ones(4, 16, dtype=torch.int32), "nvfp4")
    with pytest.raises(ValueError, match="unsupported dtype torch.float64"):
        quantize(torch.ones(4, 16, dtype=torch.float64), "nvfp4")
    with pytest.raises(ValueError, match="macro_block"):
        quantize(torch.ones(4, 16), "mxfp4-mbs-s", macro_block=24)
    with pytest.raises(ValueError, match="unknown scheme"):
        get_scheme("fp4")


@pytest.mark.parametrize("macro", [32, 64, 256, 512])
def test_macro_block_ablation_sizes(macro):
    x = torch.randn(3, 1000)
    q = quantize(x, "mxfp4-mbs-s", macro_block=macro)
    assert q.mbs.shape == (3, -(-1000 // macro))
    assert q.dequantize().shape == x.shape


def test_ordering_on_gaussian_weights():
    """Paper Fig. 6 ordering on Gaussian data: OCP < 16-OAS < MBS-S < MBS-D, NVFP4 on top."""
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    q = {f: qsnr(x, fake_quantize(x, f)) for f in ALL}
    assert q["mxfp4-ocp"] < q["mxfp4-16"] < q["mxfp4-16-oas"] < q["mxfp4-mbs-s"] < q["mxfp4-mbs-d"]
    assert q["mxfp4-ocp"] < q["mxplus"]
    assert q["nvfp4"] > q["mxfp4-16-oas"]


def test_nvfp4_per_row_global_scale():
    x = torch.randn(5, 64)
    x[2] *= 1000
    q = quantize(x, "nvfp4", per_row=True)
    assert q.global_scale.shape == (5, 1)
    for i in range(5):  # each row alone gives the same numbers: batching never matters
        assert torch.equal(q.dequantize()[i], fake_quantize(x[i], "nvfp4"))


def test_qsnr_definition():
    x = torch.tensor([3.0, 4.0])
    assert qsnr(x, x) == float("inf")
    assert qsnr(x, torch.tensor([3.0, 3.0])) == pytest.approx(
        10 * torch.log10(torch.tensor(25.0)).item()
    )
    with pytest.raises(ValueError, match="shapes differ"):
        qsnr(x, x[:1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ALL)
def test_cuda_matches_cpu(fmt):
    x = torch.randn(64, 576).bfloat16()
    a, b = quantize(x, fmt), quantize(x.cuda(), fmt)
    assert torch.equal(a.codes, b.codes.cpu())
    assert torch.equal(a.scales.view(torch.uint8), b.scales.cpu().view(torch.uint8))
    assert torch.equal(a.dequantize(), b.dequantize().cpu())


@pytest.mark.parametrize("mb", [0, -16, 8, 24, 100])
def test_macro_block_rule_is_one_rule(mb: int) -> None:
    """The scheme-level check and the format-level check refuse the same macro blocks, with
    the caller's name for the value."""
    with pytest.raises(
        ValueError,
        match=rf"--mb {mb}: a macro block must be a positive multiple of the block size 16",
    ):
        check_macro_block("mxfp4-mbs", mb, "--mb")
    with pytest.raises(
        ValueError,
        match=rf"--mb {mb}: a macro block must be a positive multiple of the block size 16",
    ):
        check_format_macro_block(get_format("mxfp4-mbs-s"), mb, "--mb")


@pytest.mark.parametrize("mb", [16, 32, 48, 128, 2048])
def test_macro_block_rule_accepts_multiples_of_the_block(mb: int) -> None:
    check_macro_block("mxfp4-mbs", mb)
    check_format_macro_block(get_format("mxfp4-mbs-d"), mb)
