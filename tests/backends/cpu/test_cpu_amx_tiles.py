"""The exact-bf16 path's GEMM on AMX-BF16 tiles (csrc/mx_amx_cpu.cpp; docs/cpu_kernels.md,
"Large M on AMX hosts"): the tile layout (runs everywhere), and on a CPU with AMX-BF16 the
kernel against float64 and the path against `vllm_mxplus.formats` within the derived bound

    |y - y64| <= gamma_n S + 2^-124 (|x_hat|_1 + |w_hat|_1 + K)

with n = `ExactBf16Weight.roundings` (with MBS three more than torch's GEMM: fl(1/Fa),
fl(1/Fw) and their product replace the one division), for every scheme, M across the tile
padding, K with partial blocks and chunks, special rows, a bias; the first-use self-test on
tiles passes every scheme and rejects a wrong operand. The AMX tests skip elsewhere with the
reason (they need amx_tile, amx_bf16 and Linux's tile permission)."""

from __future__ import annotations

import shutil

import pytest
import torch
from test_cpu_exact_bf16 import (  # tests/backends/cpu, on sys.path
    ALL_PAIRS,
    FAULTS,
    SCHEME_NAMES,
    _backend,
    _check,
    _data,
    _inject,
    _scheme,
    act_quant_via_codes,
)

from vllm_mxplus import log_once
from vllm_mxplus.backends.cpu import exact_bf16
from vllm_mxplus.formats import get_scheme, quantize

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")

U = 2.0**-24


def _on_tiles() -> tuple[bool, str]:
    from vllm_mxplus.backends.cpu import kernels as cpu_kernels

    ok, why = cpu_kernels.load()
    if not ok:
        return False, why
    return exact_bf16.amx_tiles(get_scheme("mxfp4-mbs"))


amx = pytest.mark.skipif(
    not _on_tiles()[0],
    reason=f"needs a CPU with AMX-BF16 tiles (amx_tile, amx_bf16) and the tile permission: "
    f"{_on_tiles()[1]}",
)


def test_tile_layout_is_the_b_operand_of_tdpbf16ps():
    """amx_pack: tiles[j, s, r, 2c + p] = W[16 j + c, 32 s + 2 r + p] (the pairs of row r of
    the B tile), and the path's row view of a tiled weight is W again."""
    w = torch.arange(64 * 96, dtype=torch.float32).view(64, 96).to(torch.bfloat16)
    t = exact_bf16.amx_pack(w)
    assert t.shape == (4, 3, 16, 32)
    for j, s, r, c, p in ((0, 0, 0, 0, 0), (1, 2, 5, 7, 1), (3, 1, 15, 15, 1), (2, 0, 3, 9, 0)):
        assert t[j, s, r, 2 * c + p] == w[16 * j + c, 32 * s + 2 * r + p]


def test_pad_to():
    t = torch.ones(3, 5)
    p = exact_bf16._pad_to(t, 32, 7, value=2.0)
    assert (
        p.shape == (32, 7) and p[:3, :5].eq(1).all() and p[3:].eq(2).all() and p[:, 5:].eq(2).all()
    )


def _exact_operand(g, rows, k):
    """bf16 values with 2-4 significant bits over a few binades (exact products)."""
    v = torch.randint(-12, 13, (rows, k), generator=g).float()
    return (v * 2.0 ** torch.randint(-4, 4, (rows, k), generator=g).float()).to(torch.bfloat16)


@amx
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("shape", [(64, 96, 256), (320, 224, 1152)], ids=["one-task", "tasks"])
def test_gemm_against_float64(ck, scaled, shape):
    """cpu_amx_gemm on exact operands: sum over chunks of fl(P_c * fl(ra * rw)) within
    gamma_n of sum |a| |w| / (Fa Fw), n = (chunk - 1) + 3 + chunks + 1; with no factors the
    sum within gamma_K (spans of 512 added in fp32), exact at K = 256 (small sums).
    The larger shape spans two row panels of tasks (256 rows), two column panels (128) and
    three K spans."""
    g = torch.Generator().manual_seed(3)
    m, n, k = shape
    chunk = 128 if scaled else k
    a, w = _exact_operand(g, m, k), _exact_operand(g, n, k)
    chunks = k // chunk
    fa = 1 + torch.randint(0, 256, (m, chunks), generator=g).float() / 256
    fw = 1 + torch.randint(0, 256, (n, chunks), generator=g).float() / 256
    ops = torch.ops.vllm_mxplus
    if scaled:
        ra, rw = 1 / fa, (1 / fw).t().contiguous()
    else:
        ra, rw = torch.empty(0), torch.empty(0)
    wt = exact_bf16.amx_pack(w)
    out = ops.cpu_amx_gemm(a, wt, ra, rw, chunk, m, n, None, None, None, torch.float32)
    if not scaled:
        fa, fw = torch.ones(m, 1), torch.ones(n, 1)
    ad, wd = a.double(), w.double()
    want = torch.zeros(m, n, dtype=torch.float64)
    scale = torch.zeros(m, n, dtype=torch.float64)
    for c in range(chunks):
        sl = slice(c * chunk, (c + 1) * chunk)
        f = fa.double()[:, c : c + 1] * fw.double()[:, c][None]
        want += ad[:, sl] @ wd[:, sl].T / f
        scale += ad[:, sl].abs() @ wd[:, sl].abs().T / f
    err = (out.double() - want).abs()
    if not scaled:  # K - 1 additions in any order (+1 for float64)
        if k <= 256:  # small exact sums: no rounding at all
            assert torch.equal(out.double(), want)
        assert (err <= k * U / (1 - k * U) * scale).all()
        return
    nr = chunk - 1 + 3 + chunks + 1
    assert (err <= nr * U / (1 - nr * U) * scale).all()
    assert err.max() > 0  # the factors are not exact: a real rounding, inside the bound


@amx
def test_gemm_refuses_bad_layouts(ck):
    ops = torch.ops.vllm_mxplus
    a = torch.zeros(32, 64, dtype=torch.bfloat16)
    w = exact_bf16.amx_pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    e = torch.empty(0)

    def gemm(a, w, ra, rw, chunk, m=32, bias=None, dtype=torch.float32):
        return ops.cpu_amx_gemm(a, w, ra, rw, chunk, m, 32, None, None, bias, dtype)

    with pytest.raises(RuntimeError, match="Mp must be a multiple of 32"):
        gemm(torch.zeros(31, 64, dtype=torch.bfloat16), w, e, e, 64)
    with pytest.raises(RuntimeError, match="ra must be contiguous fp32"):
        gemm(a, w, torch.ones(32, 3), torch.ones(1, 32), 64)
    with pytest.raises(RuntimeError, match="amx_pack"):
        gemm(a, w[:, :1].contiguous(), e, e, 64)
    with pytest.raises(RuntimeError, match="must fit the padded"):
        gemm(a, w, e, e, 64, m=33)
    with pytest.raises(RuntimeError, match="bias must be contiguous fp32 with 32"):
        gemm(a, w, e, e, 64, bias=torch.ones(31))
    with pytest.raises(RuntimeError, match="out_dtype must be"):
        gemm(a, w, e, e, 64, dtype=torch.float64)


def _nan_overflowing_blocks(rows: torch.Tensor, block: int) -> torch.Tensor:
    """rows [N, K] with every block that holds a non-finite value all NaN, its zero padding
    past K included (cpu_pack_weight marks a NaN scale or an overflowing value with scale 255:
    every product with it is NaN either way)."""
    n, k = rows.shape
    v = torch.nn.functional.pad(rows, (0, -k % block)).view(n, -1, block)
    bad = ~torch.isfinite(v).all(-1, keepdim=True)
    return torch.where(bad, torch.full_like(v, float("nan")), v).view(n, -1)[:, :k]


@amx
@pytest.mark.parametrize("pair", ALL_PAIRS, ids=lambda p: p[0])
@pytest.mark.parametrize("m", [1, 33, 130], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("k", [33, 577, 1536], ids=lambda k: f"K{k}")
def test_linear_on_tiles_within_the_bound(ck, pair, m, k):
    """Every scheme on tiles: special activation and weight rows (_data), N = 45 (padded to
    64), M across the 32-row padding, a bias; the row view of the tiled weight is the torch
    path's operand (E8M0: decoded from the packed codes, a block with an overflowing value NaN
    as in the integer kernels)."""
    wf, af = pair
    scheme = _scheme(wf, af)
    wsrc, xs = _data(wf, 45, k, m, seed=m + k)
    q = quantize(wsrc, wf)
    x = xs.to(torch.bfloat16)
    bias = torch.randn(45, generator=torch.Generator().manual_seed(m * 7 + k))
    w = exact_bf16.ExactBf16Weight.from_quantized(q, scheme, tiles=True, int8=False)
    plain = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    assert w.operand is None and (w.packed is not None) == w.e8m0
    want = plain.weight_rows(0, 45)[0]
    if w.e8m0:
        want = _nan_overflowing_blocks(want, q.spec.block_size)
    torch.testing.assert_close(w.weight_rows(0, 45)[0], want, rtol=0, atol=0, equal_nan=True)
    assert w.roundings == plain.roundings + (3 if w.chunked else 0)
    y = exact_bf16.linear(x, w, bias, torch.float32)
    checked = _check(y, x, q, scheme, bias, w)
    assert checked.float().mean() > 0.3
    for dt in (torch.bfloat16, torch.float16):  # the kernel's cast is torch's, bit for bit
        torch.testing.assert_close(
            exact_bf16.linear(x, w, bias, dt), y.to(dt), rtol=0, atol=0, equal_nan=True
        )


@amx
@pytest.mark.parametrize("name", SCHEME_NAMES)
def test_self_test_on_tiles_passes_for_every_scheme(ck, monkeypatch, name):
    monkeypatch.setattr(exact_bf16, "_VERDICT", {})
    assert exact_bf16.self_test(get_scheme(name), tiles=True) == (True, "")


@amx
@pytest.mark.parametrize("name", ["mxfp4-mbs", "mxfp4-16-oas", "mxplus", "mxfp4-mbs-s"])
def test_fused_act_quant_is_the_quantizer_expanded(ck, name):
    """cpu_amx_act_quant = cpu_act_quant's codes times half their block scale (bit for bit,
    NaN where the block is NaN), fl(1/F) of its MBS bytes, zero padding."""
    scheme = get_scheme(name)
    act = scheme.activation
    k, m = 300, 37
    x = _data(scheme.weight_format, 8, k, m, seed=5)[1].to(torch.bfloat16)
    chunked = bool(scheme.weight.mbs or act.mbs)
    chunks = -(-k // scheme.macro_block) if chunked else 0
    kp = (chunks * scheme.macro_block) if chunked else 320
    a, ra = exact_bf16.cpu_kernels.amx_act_quant(x, act, scheme.macro_block, 64, kp, chunks)
    want_a, want_ra = act_quant_via_codes(x, act, scheme.macro_block, 64, kp, chunks)
    torch.testing.assert_close(a, want_a, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(ra, want_ra, rtol=0, atol=0)
    assert a[m:].eq(0).all() and a[:, k:].eq(0).all() and a.isnan().any() == x.isnan().any()


# the faults injected in Python that reach the tiles path (the global product is formed
# inside cpu_amx_gemm there, so "global product in bf16" has nothing to patch)
TILE_FAULTS = [f for f in FAULTS if f[1] != "global product in bf16"]


@amx
@pytest.mark.parametrize(("name", "wrong"), TILE_FAULTS, ids=lambda v: str(v).replace(" ", "-"))
def test_self_test_on_tiles_rejects_a_wrong_path(ck, monkeypatch, name, wrong):
    monkeypatch.setattr(exact_bf16, "_VERDICT", {})
    monkeypatch.setattr(log_once, "_SEEN", set())
    _inject(monkeypatch, wrong)
    ok, why = exact_bf16.self_test(get_scheme(name), tiles=True)
    assert not ok and "outside the bound" in why


@amx
@pytest.mark.parametrize("name", ["mxfp4-mbs", "nvfp4", "mxplus"])
def test_backend_serves_large_m_on_tiles(ck, name):
    """On this AMX host cpu-packed lays the exact-bf16 weight out in tiles and serves M >= MIN_M
    from them, within the bound: an E8M0 weight from the layer's own packed codes and scales
    (no bf16 copy: the very tensors of the integer kernels), NVFP4 and MX+ from bf16 tiles."""
    scheme = get_scheme(name)
    q = quantize(torch.randn(24, 320) * 0.05, scheme.weight_format)
    backend, layer = _backend(name, 24, 320)
    backend.process_weights_after_loading(layer, q)
    w = backend.exact
    assert w is not None and w.on_tiles
    if w.e8m0:
        assert w.tiles is None and w.packed is not None
        assert w.packed[0] is layer.mxplus_cpu_codes and w.packed[1] is layer.mxplus_cpu_scales
        assert w.packed[2] is layer.mxplus_cpu_mbs
    else:
        assert w.tiles is not None and w.packed is None
    x = torch.randn(exact_bf16.MIN_M, 320)
    _check(backend.apply(layer, x, None), x, q, scheme, None, backend.exact)


def test_no_tiles_without_amx(ck, monkeypatch):
    """Where the C++ side finds no AMX (another CPU, no permission, an old compiler) the path
    keeps torch's GEMM, whatever host_choice says."""
    monkeypatch.setattr(exact_bf16, "host_choice", lambda: (True, ""))
    monkeypatch.setattr(torch.ops.vllm_mxplus, "cpu_amx_available", lambda: 0, raising=False)
    ok, why = exact_bf16.amx_tiles(get_scheme("mxfp4-mbs"))
    assert not ok and "no AMX-BF16 tiles" in why


def _packed_weight(wf: str, n: int, k: int, seed: int):
    """(q, codes, scales, MBS bytes, the torch path's operand) of an E8M0 weight with special rows, and
    block scales at every edge of the vector decoder's range (E8M0 codes 0, 1, 2, 252, 253,
    254 and NaN)."""
    scheme = get_scheme(wf)
    q = quantize(_data(wf, n, k, 1, seed=seed)[0], scheme.weight_format)
    edges = torch.tensor([0, 1, 2, 252, 253, 254, 255], dtype=torch.uint8)
    rows = torch.arange(min(n, len(edges)))
    q.scales[rows, -1] = edges[rows]
    codes, scales, mbs = exact_bf16.cpu_kernels.pack_weight(
        q.codes, q.scales, q.mbs, k, q.spec, scheme.macro_block
    )
    plain = exact_bf16.ExactBf16Weight.from_quantized(q, scheme)
    return q, codes, scales, mbs, plain


@pytest.mark.parametrize("wf", ["mxfp4-mbs", "mxfp4-ocp", "mxfp4-16-oas"])
@pytest.mark.parametrize(("n", "k"), [(45, 33), (16, 577), (70, 256)])
def test_scalar_decoder_is_the_operand_in_tile_layout(ck, wf, n, k):
    """cpu_amx_unpack's reference decoder (every host): the packed codes and scales give the
    torch path's bf16 operand in amx_pack's layout, bit for bit (zero padding to 32 columns
    and steps; a block the packer marks NaN all NaN)."""
    q, codes, scales, _, plain = _packed_weight(wf, n, k, seed=n + k)
    kp = -(-plain.operand.shape[1] // 32) * 32  # K, or the macro chunks, padded to 32
    got = torch.ops.vllm_mxplus.cpu_amx_unpack(codes, scales, q.spec.block_size, k, n, kp, True)
    rows = exact_bf16._pad_to(plain.operand.float(), 32, kp)
    rows[:n] = _nan_overflowing_blocks(rows[:n], q.spec.block_size)
    want = exact_bf16.amx_pack(rows.to(torch.bfloat16))
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@amx
@pytest.mark.parametrize("wf", ["mxfp4-mbs", "mxfp4-ocp", "mxfp4-16-oas"])
@pytest.mark.parametrize(("n", "k"), [(45, 33), (16, 577), (70, 256)])
def test_vector_decoder_is_the_scalar_one(ck, wf, n, k):
    """The decoder the packed GEMM runs (bit operations on 32 values at a time, the scalar one
    for blocks whose scale leaves its range) = the reference decoder, bits included (NaN
    payloads, -0, subnormal and infinite values)."""
    q, codes, scales, _, _ = _packed_weight(wf, n, k, seed=3 * n + k)
    kp = -(-k // 32) * 32 + 32  # a zero step past the packed groups
    args = (codes, scales, q.spec.block_size, k, n, kp)
    ops = torch.ops.vllm_mxplus
    assert torch.equal(
        ops.cpu_amx_unpack(*args, False).view(torch.int16),
        ops.cpu_amx_unpack(*args, True).view(torch.int16),
    )


@amx
@pytest.mark.parametrize("name", ["mxfp4-mbs", "mxfp4-ocp", "mxfp4-mbs-s", "mxfp4-16-oas"])
@pytest.mark.parametrize("m", [1, 33, 300], ids=lambda m: f"M{m}")
def test_packed_gemm_is_the_held_tiles_gemm(ck, name, m):
    """cpu_amx_packed_gemm (B tiles decoded per task) = cpu_amx_gemm on the same tiles held in
    bf16, bit for bit (NaN where NaN), over several tasks (N = 300: 3 column panels) and K
    spans (K = 1100)."""
    scheme = get_scheme(name)
    n, k = 300, 1100
    q, codes, scales, mbs, plain = _packed_weight(name, n, k, seed=m)
    packed = exact_bf16.ExactBf16Weight.from_quantized(
        q, scheme, tiles=True, packed=(codes, scales, mbs), int8=False
    )
    held = exact_bf16.ExactBf16Weight.from_quantized(q, scheme, tiles=True, int8=False)
    held.tiles = exact_bf16.amx_pack(
        exact_bf16._pad_to(held._untiled(0, n).float(), 32, held.kp_tiles).to(torch.bfloat16)
    )
    held.packed = None
    x = _data(name, 8, k, m, seed=m)[1].to(torch.bfloat16)
    bias = torch.randn(n)
    y = exact_bf16.linear(x, packed, bias, torch.float32)
    want = exact_bf16.linear(x, held, bias, torch.float32)
    torch.testing.assert_close(y, want, rtol=0, atol=0, equal_nan=True)
    finite = torch.isfinite(want)
    assert finite.float().mean() > 0.3
    assert torch.equal(y[finite].view(torch.int32), want[finite].view(torch.int32))  # -0 too


@amx
def test_packed_gemm_refuses_bad_layouts(ck):
    ops = torch.ops.vllm_mxplus
    q, codes, scales, _, _ = _packed_weight("mxfp4-mbs", 32, 64, seed=1)
    a, e = torch.zeros(32, 64, dtype=torch.bfloat16), torch.empty(0)

    def gemm(codes=codes, scales=scales, block=16, k=64, a=a):
        return ops.cpu_amx_packed_gemm(
            a, codes, scales, block, k, e, e, 64, 32, 32, None, torch.float32
        )

    gemm()  # the good call runs
    with pytest.raises(RuntimeError, match="packed weight codes must be"):
        gemm(codes=codes[:, :-1].contiguous())
    with pytest.raises(RuntimeError, match="packed weight scales must be"):
        gemm(scales=scales[:1].contiguous())
    with pytest.raises(RuntimeError, match="block must be 16 or 32"):
        gemm(block=8)
    with pytest.raises(RuntimeError, match="shorter than the weight"):
        gemm(
            k=65,
            codes=torch.zeros(2, 640, dtype=torch.uint8),
            scales=torch.zeros(2, 80, dtype=torch.uint8),
        )


@amx
@pytest.mark.parametrize("name", ["nvfp4", "mxplus"])
def test_a_rows_bits_do_not_depend_on_its_batch(ck, name):
    """Batch invariance on the bf16 tiles (NVFP4 and MX+ weights, from MIN_M rows): each row of
    a batch of 32 or 64 rows, and of the same rows regrouped 8 later, has the bits it has when
    served alone (on the integer kernels). Both paths add exact products and scale each block
    or chunk alike, so a row whose sums are exact in fp32 (as here) cannot tell them apart."""
    scheme = get_scheme(name)
    g = torch.Generator().manual_seed(4)
    q = quantize(torch.randn(40, 320, generator=g) * 0.05, scheme.weight_format)
    backend, layer = _backend(name, 40, 320)
    backend.process_weights_after_loading(layer, q)
    assert backend.exact is not None and backend.exact.min_m == exact_bf16.MIN_M
    x = torch.randn(136, 320, generator=g)
    alone = torch.cat([backend.apply(layer, x[i : i + 1], None) for i in range(136)])
    for m in (32, 64):
        for start in (0, 8):
            cuts = (
                [0, start, *range(start + m, 136, m), 136] if start else [0, *range(m, 136, m), 136]
            )
            y = torch.cat([backend.apply(layer, x[a:b], None) for a, b in zip(cuts, cuts[1:])])
            assert torch.equal(y.view(torch.int32), alone.view(torch.int32)), (m, start)
