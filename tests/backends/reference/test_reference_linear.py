"""The reference backend and FakeQuantLinear against the formats spec."""

from __future__ import annotations

import pytest
import torch
from spec_reference import ref_quantize
from torch import nn

from vllm_mxplus.backends.base import LinearSpec
from vllm_mxplus.backends.reference.linear import (
    WEIGHT_ATTR,
    ReferenceBackend,
    fake_quant_activation,
    fake_quant_nvfp4_rows,
    nvfp4_row_global_scale,
)
from vllm_mxplus.backends.reference.modules import FakeQuantLinear, apply_fake_quant
from vllm_mxplus.formats import SCHEMES, fake_quantize, get_scheme, quantize

SHAPES = [(1, 256, 96), (33, 320, 64), (100, 576, 48)]  # (M, K, N); K % 128 != 0 twice


def _independent(x: torch.Tensor, fmt: str, per_row: bool = False) -> torch.Tensor:
    """x_hat from the numpy re-derivation of docs/numerics.md (tests/spec_reference.py);
    per_row: nvfp4 activations take one global scale per row (token)."""
    flat = x.float().reshape(-1, x.shape[-1]).numpy()
    return torch.from_numpy(ref_quantize(flat, fmt, per_row=per_row)["x_hat"]).reshape(x.shape)


def _expected(x, w, bias, scheme):
    """float64 y64 = x_hat W_hat^T + b from independently derived x_hat, W_hat, and the sum
    of absolute terms S = |x_hat| |W_hat|^T + |b| that bounds the fp32 rounding."""
    s = get_scheme(scheme)
    xh = _independent(x, s.activation_format, per_row=True).double()
    wh = _independent(w, s.weight_format).double()
    y, scale = xh @ wh.T, xh.abs() @ wh.abs().T
    if bias is not None:
        y, scale = y + bias.double(), scale + bias.double().abs()
    return y, scale


def _assert_within_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias, scheme):
    """fp32 GEMM of K products plus the bias add: at most (K + 1) * 2^-24 * S (recursive
    summation, docs/numerics.md, "Kernel numerics and error bounds"); then the cast to the
    output dtype: half an ulp, <= 2^-8 * |y| for bf16 (0 for fp32)."""
    y64, scale = _expected(x, w, bias, scheme)
    k = x.shape[-1]
    rel = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out.dtype]
    bound = (k + 1) * 2.0**-24 * scale + rel * y64.abs()
    err = (out.double() - y64).abs()
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} outputs out of bound, first at "
        f"{tuple(bad.nonzero()[0].tolist())}: err {err[bad].max():.3g}"
    )


@pytest.mark.parametrize("scheme", list(SCHEMES))
@pytest.mark.parametrize("m,k,n", SHAPES, ids=[f"M{m}-K{k}" for m, k, _ in SHAPES])
def test_reference_backend_equals_spec(scheme, m, k, n):
    g = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * 0.05
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    layer = nn.Module()
    spec = LinearSpec(scheme=scheme, n=n, k=k, out_dtype=torch.bfloat16)
    backend = ReferenceBackend(spec)
    backend.process_weights_after_loading(layer, quantize(w, spec.weight_format))
    assert getattr(layer, WEIGHT_ATTR).dtype == torch.float32  # dequantized once, fp32
    # the operands, bit for bit: the weight dequantized once, the activations per call
    assert torch.equal(getattr(layer, WEIGHT_ATTR), _independent(w, spec.weight_format))
    s = get_scheme(scheme)
    per_row = s.activation_format == "nvfp4"
    assert torch.equal(
        fake_quant_activation(x, s.activation_format, per_row, 128),
        _independent(x, s.activation_format, per_row=True),
    )
    out = backend.apply(layer, x, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    _assert_within_bound(out, x, w, bias, scheme)


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "nvfp4", "mxplus"])
def test_fake_quant_linear_matches_reference_backend(scheme):
    lin = nn.Linear(320, 64, bias=True)
    x = torch.randn(2, 5, 320)
    w, bias = lin.weight.detach(), lin.bias.detach()
    fq = FakeQuantLinear(lin, get_scheme(scheme))
    out = fq(x)
    # the transformers reference computes exactly what the vLLM reference backend computes
    spec = LinearSpec(scheme=scheme, n=64, k=320, out_dtype=torch.float32)
    layer = nn.Module()
    ReferenceBackend(spec).process_weights_after_loading(layer, quantize(w, spec.weight_format))
    ref = ReferenceBackend(spec).apply(layer, x, bias)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    _assert_within_bound(out.reshape(-1, 64), x.reshape(-1, 320), w, bias, scheme)


def test_apply_fake_quant_skips_lm_head():
    model = nn.ModuleDict(
        {
            "layer": nn.ModuleDict({"q_proj": nn.Linear(64, 64)}),
            "lm_head": nn.Linear(64, 10),
            "embed": nn.Embedding(10, 64),
        }
    )
    replaced = apply_fake_quant(model, "mxfp4-mbs")
    assert replaced == ["layer.q_proj"]
    assert isinstance(model["layer"]["q_proj"], FakeQuantLinear)
    assert type(model["lm_head"]) is nn.Linear
    with pytest.raises(ValueError, match="unknown scheme"):
        apply_fake_quant(model, "mxfp4-bogus")


@pytest.mark.parametrize("fmt", ["mxfp4-mbs-s", "nvfp4", "mxplus", "mxfp4-ocp"])
def test_nan_row_stays_in_its_row(fmt):
    """A NaN/Inf token poisons its own output row only: batching never spreads it."""
    x = torch.randn(4, 320)
    x[1, 7] = float("nan")
    x[2, 100] = float("inf")
    per_row = fmt == "nvfp4"
    out = fake_quant_activation(x, fmt, per_row, 128)
    clean = fake_quant_activation(x[[0, 3]], fmt, per_row, 128)
    torch.testing.assert_close(out[[0, 3]], clean, atol=0, rtol=0)
    assert out[1].isnan().any()
    if fmt != "nvfp4":  # nvfp4 of an Inf element: see formats.nvfp4 (spec is silent)
        assert out[2].isnan().any()
    w = torch.randn(16, 320)
    y = torch.nn.functional.linear(out, w)
    assert torch.isfinite(y[[0, 3]]).all()


def test_empty_batch():
    out = fake_quant_activation(torch.empty(0, 256), "mxfp4-mbs-s", False, 128)
    assert out.shape == (0, 256) and out.dtype == torch.float32


def test_nvfp4_rows_with_own_global_equals_per_row_format():
    x = torch.randn(33, 200)
    g = nvfp4_row_global_scale(x)
    torch.testing.assert_close(
        fake_quant_nvfp4_rows(x, g), fake_quantize(x, "nvfp4", per_row=True), atol=0, rtol=0
    )


def test_nvfp4_shard_with_whole_row_global_equals_unsharded():
    """Row-parallel TP: each half quantized with the whole row's g gives the unsharded result."""
    x = torch.randn(5, 256)
    g = nvfp4_row_global_scale(x)
    halves = [fake_quant_nvfp4_rows(h.contiguous(), g) for h in x.split(128, dim=-1)]
    torch.testing.assert_close(
        torch.cat(halves, -1), fake_quantize(x, "nvfp4", per_row=True), atol=0, rtol=0
    )


def test_custom_op_traces_under_torch_compile():
    """vLLM compiles the model: the activation quantizer must be one opaque graph node."""
    x = torch.randn(3, 256)
    w = torch.randn(32, 256)

    def f(x):
        return torch.nn.functional.linear(fake_quant_activation(x, "mxfp4-mbs-s", False, 128), w)

    compiled = torch.compile(f, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), f(x), atol=0, rtol=0)
