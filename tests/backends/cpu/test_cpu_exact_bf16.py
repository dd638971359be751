"""The exact-bf16 path of the CPU backend (backends/cpu/exact_bf16.py; docs/cpu_kernels.md,
"Large M on AMX hosts") against `vllm_mxplus.formats`, for every scheme (E8M0, NVFP4, MX+):
its operands are the spec's values bit for bit once the factors kept out of them are applied
(activation codes from the C++ quantizers, `cpu_act_quant` and `cpu_nvfp4_act_quant`;
operand / MBS factor == fake_quantize, NVFP4 operand * global scale == fake_quantize per row),
exact in bf16, and its GEMM output is within the derived bound

    |y - y64| <= gamma_n (|x_hat| |w_hat|^T + |b|) + 2^-124 (|x_hat|_1 + |w_hat|_1 + K)
                 [NVFP4, where 0 < ga gw < 2^-126: + 2^-125 K 2688^2]

(gamma_n = n u / (1 - n u), u = 2^-24; n = L + n_c + 3 with MBS (L the macro block, n_c
chunks), K + 1 for E8M0 without MBS and MX+, K + 5 for NVFP4). On this machine the GEMM is
torch's fp32 matmul with oneDNN's bf16 math mode asked for; on a CPU without native bf16 it is
a plain fp32 GEMM, and only an AMX host runs the AMX-BF16 tiles (the bound covers both,
denormals-are-zero included). The self-test must reject a path with one operand wrong.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil

import pytest
import torch
from bound_helpers import check_bound  # tests/backends, on sys.path under pytest
from test_cpu_kernels import (  # tests/backends/cpu, on sys.path
    PAIRS,
    _special_rows,
    _weight,
    corrupted,
)
from test_cpu_kernels_mxplus import special_rows as mxplus_rows
from test_cpu_kernels_mxplus import weight as mxplus_weight
from test_cpu_kernels_nvfp4 import _special_rows as nvfp4_rows
from test_cpu_kernels_nvfp4 import _weight as nvfp4_weight

from vllm_mxplus import log_once
from vllm_mxplus.backends.base import LinearSpec
from vllm_mxplus.backends.cpu import exact_bf16
from vllm_mxplus.backends.cpu.linear import CpuPackedBackend
from vllm_mxplus.formats import (
    MACRO_BLOCK,
    SCHEMES,
    QuantizedTensor,
    Scheme,
    fake_quantize,
    get_scheme,
    logical_amax,
    quantize,
    quantize_nvfp4_logical,
)
from vllm_mxplus.formats.constants import NO_BLOCK_MAX
from vllm_mxplus.platform_amx import AmxResult

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")

ALL_PAIRS = [*PAIRS, ("mxplus", "mxplus"), ("nvfp4", "nvfp4")]  # every pair cpu-packed takes
SCHEME_NAMES = sorted(SCHEMES)


def _scheme(wf: str, af: str, macro: int = MACRO_BLOCK) -> Scheme:
    s = Scheme("test", wf, af, "a test pair")
    return s if not s.has_mbs else s.with_macro_block(macro)


def _bf16_exact(t: torch.Tensor) -> bool:
    f = t[torch.isfinite(t)]
    return torch.equal(f.to(torch.bfloat16).to(torch.float32), f)


def _data(wf: str, n: int, k: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight [n, k], activation rows [rows, k]) of each family's special values: NaN, Inf,
    zero, subnormal and huge rows and blocks (the integer kernels' tests' rows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(rows, 9), k, generator=g) * 3
    if wf == "nvfp4":
        return nvfp4_weight(n, k, seed), nvfp4_rows(x)[:rows]
    if wf == "mxplus":
        return mxplus_weight(n, k, seed), mxplus_rows(x)[:rows]
    return _weight(k, n=n, seed=seed) * 0.05, _special_rows(x)[:rows]


def _row_global_scales(q: QuantizedTensor) -> torch.Tensor:
    """The spec's NVFP4 weight global scale of each row, [N] (per tensor [] or per row [N, 1])."""
    n = q.shape[0]
    return torch.broadcast_to(q._field("global_scale").reshape(-1, 1), (n, 1)).reshape(n)


def _spec_values(x, q, scheme):
    """(x_hat, w_hat, the NVFP4 global scales (ga, gw) or None) of `vllm_mxplus.formats`."""
    xq = quantize(
        x,
        scheme.activation_format,
        macro_block=scheme.macro_block,
        per_row=scheme.activations_per_row,
    )
    gs = None if xq.global_scale is None else (xq.global_scale, _row_global_scales(q))
    return xq.dequantize(), q.dequantize(), gs


def _check(y, x, q, scheme, bias, w):
    x_hat, w_hat, gs = _spec_values(x, q, scheme)
    y64, bound = exact_bf16.bound(x_hat, w_hat, bias, w.roundings, gs)
    xd, wd = x_hat.double().nan_to_num(), w_hat.double().nan_to_num()
    scale = xd.abs() @ wd.abs().T + (0 if bias is None else bias.double().abs())
    return check_bound(y, y64, scale, bound)


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=lambda p: p[0])
@pytest.mark.parametrize("k", [33, 300, 577], ids=lambda k: f"K{k}")
def test_operands_are_the_spec_values(ck, pair, k):
    """w / Fw (E8M0) or w * gw in fp32 (NVFP4) or w (MX+) == dequantize() bit for bit (NaN as
    NaN), a / Fa or a * ga == fake_quantize(x) (as values: +-0 alike), and the NVFP4 row global
    scales the spec's, bit for bit; every operand exact in bf16. The activation codes
    themselves are the C++ quantizers', bit-exact with formats (test_cpu_kernels*.py)."""
    wf, af = pair
    scheme = _scheme(wf, af)
    wsrc, x = _data(wf, 21, k, 9, seed=k)
    q = quantize(wsrc, wf)
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    wt, fw = w.weight_rows(0, w.n)
    assert wt.shape == (21, w.chunks * w.chunk) and not wt[:, k:].any()
    got_w = wt[:, :k] if fw is None else wt[:, :k] / fw.repeat_interleave(w.chunk, 1)[:, :k]
    if w.gw is not None:
        got_w = got_w * w.gw[:, None]  # the spec's (value * s) * g: one fp32 rounding
    want_w = q.dequantize()
    same_bits = got_w.view(torch.int32) == want_w.view(torch.int32)
    assert (same_bits | (torch.isnan(got_w) & torch.isnan(want_w))).all()  # any NaN payload
    a, fa, ga = exact_bf16.act_operand(x, scheme.activation, w.macro_block, w.chunk, w.chunks)
    got_x = a[:, :k] if fa is None else a[:, :k] / fa.repeat_interleave(w.chunk, 1)[:, :k]
    x_hat, _, gs = _spec_values(x, q, scheme)
    if gs is not None:
        assert ga is not None
        assert torch.equal(ga.view(torch.int32), gs[0].reshape(-1).view(torch.int32))
        got_x = got_x * ga[:, None]
    # equal values (the int8 operand carries no sign of zero: -0 and +0 feed the GEMM alike)
    same = (got_x == x_hat) | (torch.isnan(got_x) & torch.isnan(x_hat))
    assert same.all(), same.logical_not().nonzero()[:4].tolist()
    assert _bf16_exact(a) and _bf16_exact(wt)
    if wf == "mxplus":  # the block maxima are in both operands (4 significant bits)
        assert (q.block_max_index != NO_BLOCK_MAX).any()
        assert (a.abs() / a.abs().amax(-1, keepdim=True) > 6 / 7.5).sum() > 0


@pytest.mark.parametrize("pair", ALL_PAIRS, ids=lambda p: p[0])
@pytest.mark.parametrize("m", [1, 17, 64, 130], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k", [33, 577, 1536], ids=lambda k: f"K{k}")
def test_linear_within_the_bound(ck, pair, m, k):
    """Every scheme, partial blocks and chunks, special activation rows (NaN, Inf, zero,
    subnormal, huge) and weight rows (scales at both ends, E4M3 subnormal scales, NaN and Inf
    blocks), N not a multiple of the row tile, a bias."""
    wf, af = pair
    scheme = _scheme(wf, af)
    wsrc, xs = _data(wf, 45, k, m, seed=m + k)
    q = quantize(wsrc, wf)
    x = xs.to(torch.bfloat16)
    bias = torch.randn(45, generator=torch.Generator().manual_seed(m * 7 + k))
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    for amx in (False, True):
        y = exact_bf16.linear(x, w, bias, torch.float32, amx)
        checked = _check(y, x, q, scheme, bias, w)
        assert checked.float().mean() > 0.3


def test_roundings_per_family(ck):
    """n of the bound: L + n_c + 3 with MBS, K + 1 for E8M0 without MBS and MX+, K + 5 for
    NVFP4 (exact_bf16.py's derivation)."""
    k = 300
    for name, want in (
        ("mxfp4-mbs", 128 + 3 + 3),
        ("mxfp4-16-oas", k + 1),
        ("mxfp4-ocp", k + 1),
        ("mxplus", k + 1),
        ("nvfp4", k + 5),
    ):
        s = get_scheme(name)
        w = exact_bf16.ExactBf16Weight.from_quantized(quantize(torch.randn(4, k), s.weight), s)
        assert w.roundings == want, name


def test_nvfp4_underflowing_global_product(ck):
    """A row whose ga * gw is below fp32's normal range (ga ~ 2^-120, gw ~ 2^-14): the product
    G = fl(ga * gw) is a subnormal, the bound's NVFP4 term holds it; other rows are held to
    the relative bound."""
    scheme = get_scheme("nvfp4")
    g = torch.Generator().manual_seed(3)
    q = quantize(torch.randn(24, 160, generator=g) * 0.01, "nvfp4")
    x = torch.randn(70, 160, generator=g)
    x[5] *= 2.0**-110
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    y = exact_bf16.linear(x, w, None, torch.float32, amx=False)
    _, _, gs = _spec_values(x, q, scheme)
    assert gs is not None and float(gs[0][5] * gs[1][0]) < 2.0**-126
    _check(y, x, q, scheme, None, w)
    assert (y[5] != 0).all()  # a subnormal G still scales the row


@pytest.mark.parametrize("macro", [32, 64, 256])
def test_macro_blocks(ck, macro):
    scheme = get_scheme("mxfp4-mbs", macro)
    q = quantize(torch.randn(24, 600) * 0.05, scheme.weight_format, macro_block=macro)
    x = torch.randn(70, 600)
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    assert w.chunk == macro
    y = exact_bf16.linear(x, w, None, torch.float32)
    _check(y, x, q, scheme, None, w)


def _tile_weight(name: str) -> tuple[Scheme, QuantizedTensor]:
    scheme = get_scheme(name)
    wsrc = torch.randn(40, 700) * 0.05
    if name != "nvfp4":
        return scheme, quantize(wsrc, scheme.weight_format)
    wsrc[17:] *= 30.0  # two logical weights (a fused layer): one global scale per row
    widths = [17, 23]
    amax = torch.stack([logical_amax(wsrc[:17]), logical_amax(wsrc[17:])])
    return scheme, quantize_nvfp4_logical(wsrc, amax, widths)


@pytest.mark.parametrize("name", ["mxfp4-mbs", "nvfp4", "mxplus"])
def test_row_tiles_and_batched_chunk_groups(ck, monkeypatch, name):
    """Many weight-row tiles (and chunk groups of one chunk each) give the same numbers: the
    NVFP4 per-row global scales follow their rows."""
    scheme, q = _tile_weight(name)
    x = torch.randn(66, 700, generator=torch.Generator().manual_seed(7))
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    whole = exact_bf16.linear(x, w, None, torch.float32)
    _check(whole, x, q, scheme, None, w)
    monkeypatch.setattr(exact_bf16, "ROW_TILE", 16)
    monkeypatch.setattr(exact_bf16, "PARTIAL_BYTES", 1)
    tiled = exact_bf16.linear(x, w, None, torch.float32)
    tiled_w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)  # decoded in row tiles
    assert torch.equal(tiled_w.operand, w.operand)
    _check(tiled, x, q, scheme, None, w)
    # both within the bound of the float64 product; against each other only the GEMM's
    # blocking differs (fp32 sums in another order), so an absolute term on the outputs'
    # scale: an output near 0 may differ relatively by more than 1e-5
    assert torch.allclose(tiled, whole, rtol=1e-5, atol=1e-5 * float(whole.abs().max()))


@pytest.mark.parametrize("wrong", ["mbs byte", "scale code", "one code"])
def test_bound_catches_a_wrong_weight(ck, wrong):
    k = 576
    g = torch.Generator().manual_seed(1)
    scheme = get_scheme("mxfp4-mbs")
    q = quantize(torch.randn(24, k, generator=g) * 0.05, "mxfp4-mbs-d")
    x = torch.randn(70, k, generator=g).to(torch.bfloat16)
    bad = corrupted(q, wrong)
    w = exact_bf16.ExactBf16Weight.from_quantized(bad, scheme)
    y = exact_bf16.linear(x, w, None, torch.float32)
    with pytest.raises(AssertionError, match="out of bound"):
        _check(y, x, q, scheme, None, w)


@pytest.mark.parametrize("name", ["mxfp4-16-oas", "nvfp4", "mxplus"])
def test_dtypes_leading_dims_and_empty(ck, name):
    scheme = get_scheme(name)
    q = quantize(torch.randn(24, 320) * 0.1, scheme.weight_format)
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    x = torch.randn(2, 40, 320, dtype=torch.bfloat16)
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        y = exact_bf16.linear(x, w, None, dt)
        assert y.shape == (2, 40, 24) and y.dtype == dt
    y = exact_bf16.linear(x, w, None, torch.float32)
    _check(y.reshape(80, 24), x.reshape(80, 320), q, scheme, None, w)
    assert exact_bf16.linear(torch.empty(0, 320), w, None, torch.bfloat16).shape == (0, 24)
    bias = torch.randn(24)
    assert exact_bf16.linear(torch.empty(3, 0, 320), w, bias, torch.float32).shape == (3, 0, 24)


def test_other_pairs_are_refused(ck):
    for wf, af in (("nvfp4", "mxfp4-16-oas"), ("mxplus", "mxfp4-ocp"), ("mxfp4-16", "nvfp4")):
        q = quantize(torch.randn(8, 64), wf)
        with pytest.raises(ValueError, match="exact-bf16 path takes NVFP4, MX\\+ or an E8M0"):
            exact_bf16.ExactBf16Weight.from_quantized(q, _scheme(wf, af))
    q = quantize(torch.randn(8, 64), "mxfp4-ocp")  # a weight of another format than the scheme's
    with pytest.raises(ValueError, match="not weights mxfp4-ocp x activations nvfp4"):
        exact_bf16.ExactBf16Weight.from_quantized(q, get_scheme("nvfp4"))


def test_the_bf16_math_mode_is_restored():
    mode = torch.backends.mkldnn.matmul
    before = mode.fp32_precision
    with pytest.raises(RuntimeError), exact_bf16.bf16_math():
        assert mode.fp32_precision == "bf16"
        raise RuntimeError("a failing GEMM")
    assert mode.fp32_precision == before


AMX_CPUINFO = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16 amx_int8\n"
AVX2_CPUINFO = "processor\t: 0\nflags\t\t: fpu avx2 fma\n"


def test_host_choice_by_cpu_feature():
    """amx_bf16 in cpuinfo and the tile permission held: the path; otherwise the reason."""
    granted = AmxResult("granted", "XTILEDATA permission granted")
    assert exact_bf16.host_choice(AMX_CPUINFO, granted) == (True, "")
    ok, why = exact_bf16.host_choice(AVX2_CPUINFO, granted)
    assert not ok and "no amx_bf16" in why
    ok, why = exact_bf16.host_choice(AMX_CPUINFO, AmxResult("failed", "EPERM"))
    assert not ok and "no AMX tile permission (failed: EPERM)" in why


def _backend(scheme_name: str, n: int, k: int):
    spec = LinearSpec(get_scheme(scheme_name), n=n, k=k, out_dtype=torch.float32)
    return CpuPackedBackend(spec), torch.nn.Module()


def _count_calls(monkeypatch) -> list:
    calls: list = []
    real = exact_bf16.linear
    monkeypatch.setattr(
        exact_bf16, "linear", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw)
    )
    return calls


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_backend_takes_the_path_for_large_m_on_an_amx_host(ck, monkeypatch, name):
    """With the host taken for an AMX one, cpu-packed runs the exact path from its min_m rows
    (MIN_M; INT8_MIN_M for E8M0 weights on AMX-INT8 tiles) and its integer kernels below, for
    every scheme (its self-test passed first)."""
    monkeypatch.setattr(exact_bf16, "host_choice", lambda: (True, ""))
    monkeypatch.setattr(exact_bf16, "_VERDICT", {})
    calls = _count_calls(monkeypatch)
    scheme = get_scheme(name)
    q = quantize(torch.randn(24, 320) * 0.05, scheme.weight_format)
    backend, layer = _backend(name, 24, 320)
    backend.process_weights_after_loading(layer, q)
    assert backend.exact is not None and backend.branches_on_m  # dispatched inside the op
    assert list(exact_bf16._VERDICT.values()) == [(True, "")]
    lo = backend.exact.min_m
    assert lo == (exact_bf16.INT8_MIN_M if backend.exact.int8 else exact_bf16.MIN_M)
    for m in (1, lo - 1, lo, 200):
        x = torch.randn(m, 320)
        y = backend.apply(layer, x, None)
        _check(y, x, q, scheme, None, backend.exact)
    assert [s[0] for s in calls if s[0] != exact_bf16.MIN_M + 3] == [lo, 200]


def test_nvfp4_given_row_global_scales_keep_the_integer_kernel(ck, monkeypatch):
    """A row-parallel shard passes the whole row's global scales: the integer kernel, which
    quantizes with them, serves the call however many rows it has."""
    monkeypatch.setattr(exact_bf16, "host_choice", lambda: (True, ""))
    calls = _count_calls(monkeypatch)
    backend, layer = _backend("nvfp4", 24, 320)
    backend.process_weights_after_loading(layer, quantize(torch.randn(24, 320), "nvfp4"))
    assert backend.exact is not None
    calls.clear()
    x = torch.randn(200, 320)
    backend.apply(layer, x, None, act_global_scale=torch.full((200, 1), 0.01))
    assert calls == []
    backend.apply(layer, x, None)
    assert len(calls) == 1


@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_backend_keeps_the_integer_kernels_without_the_host(ck, monkeypatch, name):
    """Where host_choice is false (this CPU: no amx_bf16) no scheme gets the path, and no call,
    however large, runs it."""
    monkeypatch.setattr(exact_bf16, "host_choice", lambda: (False, "no amx_bf16 (a test)"))
    calls = _count_calls(monkeypatch)
    scheme = get_scheme(name)
    q = quantize(torch.randn(24, 320) * 0.05, scheme.weight_format)
    backend, layer = _backend(name, 24, 320)
    backend.process_weights_after_loading(layer, q)
    assert backend.exact is None and not backend.branches_on_m
    x = torch.randn(300, 320)
    want = (
        fake_quantize(x, scheme.activation_format, per_row=scheme.activations_per_row).double()
        @ q.dequantize().double().T
    )
    assert torch.allclose(backend.apply(layer, x, None).double(), want, rtol=1e-4, atol=1e-6)
    assert calls == []


@pytest.mark.parametrize("name", ["mxfp4-16-oas", "nvfp4", "mxplus"])
def test_backend_on_this_host_follows_cpuinfo(ck, name):
    ok, _ = exact_bf16.host_choice()
    backend, layer = _backend(name, 24, 320)
    backend.process_weights_after_loading(layer, quantize(torch.randn(24, 320), name))
    assert (backend.exact is not None) == ok


@pytest.mark.parametrize("name", SCHEME_NAMES)
@pytest.mark.parametrize("amx", [False, True])
def test_self_test_passes_for_every_scheme(ck, monkeypatch, name, amx):
    monkeypatch.setattr(exact_bf16, "_VERDICT", {})
    assert exact_bf16.self_test(get_scheme(name), amx) == (True, "")


def _decoded_wrong(wrong: str):
    """A weight decoder (exact_bf16._decode_rows) with one thing wrong in weight row 0."""
    real = exact_bf16._decode_rows

    def decode(q, n0, n1, macro):
        q = dataclasses.replace(q, codes=q.codes.clone(), scales=q.scales.clone())
        if wrong == "e4m3 scale one step":  # NVFP4: an E4M3 block scale byte + 1
            q.scales.view(torch.uint8)[0, 1] += 1
        elif wrong == "scale code":  # E8M0 (MX+): a block scale code + 1
            q.scales[0, 1] += 1
        elif wrong == "block max one step":  # MX+: j of the block max of block 1 + 1
            kk = 32 + int(q.block_max_index[0, 1])
            q.codes[0, kk // 2] ^= 0x01 if kk % 2 == 0 else 0x10
        return real(q, n0, n1, macro)

    return decode


FAULTS = [
    ("nvfp4", "e4m3 scale one step"),
    ("nvfp4", "activation e4m3 scale one step"),
    ("nvfp4", "global product in bf16"),
    ("nvfp4", "weight global scale of another weight"),
    ("mxplus", "block max one step"),
    ("mxplus", "scale code"),
    ("mxplus", "activation block max one step"),
    ("mxfp4-mbs-s", "row scale x2"),
]


def _inject(monkeypatch, wrong: str) -> None:
    if wrong in ("e4m3 scale one step", "scale code", "block max one step"):
        monkeypatch.setattr(exact_bf16, "_decode_rows", _decoded_wrong(wrong))
    elif wrong == "row scale x2":  # every scale of weight row 0 one code up
        real_decode = exact_bf16._decode_rows

        def off_by_one(q, n0, n1, macro):
            rows = real_decode(q, n0, n1, macro)
            if n0 == 0:
                rows[0] *= 2.0
            return rows

        monkeypatch.setattr(exact_bf16, "_decode_rows", off_by_one)
        real_pack = exact_bf16.cpu_kernels.pack_weight

        def packed_off_by_one(codes, scales, mbs, k, fmt, macro):  # AMX tiles of E8M0 weights
            c, sc, m = real_pack(codes, scales, mbs, k, fmt, macro)
            sc[0, ::16] += (sc[0, ::16] < 254).to(torch.uint8)  # tile 0, row 0, every block
            return c, sc, m

        monkeypatch.setattr(exact_bf16.cpu_kernels, "pack_weight", packed_off_by_one)
    elif wrong == "global product in bf16":  # G = fl(ga * gw) rounded once more, to bf16
        # (torch's GEMM path: on AMX tiles the product is formed inside cpu_amx_gemm)
        monkeypatch.setattr(exact_bf16, "amx_tiles", lambda scheme: (False, "a test"))
        real_g = exact_bf16.global_product
        monkeypatch.setattr(
            exact_bf16, "global_product", lambda a, b: real_g(a, b).bfloat16().float()
        )
    elif wrong == "weight global scale of another weight":  # gw * 1.01 (a fused neighbour's)
        real_from = exact_bf16.ExactBf16Weight.from_quantized

        def other_gw(q, scheme, tiles=False, packed=None):
            w = real_from(q, scheme, tiles=tiles, packed=packed)
            w.gw = w.gw * 1.01
            return w

        monkeypatch.setattr(exact_bf16.ExactBf16Weight, "from_quantized", other_gw)
    else:  # the activation quantizer's output altered in row 0
        real_nv, real_act = exact_bf16.cpu_kernels.nvfp4_act_quant, exact_bf16.cpu_kernels.act_quant

        def nv(x):
            codes, sbytes, ga = real_nv(x)
            sbytes[0, 1] += 1
            return codes, sbytes, ga

        def act(x, fmt, macro):
            codes, e, mbs = real_act(x, fmt, macro)
            c = codes[0]  # 2 * value; +-(8 + j) other than 8 and 12 is a block max: j - 1
            bm = (c.abs() > 8) & (c.abs() != 12)
            c[bm] -= c[bm].sign()
            return codes, e, mbs

        monkeypatch.setattr(exact_bf16.cpu_kernels, "nvfp4_act_quant", nv)
        monkeypatch.setattr(exact_bf16.cpu_kernels, "act_quant", act)
        # on AMX tiles the path quantizes in one fused op: rebuilt from the altered codes
        monkeypatch.setattr(exact_bf16.cpu_kernels, "amx_act_quant", act_quant_via_codes)


def act_quant_via_codes(x, fmt, macro, mp, kp, chunks):
    """cpu_amx_act_quant (the tiles' fused quantizer) rebuilt from cpu_act_quant's codes (which
    a fault may have altered) and cpu_amx_act_operand, fl(1/F) from its MBS bytes."""
    codes, e, mbs = exact_bf16.cpu_kernels.act_quant(x, fmt, macro)
    half = exact_bf16._HALF_SCALE[e.long()]
    a = torch.ops.vllm_mxplus.cpu_amx_act_operand(codes, half, fmt.block_size, mp, kp)
    ra = torch.zeros(mp, chunks)
    if chunks:
        f = exact_bf16._mbs_factors(mbs, chunks) if mbs.numel() else torch.ones(len(x), chunks)
        ra[: len(x)] = 1.0 / f
    return a, ra


@pytest.mark.parametrize(("name", "wrong"), FAULTS, ids=lambda v: str(v).replace(" ", "-"))
def test_a_failing_self_test_keeps_the_integer_kernels(ck, monkeypatch, caplog, name, wrong):
    """A path that computes wrong numbers (one operand scale one step off, a block max one
    step off, the global scales rounded to bf16 or 1% off) is rejected at first use
    with an ERROR naming the element, and the integer kernels serve."""
    monkeypatch.setattr(exact_bf16, "host_choice", lambda: (True, ""))
    monkeypatch.setattr(exact_bf16, "_VERDICT", {})
    monkeypatch.setattr(log_once, "_SEEN", set())  # each fault logs its own ERROR
    _inject(monkeypatch, wrong)
    backend, layer = _backend(name, 24, 320)
    with caplog.at_level(logging.ERROR, logger=exact_bf16.__name__):
        backend.process_weights_after_loading(layer, quantize(torch.randn(24, 320), name))
    assert backend.exact is None
    assert "exact-bf16 CPU path is REJECTED" in caplog.text and "outside the bound" in caplog.text


def test_the_setting_turns_the_path_off(monkeypatch):
    """VLLM_MXPLUS_CPU_EXACT_BF16=0: no host takes the path (no bf16 copy of the weights),
    whatever its CPU; a value other than `auto` / `0` is an error naming the variable."""
    monkeypatch.setenv("VLLM_MXPLUS_CPU_EXACT_BF16", "0")
    ok, why = exact_bf16.host_choice(AMX_CPUINFO, AmxResult("granted", ""))
    assert not ok and "VLLM_MXPLUS_CPU_EXACT_BF16=0" in why
    monkeypatch.setenv("VLLM_MXPLUS_CPU_EXACT_BF16", "yes")
    with pytest.raises(ValueError, match="VLLM_MXPLUS_CPU_EXACT_BF16='yes'"):
        exact_bf16.host_choice(AMX_CPUINFO, AmxResult("granted", ""))
    monkeypatch.setenv("VLLM_MXPLUS_CPU_EXACT_BF16", "auto")
    assert exact_bf16.host_choice(AMX_CPUINFO, AmxResult("granted", "")) == (True, "")
