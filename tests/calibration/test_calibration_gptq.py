"""GPTQ and the input-weighted group parameters (calibration/gptq.py, formats/params.py).

* H = I: GPTQ propagates nothing, so it equals RTN of the same parameter rule bit for bit
  (the spec's rule: formats.quantize itself);
* every output is an exact encoding: re-quantizing its dequantized values with its own
  parameters returns the same codes, and the codec stores / reads it unchanged;
* on correlated inputs GPTQ's layer output error is at most RTN's;
* the input-weighted choice never loses to the spec's choice on its own objective.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_mxplus.calibration.gptq import can_fuse_rows, gptq, rtn_aware, split_rows
from vllm_mxplus.checkpoint.codec import decode, encode
from vllm_mxplus.formats import FORMATS, QuantizedTensor, quantize
from vllm_mxplus.formats.constants import MACRO_BLOCK, ceil_div
from vllm_mxplus.formats.e2m1 import unpack_fp4
from vllm_mxplus.formats.mbs_search import mbs_dynamic
from vllm_mxplus.formats.mx import dequantize_mbs, quantize_mbs
from vllm_mxplus.formats.params import GroupParams, choose_params, padded_k, quantize_columns

ALL_FORMATS = list(FORMATS)
SHAPES = [(1, 64), (33, 200), (16, 576)]  # K = 200, 576: partial blocks and macro blocks
SHAPE_IDS = ["n1k64", "n33k200", "n16k576"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).contiguous().view(torch.uint8)


def assert_same_encoding(a: QuantizedTensor, b: QuantizedTensor, what: str) -> None:
    for field in ("codes", "scales", "mbs", "block_max_index", "global_scale"):
        x, y = getattr(a, field), getattr(b, field)
        assert (x is None) == (y is None), f"{what}: {field} present in only one"
        if x is not None:
            bad = (_bits(x) != _bits(y)).nonzero()
            assert bad.numel() == 0, f"{what}: {field} differs first at {tuple(bad[0].tolist())}"


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16).float()


def _correlated_inputs(k: int, tokens: int = 512, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) * 0.3 + torch.eye(k)
    scale = torch.rand(k, generator=g) * 3 + 0.1  # uneven channel energies, like activations
    return (torch.randn(tokens, k, generator=g) @ mix) * scale


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_identity_hessian_spec_rule_equals_formats_quantize(fmt: str, shape: tuple) -> None:
    w = _weight(*shape)
    expected = quantize(w, fmt)
    assert_same_encoding(
        gptq(w, torch.eye(shape[1]), fmt, "spec", macro_block=MACRO_BLOCK), expected, f"gptq {fmt}"
    )
    assert_same_encoding(
        rtn_aware(w, torch.ones(shape[1]), fmt, "spec", macro_block=MACRO_BLOCK),
        expected,
        f"rtn {fmt}",
    )


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_identity_hessian_weighted_rule_equals_rtn_aware(fmt: str, shape: tuple) -> None:
    w = _weight(*shape)
    k = shape[1]
    h = torch.diag(torch.rand(k, generator=torch.Generator().manual_seed(3)) + 0.5)
    # a diagonal H: GPTQ's error feedback vanishes, the weighted choice sees diag(H)
    assert_same_encoding(
        gptq(w, h, fmt, macro_block=MACRO_BLOCK),
        rtn_aware(w, torch.diagonal(h), fmt, macro_block=MACRO_BLOCK),
        fmt,
    )


def _own_params(q: QuantizedTensor, kp: int) -> GroupParams:
    def pad(t: torch.Tensor | None, n: int, value: int = 0) -> torch.Tensor | None:
        if t is None:
            return None
        extra = n - t.shape[-1]
        return (
            torch.cat([t, torch.full((t.shape[0], extra), value, dtype=t.dtype)], -1)
            if extra
            else t
        )

    spec = q.spec
    nb = kp // spec.block_size
    return GroupParams(
        pad(q.scales.view(torch.uint8), nb).view(q.scales.dtype),
        pad(q.mbs, kp // q.macro_block),
        pad(q.block_max_index, nb, 255),
        q.global_scale,
        macro_block=q.macro_block,
    )


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("method", ["gptq", "rtn-aware"])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=SHAPE_IDS[1:])
def test_output_is_exact_encoding(fmt: str, method: str, shape: tuple) -> None:
    n, k = shape
    w = _weight(n, k)
    x = _correlated_inputs(k)
    h = x.T @ x
    q = (
        gptq(w, h, fmt, macro_block=MACRO_BLOCK)
        if method == "gptq"
        else rtn_aware(w, torch.diagonal(h) / len(x), fmt, macro_block=MACRO_BLOCK)
    )
    w_hat = q.dequantize()
    kp = padded_k(fmt, k, macro_block=MACRO_BLOCK)
    codes, again = quantize_columns(fmt, F.pad(w_hat, (0, kp - k)), _own_params(q, kp), 0)
    assert torch.equal(unpack_fp4(q.codes, k), codes[:, :k]), f"{fmt}: codes changed"
    assert torch.equal(again[:, :k], w_hat), f"{fmt}: values changed"
    stored = decode(encode(q), fmt, (n, k), MACRO_BLOCK)
    assert torch.equal(stored.dequantize(), w_hat), f"{fmt}: codec round trip changed values"


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_weighted_choice_never_worse_than_spec(fmt: str) -> None:
    n, k = 32, 384
    w = _weight(n, k, seed=7)
    d = torch.rand(k, generator=torch.Generator().manual_seed(8)).square() + 1e-3
    g = quantize(w, fmt).global_scale

    def werr(p: GroupParams) -> torch.Tensor:
        _, w_hat = quantize_columns(fmt, w, p, 0)
        return ((w - w_hat).square() * d).sum(-1, dtype=torch.float64)

    e_spec, e_w = (
        werr(choose_params(fmt, w, g, macro_block=MACRO_BLOCK)),
        werr(choose_params(fmt, w, g, macro_block=MACRO_BLOCK, weights=d)),
    )
    # the weighted objective uses the exact quotient value*X/F (formats/mbs_search.py): a choice
    # can lose to the spec's by fp32 rounding only, ~2^-23 relative
    assert bool((e_w <= e_spec * (1 + 1e-6)).all()), f"{fmt}: weighted choice lost on some row"
    assert float(e_w.sum()) < float(e_spec.sum()), f"{fmt}: weighted choice gained nothing"


@pytest.mark.parametrize("macro", [MACRO_BLOCK, 32, 48], ids=lambda m: f"mb{m}")
@pytest.mark.parametrize("k", [128, 576], ids=["k128", "k576"])
def test_weighted_mbs_byte_equals_bruteforce(k: int, macro: int) -> None:
    n = 24
    w = _weight(n, k, seed=11)
    d = torch.rand(k, generator=torch.Generator().manual_seed(12)) ** 3
    kp = ceil_div(k, macro) * macro
    wp, dp = F.pad(w, (0, kp - k)), F.pad(d, (0, kp - k))
    nm = kp // macro
    best = torch.full((n, nm), float("inf"), dtype=torch.float64)
    best_m = torch.zeros(n, nm, dtype=torch.uint8)
    for m in range(256):
        mm = torch.full((n, nm), m, dtype=torch.uint8)
        codes, scale = quantize_mbs(wp, mm)
        err = (wp.double() - dequantize_mbs(codes, scale, mm).double()).square() * dp.double()
        err = err.reshape(n, nm, macro).sum(-1)
        better = err < best * (1 - 1e-9)  # ties (to fp32 rounding) keep the smaller m
        best = torch.where(better, err, best)
        best_m = torch.where(better, mm, best_m)
    assert torch.equal(mbs_dynamic(wp, macro, weights=dp), best_m)


@pytest.mark.parametrize("bad", ["nan", "shape", "hessian"])
def test_bad_input_names_the_tensor(bad: str) -> None:
    w = _weight(8, 32)
    h = torch.eye(32)
    if bad == "nan":
        w[0, 0] = float("nan")
    elif bad == "shape":
        w = w[None]
    else:
        h = torch.eye(31)
    with pytest.raises(ValueError, match="layers.3.q_proj"):
        gptq(w, h, "mxfp4-mbs-d", name="layers.3.q_proj", macro_block=MACRO_BLOCK)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_value_path_equals_quantize_columns(fmt: str) -> None:
    from vllm_mxplus.formats.params import _values

    w = _weight(40, 256, seed=13)
    p = choose_params(fmt, w, quantize(w, fmt).global_scale, macro_block=MACRO_BLOCK)
    assert torch.equal(_values(fmt, w, p), quantize_columns(fmt, w, p, 0)[1])


@pytest.mark.parametrize("fmt", [f for f in ALL_FORMATS if can_fuse_rows(f)])
def test_stacked_siblings_equal_separate_gptq(fmt: str) -> None:
    """Calibration runs q/k/v (gate/up) as one GPTQ over their stacked rows: each part must
    be what GPTQ of that weight alone gives, bit for bit (GPTQ is row by row under one H)."""
    k = 200
    parts = [_weight(n, k, seed=20 + n) for n in (24, 8, 8)]
    x = _correlated_inputs(k)
    h = x.T @ x
    fused = split_rows(
        gptq(torch.cat(parts, 0), h, fmt, macro_block=MACRO_BLOCK), [p.shape[0] for p in parts]
    )
    for i, (p, q) in enumerate(zip(parts, fused)):
        assert_same_encoding(q, gptq(p, h, fmt, macro_block=MACRO_BLOCK), f"{fmt} part {i}")
    assert not can_fuse_rows("nvfp4")  # a per-tensor global scale: not by rows


# --- a macro block other than 128 (`mxplus quantize --macro-block N`) ----------------------

MBS_FORMATS = [f for f in ALL_FORMATS if FORMATS[f].mbs]  # mxfp4-mbs-s, mxfp4-mbs-d
# 32: the study's; 48: not a divisor of GPTQ's 128-column lazy batch (rounded up to 144)
MACROS = [32, 48]


@pytest.mark.parametrize("macro", MACROS, ids=lambda m: f"mb{m}")
@pytest.mark.parametrize("fmt", MBS_FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_macro_block_identity_hessian_equals_formats_quantize(
    fmt: str, shape: tuple, macro: int
) -> None:
    """H = I (uniform input weights): GPTQ and rtn-aware with the spec's parameter rule are
    RTN at that macro block, formats.quantize(w, fmt, macro_block=N), bit for bit."""
    w = _weight(*shape)
    k = shape[1]
    expected = quantize(w, fmt, macro_block=macro)
    assert expected.mbs is not None and expected.mbs.shape[-1] == ceil_div(k, macro)
    for what, q in (
        ("gptq", gptq(w, torch.eye(k), fmt, "spec", macro_block=macro)),
        ("rtn-aware", rtn_aware(w, torch.ones(k), fmt, "spec", macro_block=macro)),
    ):
        assert q.macro_block == macro, what
        assert_same_encoding(q, expected, f"{what} {fmt} N={macro}")
        assert torch.equal(q.dequantize(), expected.dequantize()), what


@pytest.mark.parametrize("macro", MACROS, ids=lambda m: f"mb{m}")
@pytest.mark.parametrize("fmt", MBS_FORMATS)
def test_macro_block_diagonal_hessian_gptq_equals_rtn_aware(fmt: str, macro: int) -> None:
    n, k = 33, 200
    w = _weight(n, k)
    h = torch.diag(torch.rand(k, generator=torch.Generator().manual_seed(3)) + 0.5)
    q = gptq(w, h, fmt, macro_block=macro)
    assert_same_encoding(q, rtn_aware(w, torch.diagonal(h), fmt, macro_block=macro), fmt)
    assert q.mbs is not None and q.mbs.shape == (n, ceil_div(k, macro))


@pytest.mark.parametrize("macro", MACROS, ids=lambda m: f"mb{m}")
@pytest.mark.parametrize("fmt", MBS_FORMATS)
@pytest.mark.parametrize("method", ["gptq", "rtn-aware"])
def test_macro_block_output_is_exact_encoding(fmt: str, method: str, macro: int) -> None:
    """Re-quantizing the output with its own parameters (bytes per N) returns it unchanged;
    so does formats' MBS quantization for the given bytes, and the codec at N."""
    n, k = 33, 200
    w = _weight(n, k)
    x = _correlated_inputs(k)
    h = x.T @ x
    if method == "gptq":
        q = gptq(w, h, fmt, macro_block=macro)
    else:
        q = rtn_aware(w, torch.diagonal(h) / len(x), fmt, macro_block=macro)
    assert q.macro_block == macro
    w_hat = q.dequantize()
    kp = padded_k(fmt, k, macro)
    codes, again = quantize_columns(fmt, F.pad(w_hat, (0, kp - k)), _own_params(q, kp), 0)
    assert torch.equal(unpack_fp4(q.codes, k), codes[:, :k]), f"{fmt}: codes changed"
    assert torch.equal(again[:, :k], w_hat), f"{fmt}: values changed"
    # the specification's MBS quantization (formats.mx) for these bytes gives the same values
    assert q.mbs is not None
    mbs_codes, mbs_scale = quantize_mbs(F.pad(w_hat, (0, kp - k)), _own_params(q, kp).mbs)
    spec_values = dequantize_mbs(mbs_codes, mbs_scale, _own_params(q, kp).mbs)
    assert torch.equal(spec_values[:, :k], w_hat), f"{fmt}: formats.mx disagrees"
    stored = decode(encode(q), fmt, (n, k), macro_block=macro)
    assert torch.equal(stored.dequantize(), w_hat), f"{fmt}: codec round trip changed values"


@pytest.mark.parametrize(
    "fmt,macro",
    [(f, MACRO_BLOCK) for f in ALL_FORMATS] + [(f, 32) for f in MBS_FORMATS],
    ids=lambda v: f"mb{v}" if isinstance(v, int) else v,
)
def test_gptq_layer_output_error_at_most_rtn(fmt: str, macro: int) -> None:
    """Every format at the default macro block; the MBS formats also at macro block 32."""
    n, k = 48, 256
    w = _weight(n, k, seed=5)
    x = _correlated_inputs(k, tokens=1024)
    h = x.T @ x
    ref = x @ w.T

    def out_err(q: QuantizedTensor) -> float:
        return float((ref - x @ q.dequantize().T).square().sum())

    e_rtn = out_err(quantize(w, fmt, macro_block=macro))
    e_gptq = out_err(gptq(w, h, fmt, macro_block=macro))
    e_gptq_spec = out_err(gptq(w, h, fmt, "spec", macro_block=macro))
    assert e_gptq <= e_rtn, f"{fmt}: GPTQ {e_gptq:.4g} > RTN {e_rtn:.4g} at N={macro}"
    assert e_gptq_spec <= e_rtn, (
        f"{fmt}: GPTQ (spec parameters) {e_gptq_spec:.4g} > RTN {e_rtn:.4g} at N={macro}"
    )


@pytest.mark.parametrize("fmt", MBS_FORMATS)
def test_macro_block_weighted_choice_never_worse_than_spec(fmt: str) -> None:
    n, k, macro = 32, 384, 32
    w = _weight(n, k, seed=7)
    d = torch.rand(k, generator=torch.Generator().manual_seed(8)).square() + 1e-3
    spec = quantize(w, fmt, macro_block=macro)
    p_spec = choose_params(fmt, w, macro_block=macro)
    assert torch.equal(p_spec.mbs, spec.mbs) and torch.equal(p_spec.scales, spec.scales)

    def werr(p: GroupParams) -> torch.Tensor:
        _, w_hat = quantize_columns(fmt, w, p, 0)
        return ((w - w_hat).square() * d).sum(-1, dtype=torch.float64)

    e_spec, e_w = werr(p_spec), werr(choose_params(fmt, w, macro_block=macro, weights=d))
    assert bool((e_w <= e_spec * (1 + 1e-6)).all()), f"{fmt}: weighted choice lost on some row"
    assert float(e_w.sum()) < float(e_spec.sum()), f"{fmt}: weighted choice gained nothing"
