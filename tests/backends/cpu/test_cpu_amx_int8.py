"""The E8M0 linear on AMX-INT8 tiles (csrc/mx_amx_int8_cpu.cpp, `cpu_amx_int8_linear`;
docs/cpu_kernels.md, "E8M0 on AMX-INT8 tiles") against `vllm_mxplus.formats` within the
exact-bf16 path's bound on tiles

    |y - y64| <= gamma_n S + 2^-124 (|x_hat|_1 + |w_hat|_1 + K),   n = ExactBf16Weight.roundings

for every E8M0 pair, M across the 16-row tiles, K with partial blocks, steps and chunks, and
activation / weight data planted so that each of the kernel's ways runs: one fold per unit of
two steps, one per step, two folds (scales 4-7 apart), one product per block (further apart,
rows or columns), all-zero blocks. What the fold cannot take exactly (NaN, Inf, values below
2^-125, exponents outside its window) must equal the integer kernels bit for bit (the op runs
them). The kernel tests skip off AMX-INT8 hosts with the reason; the selection rules run
everywhere."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_cpu_exact_bf16 import _backend, _check, _scheme  # tests/backends/cpu, on sys.path
from test_cpu_kernels import PAIRS  # every E8M0 pair the CPU kernels serve

from vllm_mxplus.backends.cpu import exact_bf16
from vllm_mxplus.backends.cpu import kernels as cpu_kernels
from vllm_mxplus.formats import get_scheme, quantize

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")

MAX_SPREAD = 3  # E8M0 codes one fold takes (12 * 2^3 = 96 <= 127)


def _int8() -> tuple[bool, str]:
    ok, why = cpu_kernels.load()
    if not ok:
        return False, why
    return exact_bf16.int8_tiles(get_scheme("mxfp4-mbs"))


int8 = pytest.mark.skipif(
    not _int8()[0],
    reason="needs a CPU with AMX-INT8 tiles (amx_tile, amx_int8; amx_bf16 for the path) and "
    f"the tile permission: {_int8()[1]}",
)

PLANTS = [
    "plain",
    "two folds",
    "two folds across a unit",
    "two folds in a lone step",
    "rows per block",
    "columns per block",
    "zero blocks",
]


def _lone_step(k: int, block: int) -> int | None:
    """The first column of the step that ends K alone (an odd step count: it runs by itself,
    not in a unit of two), or None."""
    steps = -(-(-(-k // block) * block) // 64)
    return (steps - 1) * 64 if steps % 2 else None


def _planted(plant: str, n: int, k: int, m: int, seed: int):
    """(weight [n, k], rows [m, k]) of random data with the plant's blocks."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(m, k, generator=g)
    if plant == "two folds":  # scales 5 apart inside a step, in every third row
        x[::3, 16:32] *= 2.0**5
        x[1::5, 100 % k : 100 % k + 16] *= 2.0**-5
    elif plant == "two folds across a unit":  # a step 5 above the other step of its unit
        x[::3, 128 : 128 + 64] *= 2.0**5
    elif plant == "two folds in a lone step":  # 5 apart inside the last step, where it is alone
        last = _lone_step(k, 16)
        if last is not None:
            x[::3, last : last + 16] *= 2.0**5
    elif plant == "rows per block":  # 9 apart: one product per block for those row tiles
        x[::17, 16:32] *= 2.0**9
    elif plant == "columns per block":  # 6 apart in one column of the first tile
        w[2, 16:32] *= 2.0**6
    elif plant == "zero blocks":
        w[:, :16] = 0
        x[:, 32:64] = 0
        x[min(2, m - 1)] = 0
    return w, x


def _spreads(scales: torch.Tensor, span: int, block: int) -> torch.Tensor:
    """The largest spread of nonzero E8M0 codes [R, nb] within each 16-row (or column) tile
    and span of K (64: one step), as the kernel decides its way (activations: <= 3 one fold,
    <= 7 two, more one product per block; weight columns: <= 3 one fold, else per block)."""
    r, nb = scales.shape
    per = span // block
    c = torch.nn.functional.pad(scales.int(), (0, -nb % per)).view(r, -1, per)
    live = c != 0
    lo = torch.where(live, c, 999).amin(-1)
    hi = torch.where(live, c, -1).amax(-1)
    spread = torch.where(hi >= 0, hi - lo, 0)
    return (
        torch.nn.functional.pad(spread, (0, 0, 0, -r % 16)).view(-1, 16, spread.shape[-1]).amax(1)
    )


def _weight(wf: str, scheme, w: torch.Tensor, int8: bool = True, held: bool = False):
    """q and its weight on the tiles: the int8 tiles decoded per call, or held from load."""
    q = quantize(w, wf, macro_block=scheme.macro_block)
    out = exact_bf16.ExactBf16Weight.from_quantized(q, scheme, tiles=True, int8=int8, held=held)
    assert (out.held is not None) == (int8 and held)
    return q, out


@int8
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("plant", PLANTS)
@pytest.mark.parametrize(("m", "k"), [(1, 296), (16, 576), (19, 1100), (40, 1536), (300, 576)])
@pytest.mark.parametrize("held", [False, True], ids=["decoded", "held"])
def test_int8_linear_within_the_bound(ck, pair, plant, m, k, held):
    wf, af = pair
    scheme = _scheme(wf, af)
    wsrc, x = _planted(plant, 70, k, m, seed=m + k)
    q, w = _weight(wf, scheme, wsrc, held=held)
    assert w.int8 is not None and w.min_m == exact_bf16.INT8_MIN_M
    bias = torch.randn(70, generator=torch.Generator().manual_seed(k))
    y = exact_bf16.linear(x, w, bias, torch.float32)
    checked = _check(y, x, q, scheme, bias, w)
    assert checked.float().mean() > 0.9
    xq = quantize(x, scheme.activation_format, macro_block=scheme.macro_block)
    rows = _spreads(xq.scales, 64, xq.spec.block_size)  # the data reach the way tested
    two = (rows > MAX_SPREAD) & (rows <= 2 * MAX_SPREAD + 1)
    if plant == "two folds":
        assert two.any()
    if plant == "two folds across a unit":  # steps of one fold, a unit of two
        units = _spreads(xq.scales, 128, xq.spec.block_size)
        assert ((units > MAX_SPREAD) & (units <= 2 * MAX_SPREAD + 1)).any()
        assert not two.any()
    if plant == "two folds in a lone step" and _lone_step(k, xq.spec.block_size) is not None:
        assert two[:, -1].any()
    if plant == "rows per block":
        assert (rows > 2 * MAX_SPREAD + 1).any()
    if plant == "columns per block":
        assert (_spreads(q.scales, 64, q.spec.block_size) > MAX_SPREAD).any()


@int8
@pytest.mark.parametrize("name", ["mxfp4-ocp", "mxfp4-16-oas"])
def test_int8_linear_is_exact_where_fp32_is(ck, name):
    """Small-integer data whose every partial sum is an fp32 integer (no MBS: its factors are
    not integers): the output is the float64 product exactly, no rounding to hide behind."""
    scheme = get_scheme(name)
    g = torch.Generator().manual_seed(7)
    wsrc = torch.randint(-6, 7, (48, 320), generator=g).float()
    x = torch.randint(-6, 7, (20, 320), generator=g).float()
    q, w = _weight(scheme.weight_format, scheme, wsrc)
    assert not w.chunked
    y = exact_bf16.linear(x, w, None, torch.float32)
    xq = quantize(x, scheme.activation_format)
    want = xq.dequantize().double() @ q.dequantize().double().T
    assert torch.equal(y.double(), want)


@int8
@pytest.mark.parametrize(
    "case",
    [
        "nan row",
        "inf element",
        "tiny activation block",
        "tiny weight block",
        "huge products",
        "tiny products",
    ],
)
@pytest.mark.parametrize("held", [False, True], ids=["decoded", "held"])
def test_what_the_fold_cannot_take_runs_the_integer_kernels(ck, case, held):
    """The op's way out: the integer kernels' result, bit for bit (NaN where NaN); with held
    tiles the weight side's check is the one made at load."""
    scheme = get_scheme("mxfp4-mbs-s")
    wsrc, x = _planted("plain", 40, 320, 18, seed=3)
    if case == "nan row":
        x[5, 7] = float("nan")
    elif case == "inf element":
        x[2, 100] = float("inf")
    elif case == "tiny activation block":  # a nonzero block below 2^-125: E8M0 code 0
        x[3, 64:80] = 1e-38
    elif case == "tiny weight block":
        wsrc[4, 32:48] = 1e-38
    elif case == "huge products":  # 2^(EA + EW - 256) past 2^107
        x *= 2.0**100
        wsrc *= 2.0**20
    else:  # below the normal range
        x *= 2.0**-80
        wsrc *= 2.0**-60
    q, w = _weight(scheme.weight_format, scheme, wsrc, held=held)
    y = exact_bf16.linear(x, w, None, torch.float32)
    codes, scales, mbs = w.packed
    want = torch.ops.vllm_mxplus.cpu_mx_linear(
        x, *w.int8[:4], codes, scales, mbs, *w.int8[4:], None, torch.float32
    )
    torch.testing.assert_close(y, want, rtol=0, atol=0, equal_nan=True)


@int8
@pytest.mark.parametrize("side", ["activation", "weight"])
def test_small_unit_bases_run_step_by_step(ck, side):
    """A unit's scale is fl(A * W) with A = fl(1/Fa) 2^(EA - 127), W = fl(1/Fw) 2^(EW - 129),
    both normal only from EA >= 2 and EW >= 4: blocks of E8M0 codes 1-2 (their products
    inside the window through a larger partner) run step by step, within the bound. The
    bound's absolute term (2^-124 times the partner's sum) would hide these rows, so they are
    also held to the integer kernels' result: bit for bit (the chunks' sums here are exact
    on either way, and both scale them alike), which a unit folded on a subnormal A or W
    would miss by far."""
    scheme = get_scheme("mxfp4-mbs-s")
    g = torch.Generator().manual_seed(11)
    wsrc, x = _planted("plain", 48, 576, 32, seed=11)

    def small(shape: tuple[int, int]) -> torch.Tensor:  # |v| in [1, 6) times 2^-126: codes 1-2
        v = 1.0 + 5.0 * torch.rand(shape, generator=g)  # off the FP4 grid: MBS factors above 1
        return torch.where(torch.rand(shape, generator=g) < 0.5, -v, v) * 2.0**-126

    if side == "activation":
        x[::3] = small(x[::3].shape)
        wsrc *= 2.0**12
    else:
        wsrc[::2] = small(wsrc[::2].shape)
        x *= 2.0**12
    q, w = _weight(scheme.weight_format, scheme, wsrc)
    xq = quantize(x, scheme.activation_format, macro_block=scheme.macro_block)
    low = xq.scales if side == "activation" else q.scales
    assert ((low >= 1) & (low <= 2)).any() and not (low == 0).any()
    y = exact_bf16.linear(x, w, None, torch.float32)
    assert _check(y, x, q, scheme, None, w).all()
    codes, scales, mbs = w.packed
    exact = torch.ops.vllm_mxplus.cpu_mx_linear(
        x, *w.int8[:4], codes, scales, mbs, *w.int8[4:], None, torch.float32
    )
    assert torch.equal(y.view(torch.int32), exact.view(torch.int32))


@int8
@pytest.mark.parametrize("name", ["mxfp4-mbs-s", "mxfp4-mbs", "mxfp4-ocp", "mxfp4-16-oas"])
@pytest.mark.parametrize("plant", PLANTS)
def test_held_tiles_give_the_decoded_calls_bits(ck, name, plant):
    """Tiles decoded at load (`amx_int8_hold`) are the per-call decode's bytes: the same
    output bit for bit, N not a multiple of 64 (a padded column block), two spans of steps."""
    scheme = get_scheme(name)
    wsrc, x = _planted(plant, 70, 1100, 40, seed=5)
    _, per_call = _weight(scheme.weight_format, scheme, wsrc)
    _, held = _weight(scheme.weight_format, scheme, wsrc, held=True)
    tiles, meta = held.held
    assert tiles.dtype == torch.int8 and tiles.numel() == 8 * 18 * 1024  # 8 column tiles, 18 steps
    a = exact_bf16.linear(x, per_call, None, torch.float32)
    b = exact_bf16.linear(x, held, None, torch.float32)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@int8
def test_held_tiles_follow_the_setting(ck, monkeypatch):
    scheme = get_scheme("mxfp4-mbs-s")
    q = quantize(torch.randn(24, 320) * 0.05, scheme.weight_format)
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme, tiles=True, int8=True)
    assert w.held is not None  # the default
    monkeypatch.setenv("VLLM_MXPLUS_CPU_INT8_HELD", "0")
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme, tiles=True, int8=True)
    assert w.held is None


@int8
@pytest.mark.parametrize("plant", ["two folds", "rows per block"])
def test_threads_do_not_change_a_bit(ck, plant):
    """Two threads give one thread's output bit for bit, with rows that need two folds or a
    product per block in row tiles that an even split of 26 or 300 rows would cut in two (a
    tile's way is its rows' maximum, written by the one thread that quantizes the tile)."""
    scheme = get_scheme("mxfp4-mbs-s")
    threads = torch.get_num_threads()
    for m in (26, 300):
        wsrc, x = _planted(plant, 70, 576, m, seed=m)
        x[m // 2] *= 2.0**4  # a row past one fold in the middle tile, every step
        x[m // 2, ::64] *= 2.0**5
        _, w = _weight(scheme.weight_format, scheme, wsrc)
        try:
            torch.set_num_threads(1)
            one = exact_bf16.linear(x, w, None, torch.float32)
            torch.set_num_threads(2)
            two = exact_bf16.linear(x, w, None, torch.float32)
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(one.view(torch.int32), two.view(torch.int32))


@int8
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("odt", [torch.bfloat16, torch.float16])
def test_int8_dtypes(ck, xdt, odt):
    """Rows of any float dtype (read as they are) and the output's dtype: the fp32 output of
    the same rows rounded once (round to nearest even), bit for bit; the leading shape kept."""
    scheme = get_scheme("mxfp4-mbs")
    wsrc, x = _planted("two folds", 50, 300, 26, seed=11)
    _, w = _weight(scheme.weight_format, scheme, wsrc)
    x = x.to(xdt).view(2, 13, 300)
    bias = torch.randn(50)
    y = exact_bf16.linear(x, w, bias, odt)
    want = exact_bf16.linear(x.float(), w, bias, torch.float32).to(odt)
    assert y.shape == (2, 13, 50) and y.dtype == odt
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


@int8
def test_int8_refuses_bad_arguments(ck):
    ops = torch.ops.vllm_mxplus
    scheme = get_scheme("mxfp4-mbs")
    _, w = _weight(scheme.weight_format, scheme, torch.randn(40, 256))
    codes, scales, mbs = w.packed
    a_block, a_rule, a_mbs, macro, n, k, _ = w.int8
    x = torch.randn(3, 256)

    def call(x=x, rule=a_rule, macro=macro, rw=w.rw, k=k, out=torch.float32, mbs=mbs, held=()):
        return ops.cpu_amx_int8_linear(
            x, a_block, rule, a_mbs, macro, codes, scales, mbs, rw, n, k, None, out, *held
        )

    assert call().shape == (3, 40)
    tiles, meta = ops.cpu_amx_int8_hold(codes, scales, mbs, n, k, a_block, macro, a_mbs)
    assert call(held=(tiles, meta)).shape == (3, 40)
    with pytest.raises(RuntimeError, match="packed weight codes"):
        ops.cpu_amx_int8_hold(codes, scales, mbs, n, 512, a_block, macro, a_mbs)
    with pytest.raises(RuntimeError, match="come together"):
        call(held=(tiles, None))
    with pytest.raises(RuntimeError, match="held_tiles must be"):
        call(held=(tiles[:-1], meta))
    with pytest.raises(RuntimeError, match="rw must be contiguous fp32"):
        call(rw=w.rw[:, :16])
    with pytest.raises(RuntimeError, match="multiple of 64"):
        call(macro=32, mbs=torch.empty(0, 0, dtype=torch.uint8), rw=torch.ones(8, 48))
    with pytest.raises(RuntimeError, match="last dim K=256"):
        call(x=torch.randn(3, 255))
    with pytest.raises(RuntimeError, match="out_dtype"):
        call(out=torch.int32)
    with pytest.raises(RuntimeError, match="packed weight codes"):
        call(k=512)
    with pytest.raises(RuntimeError, match="MX\\+"):
        call(rule=cpu_kernels.MXPLUS_RULE)
    assert call(x=torch.randn(0, 256)).shape == (0, 40)


@int8
@pytest.mark.parametrize("name", ["mxfp4-mbs", "mxfp4-mbs-s", "mxfp4-ocp"])
def test_backend_serves_e8m0_on_int8_tiles(ck, monkeypatch, name):
    """On this host cpu-packed runs E8M0 calls of at least INT8_MIN_M rows on the int8 tiles,
    from the layer's own packed tensors, fewer on the integer kernels; within the bound."""
    scheme = get_scheme(name)
    q = quantize(torch.randn(24, 320) * 0.05, scheme.weight_format)
    backend, layer = _backend(name, 24, 320)
    backend.process_weights_after_loading(layer, q)
    w = backend.exact
    assert w is not None and w.int8 is not None and w.min_m == exact_bf16.INT8_MIN_M
    assert w.packed[0] is layer.mxplus_cpu_codes and w.packed[2] is layer.mxplus_cpu_mbs
    calls: list = []
    real = cpu_kernels.amx_int8_linear
    monkeypatch.setattr(
        cpu_kernels, "amx_int8_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a)
    )
    for m in (exact_bf16.INT8_MIN_M - 1, exact_bf16.INT8_MIN_M, 100):
        x = torch.randn(m, 320)
        _check(backend.apply(layer, x, None), x, q, scheme, None, w)
    assert calls == [exact_bf16.INT8_MIN_M, 100]


@int8
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"{p[0]}x{p[1]}")
@pytest.mark.parametrize("plant", PLANTS)
def test_int8_rows_have_the_integer_kernels_bits(ck, pair, plant):
    """Batch invariance: the int8 linear gives every output the bits of `cpu_mx_linear` (the
    integer kernels, which serve the calls below INT8_MIN_M rows), for every plant and so
    every way a tile runs (one fold, two, per block; rows and columns): both scale a chunk by
    y = fma(S, fl(fl(1/Fa) fl(1/Fw)), y), and each way's chunk sum S of these data is exact,
    as the integer kernels' K-order sum is. With the integer kernels dividing by Fa * Fw
    instead, about half of the outputs differed in their last bits."""
    wf, af = pair
    scheme = _scheme(wf, af)
    for m, k in [(16, 576), (40, 1536), (300, 576)]:
        wsrc, x = _planted(plant, 70, k, m, seed=m + k)
        q, w = _weight(wf, scheme, wsrc)
        bias = torch.randn(70, generator=torch.Generator().manual_seed(k))
        y = exact_bf16.linear(x, w, bias, torch.float32)
        want = cpu_kernels.mx_linear(
            x, wf, af, q.codes, q.scales, q.mbs, k, bias, torch.float32, scheme.macro_block
        )
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(y), nan), (m, k)
        same = y.masked_fill(nan, 0).view(torch.int32) == want.masked_fill(nan, 0).view(torch.int32)
        assert same.all(), (m, k, int((~same).sum()))


@int8
@pytest.mark.parametrize("name", ["mxfp4-mbs", "mxfp4-mbs-s", "mxfp4-ocp"])
def test_a_rows_bits_do_not_depend_on_its_batch(ck, name):
    """Through the backend, as vLLM calls it: each row of a batch served on the int8 tiles
    (16 and 40 rows, and the same rows regrouped 8 later, so other rows share its tiles) has
    the bits it has when served alone, on the integer kernels."""
    scheme = get_scheme(name)
    g = torch.Generator().manual_seed(3)
    q = quantize(torch.randn(48, 576, generator=g) * 0.05, scheme.weight_format)
    backend, layer = _backend(name, 48, 576)
    backend.process_weights_after_loading(layer, q)
    x = torch.randn(88, 576, generator=g)
    x[::5, 64:80] *= 2.0**5  # rows of two folds among them
    alone = torch.cat([backend.apply(layer, x[i : i + 1], None) for i in range(88)])
    for m in (16, 40):
        for start in (0, 8):
            cuts = [0, start, *range(start + m, 88, m), 88] if start else [0, *range(m, 88, m), 88]
            y = torch.cat([backend.apply(layer, x[a:b], None) for a, b in zip(cuts, cuts[1:])])
            assert torch.equal(y.view(torch.int32), alone.view(torch.int32)), (m, start)


def test_int8_tiles_says_why_not(ck, monkeypatch):
    """Where int8 tiles do not serve, `int8_tiles` says why (and the bf16 tiles keep E8M0)."""
    monkeypatch.setattr(exact_bf16, "amx_tiles", lambda scheme: (True, ""))
    monkeypatch.setattr(torch.ops.vllm_mxplus, "cpu_amx_int8_available", lambda: 0, raising=False)
    ok, why = exact_bf16.int8_tiles(get_scheme("mxfp4-mbs"))
    assert not ok and "no AMX-INT8" in why
    monkeypatch.setattr(torch.ops.vllm_mxplus, "cpu_amx_int8_available", lambda: 1, raising=False)
    ok, why = exact_bf16.int8_tiles(get_scheme("nvfp4"))
    assert not ok and "E8M0 only" in why
    ok, why = exact_bf16.int8_tiles(get_scheme("mxfp4-mbs").with_macro_block(32))
    assert not ok and "multiple of 64" in why
    assert exact_bf16.int8_tiles(get_scheme("mxfp4-mbs")) == (True, "")
