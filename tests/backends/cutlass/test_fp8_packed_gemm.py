"""The FP8-chunk GEMM on the packed weight (`cutlass.fp8_packed_gemm`) and the pipeline on it.

- The GPU's inline PTX (`E2M1_FP8_WORD`) run by a small interpreter of the five PTX
  instructions it uses (their semantics as the PTX ISA states them), against the E4M3 bytes
  torch gives each E2M1 value times 2^d: every code in every nibble, every d the tables serve.
- The kernel under the Triton interpreter against the re-encoding pipeline it replaces
  (`weight_fp8_chunks` + `fp8_chunk_gemm`), bit for bit on every column it serves: weights
  with chunks at the edge of its tables (d = -5), past it (d = -6: a fallback row), a zero
  block holding the chunk's largest scale, MBS bytes or none, a bias, rows past the tile.
- `packed_narrow_chunks` / `fallback_rows` on those edges, and the whole `triton-fp8-prefill`
  pipeline taking this kernel within the fp32 bound of formats' product.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from vllm_mxplus.backends.checks import first_outside_bound, output_bound
from vllm_mxplus.backends.cutlass import fp8_chunks as fc
from vllm_mxplus.backends.cutlass import fp8_packed_gemm as fpg
from vllm_mxplus.backends.cutlass import gemm as cutlass_gemm
from vllm_mxplus.backends.cutlass.weight_fp8 import weight_fp8_chunks
from vllm_mxplus.backends.triton.fp8_chunk_gemm import fp8_chunk_gemm
from vllm_mxplus.formats import QuantizedTensor, quantize
from vllm_mxplus.formats.e2m1 import e2m1_decode

MASK32 = 0xFFFFFFFF


# ----------------------------------------------------------------------------- the PTX
def _prmt(a: int, b: int, c: int) -> int:
    """prmt.b32 d, a, b, c (default mode): output byte i from selector nibble i of c: bits
    0..2 index the bytes of {b, a} (a's bytes 0..3, b's 4..7), bit 3 replicates the picked
    byte's bit 7 over the byte."""
    src = a | (b << 32)
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """lop3.b32 d, a, b, c, lut: bit j of d is bit (4 a_j + 2 b_j + c_j) of lut."""
    out = 0
    for j in range(32):
        idx = 4 * ((a >> j) & 1) + 2 * ((b >> j) & 1) + ((c >> j) & 1)
        out |= ((lut >> idx) & 1) << j
    return out


def run_ptx(asm: str, operands: dict[int, int]) -> dict[int, int]:
    """Execute the straight-line PTX of an inline-asm string on 32-bit values: operands
    maps $n to its value (inputs); returns every $n after the last instruction."""
    regs: dict[str, int] = {f"${i}": v & MASK32 for i, v in operands.items()}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0) & MASK32

    body = asm.strip().strip("{}")
    for stmt in (s.strip() for s in body.split(";")):
        if not stmt or stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        args = [t.strip() for t in rest.split(",")]
        d, src = args[0], [val(t) for t in args[1:]]
        if op == "mov.b32":
            r = src[0]
        elif op == "and.b32":
            r = src[0] & src[1]
        elif op == "shr.u32":
            r = src[0] >> src[1]
        elif op == "shl.b32":
            r = src[0] << src[1]
        elif op == "prmt.b32":
            r = _prmt(*src)
        elif op == "lop3.b32":
            r = _lop3(*src)
        else:
            raise AssertionError(f"the emulator does not know {op!r}")
        regs[d] = r & MASK32
    return {int(k[1:]): v for k, v in regs.items() if re.fullmatch(r"\$\d+", k)}


def _e4m3_bytes(codes: list[int], d: int) -> list[int]:
    vals = e2m1_decode(torch.tensor(codes, dtype=torch.uint8)) * 2.0**d
    return vals.to(torch.float8_e4m3fn).view(torch.uint8).tolist()


def _words() -> list[list[int]]:
    """Code octets: every code in every nibble (16 rotations), -0 and +0, and random ones."""
    g = torch.Generator().manual_seed(11)
    words = [[(j + p) % 16 for p in range(8)] for j in range(16)]
    words += [[8] * 8, [0] * 8, [8, 0, 8, 0, 1, 9, 7, 15]]
    words += torch.randint(0, 16, (200, 8), generator=g).tolist()
    return words


@pytest.mark.parametrize("d", range(fc.PACKED_MIN_D, fc.TOP_SHIFT + 1))
def test_ptx_word_gives_the_e4m3_bytes(d):
    """out0 = the E4M3 bytes of nibbles 0..3 (elements 8j..8j+3), out1 those of 4..7: the
    exact E4M3 encoding of each E2M1 value times 2^d (signs and -0 included)."""
    lo, hi = (
        fpg.TABLE_LO.value + d * fpg.STEP_LO.value,
        fpg.TABLE_HI.value + d * fpg.STEP_HI.value,
    )
    for codes in _words():
        word = sum(c << (4 * p) for p, c in enumerate(codes))
        # $2: the 4 code bytes; $3..$6 / $7..$10: the tables (one per packed element)
        ops = {2: word, **{3 + i: lo for i in range(4)}, **{7 + i: hi for i in range(4)}}
        out = run_ptx(fpg.E2M1_FP8_WORD.value, ops)
        got = [(out[0] >> (8 * i)) & 0xFF for i in range(4)]
        got += [(out[1] >> (8 * i)) & 0xFF for i in range(4)]
        assert got == _e4m3_bytes(codes, d), (codes, d)


def test_ptx_emulator_knows_its_instructions():
    """The emulator itself on values worked by hand: prmt picks and sign-replicates, lop3
    0xF8 is a | (b & c), shifts drop the bits past 32."""
    assert _prmt(0x44332211, 0x88776655, 0x0000_7410) == 0x88552211
    assert _prmt(0x7F7F7F80, 0x7F7F7F7F, 0x0000_8908) == 0xFF00_80FF
    assert _lop3(0x0F, 0x85, 0x80, 0xF8) == 0x8F
    assert _lop3(0x01, 0x7F, 0x80, 0xF8) == 0x01
    out = run_ptx("{ .reg .b32 a; shl.b32 a, $1, 4; shr.u32 $0, a, 28; }", {1: 0xF1234567})
    assert out[0] == 0x1


# ----------------------------------------------------------------------------- the kernel
def _packed_weight(
    n: int, k: int, seed: int, mbs: bool, device: torch.device | str = "cpu"
) -> QuantizedTensor:
    """A packed mxfp4 weight [n, k] with the chunk edges placed by hand: row 1's chunk 0 has
    a nonzero block at d = -5 (served), row 2's one at d = -6 (a fallback row), row 3's
    largest scale on an all-zero block, row 4 one all-zero chunk; the rest random in span."""
    fmt = "mxfp4-mbs-d" if mbs else "mxfp4-16"
    q = quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), fmt)
    codes, scales = q.codes.clone(), q.scales.clone()
    top = 130
    scales[1:4, :8] = top - 1
    scales[1:4, 0] = top
    scales[1, 5] = top - 11  # d = 6 - 11 = -5
    scales[2, 5] = top - 12  # d = -6
    codes[3, :8] = 0  # block 0 (the largest scale) all zero
    if n > 4 and k > 128:
        codes[4, 64:128] = 0
    return dataclasses.replace(q, codes=codes, scales=scales).to(device)


def _activation(m: int, k: int, seed: int, device: torch.device | str = "cpu"):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    qx = quantize(x, "mxfp4-mbs-s").to(device)
    return fc.encode_fp8_chunks(qx.codes, qx.scales, qx.mbs, k)


@pytest.mark.parametrize("mbs", [True, False], ids=["mbs", "no-mbs"])
@pytest.mark.parametrize("m,n,k", [(1, 8, 128), (37, 70, 512), (40, 33, 384)])
def test_packed_gemm_equals_the_reencoding_pipeline(triton_device, m, n, k, mbs):
    """Bit for bit the pipeline's numbers on every column the kernel serves (a different ref
    scales a chunk's bytes and its scale by inverse powers of two: the same products)."""
    w = _packed_weight(n, k, seed=m + n, mbs=mbs, device=triton_device)
    xl = _activation(m, k, seed=k, device=triton_device)
    bias = (torch.randn(n) * 3).to(triton_device)
    y = fpg.fp8_packed_gemm(xl.fp8, xl.scale, w.codes, w.scales, w.mbs, k, bias, torch.float32,
                            split_k=1)  # fmt: skip
    w_fp8, w_scale = weight_fp8_chunks(w.codes, w.scales, w.mbs, k, n)
    want = fp8_chunk_gemm(xl.fp8, xl.scale, w_fp8, w_scale, bias, torch.float32)
    served = ~fc.packed_fallback_rows(w.codes, w.scales, w.mbs, k)
    assert served[[0, 1, 3]].all() and not served[2], "the hand-placed edges"
    assert torch.equal(y[:, served], want[:, served])
    assert y.abs().amax() > 0 and not torch.equal(y[:, 0], y[:, 1]), "not a constant output"


def test_packed_gemm_output_dtypes_and_no_bias(triton_device):
    m, n, k = 5, 24, 256
    w = _packed_weight(n, k, seed=2, mbs=True, device=triton_device)
    xl = _activation(m, k, seed=3, device=triton_device)
    served = ~fc.packed_fallback_rows(w.codes, w.scales, w.mbs, k)
    w_fp8, w_scale = weight_fp8_chunks(w.codes, w.scales, w.mbs, k, n)
    for out in (torch.bfloat16, torch.float16, torch.float32):
        y = fpg.fp8_packed_gemm(xl.fp8, xl.scale, w.codes, w.scales, w.mbs, k, None, out, 1)
        want = fp8_chunk_gemm(xl.fp8, xl.scale, w_fp8, w_scale, None, out)
        assert y.dtype == out and torch.equal(y[:, served], want[:, served])


def test_packed_gemm_rejects_bad_operands(triton_device):
    w = _packed_weight(8, 256, seed=4, mbs=True, device=triton_device)
    xl = _activation(4, 256, seed=5, device=triton_device)
    args = (xl.fp8, xl.scale, w.codes, w.scales, w.mbs, 256, None, torch.bfloat16)

    def call(**over):
        a = dict(zip(("a_fp8", "a_scale", "w_codes", "w_scales", "w_mbs", "k", "bias",
                      "out_dtype"), args, strict=True))  # fmt: skip
        a.update(over)
        return fpg.fp8_packed_gemm(**a)

    with pytest.raises(ValueError, match="a_fp8 must be 2-D float8_e4m3fn"):
        call(a_fp8=xl.fp8.float())
    with pytest.raises(ValueError, match="whole 128-element chunks"):
        call(k=200)
    with pytest.raises(ValueError, match="w_codes must be uint8"):
        call(w_codes=w.codes[:, :64])
    with pytest.raises(ValueError, match="w_scales must be uint8"):
        call(w_scales=w.scales[:, :4])
    with pytest.raises(ValueError, match="w_mbs must be"):
        call(w_mbs=w.mbs[:, :1])
    with pytest.raises(ValueError, match="a_scale must be fp32"):
        call(a_scale=xl.scale[:1])
    with pytest.raises(ValueError, match="bias must be fp32"):
        call(bias=torch.zeros(8, device=triton_device).half())
    with pytest.raises(ValueError, match="out_dtype"):
        call(out_dtype=torch.int32)


# ----------------------------------------------------------------------------- fallback rows
def test_narrow_chunks_at_the_tables_edge():
    w = _packed_weight(8, 256, seed=6, mbs=True)
    narrow = fc.packed_narrow_chunks(w.codes, w.scales, 256)
    assert narrow[1, 0] and not narrow[2, 0] and narrow[3, 0]
    bad, packed_bad = cutlass_gemm.fallback_rows(w.codes, w.scales, w.mbs, 256)
    assert 2 in packed_bad.tolist() and 2 not in bad.tolist(), "exact, but wider than the tables"
    assert set(bad.tolist()) <= set(packed_bad.tolist())


def test_pipeline_takes_the_packed_gemm_within_bound(triton_device, monkeypatch):
    """`prefill_gemm` on the Triton engine with K in whole chunks runs `fp8_packed_gemm`
    (counted), recomputes its fallback rows (wide spans, the d = -6 row) and stays within
    the fp32 bound of formats' x_hat W_hat^T; at M above PACKED_WEIGHT_MAX_M it does not."""
    assert cutlass_gemm.packed_serves(10**6, 512, "triton", 100), "sm_100: every M"
    assert not cutlass_gemm.packed_serves(16, 576, "triton", 90), "K not in whole chunks"
    assert not cutlass_gemm.packed_serves(16, 384, "triton", 100), "scale rows not 16 bytes"
    assert not cutlass_gemm.packed_serves(16, 512, "cutlass", 90)
    m, n, k = 21, 40, 512
    g = torch.Generator().manual_seed(9)
    e = torch.randint(-12, 13, (n, k // 16), generator=g)
    e[::2] = 0
    e[2::4, ::5] = -12  # 12 binades down: exact in the FP8 form, wider than the tables
    wdata = torch.randn(n, k, generator=g) * torch.exp2(e.repeat_interleave(16, -1).float())
    qw = quantize(wdata, "mxfp4-mbs-d").to(triton_device)
    qx = quantize(torch.randn(m, k, generator=g), "mxfp4-mbs-s").to(triton_device)
    w = cutlass_gemm.prepare_weight(qw, "sm90a", engine="triton")
    assert w.packed_fallback_idx.numel() > w.fallback_idx.numel() > 0
    calls = []

    def counted(*a, **kw):
        calls.append(a[0].shape[0])
        return fpg.fp8_packed_gemm(*a, **kw)

    monkeypatch.setattr(cutlass_gemm, "fp8_packed_gemm", counted)
    bias = torch.randn(n).to(triton_device)
    y = cutlass_gemm.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, bias, torch.float32)
    assert calls == [m]
    xh, wh = qx.dequantize().double(), qw.dequantize().double()
    y64 = xh @ wh.T + bias.double()
    # the interpreter's dot accumulates in fp32; Hopper's FP8 MMA in about 13 bits
    bits = 24 if triton_device.type == "cpu" else 13
    bound = output_bound(xh.abs() @ wh.abs().T, y64, bias.double(), k, torch.float32, bits)
    failure = first_outside_bound(y.double(), y64, bound, nan_ok=False)
    assert failure is None, failure
    monkeypatch.setitem(cutlass_gemm.PACKED_WEIGHT_MAX_M, 90, m - 1)  # the interpreter's
    y2 = cutlass_gemm.prefill_gemm(qx.codes, qx.scales, qx.mbs, k, w, bias, torch.float32)
    assert calls == [m], "above PACKED_WEIGHT_MAX_M: the re-encoding pipeline"
    assert first_outside_bound(y2.double(), y64, bound, nan_ok=False) is None


@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_packed_gemm_split_k_within_the_chunk_sum_bound(triton_device, split_k):
    """K slices of whole chunks, summed in order with the bias afterwards: the fp64 chunk sum
    within (Kp + 3 nc + 2 + split) u sum |terms| (the slices add split - 1 additions; u =
    2^-24, 2^-13 for Hopper's FP8 MMA), plus one ulp of the output dtype; equal to the unsplit kernel where K has one slice."""
    from cutlass_helpers import emulated_fp8_gemm  # tests/backends/cutlass, on sys.path

    m, n, k = 19, 40, 640
    w = _packed_weight(n, k, seed=8, mbs=True, device=triton_device)
    xl = _activation(m, k, seed=9, device=triton_device)
    bias = (torch.randn(n) * 2).to(triton_device)
    served = ~fc.packed_fallback_rows(w.codes, w.scales, w.mbs, k)
    w_fp8, w_scale = weight_fp8_chunks(w.codes, w.scales, w.mbs, k, n)
    want = emulated_fp8_gemm(xl.fp8, xl.scale, w_fp8, w_scale, bias, torch.float64)
    a = xl.fp8.double().view(m, -1, fc.CHUNK).abs()
    b = w_fp8.double().view(n, -1, fc.CHUNK).abs()
    mag = torch.einsum("mck,nck->cmn", a, b) * xl.scale.double()[:, :, None]
    mag = (mag * w_scale.double()[:, None, :]).sum(0) + bias.double().abs()
    nc = k // fc.CHUNK
    u = 2.0**-24 if triton_device.type == "cpu" else 2.0**-13  # Hopper's FP8 MMA: ~13 bits
    for out, ulp in ((torch.float32, 2.0**-23), (torch.bfloat16, 2.0**-7)):
        y = fpg.fp8_packed_gemm(xl.fp8, xl.scale, w.codes, w.scales, w.mbs, k, bias, out,
                                split_k=split_k)  # fmt: skip
        assert y.shape == (m, n) and y.dtype == out
        bound = (k + 3 * nc + 2 + split_k) * u * mag + ulp * want.abs()
        err = (y.double() - want).abs()
        assert (err[:, served] <= bound[:, served]).all()
        assert (want[:, served].abs() > 64 * bound[:, served]).float().mean() > 0.5
    one = fpg.fp8_packed_gemm(xl.fp8[:, :128], xl.scale[:1], w.codes[:, :64], w.scales[:, :8],
                              w.mbs[:, :1], 128, bias, torch.float32, split_k=4)  # fmt: skip
    ref = fpg.fp8_packed_gemm(xl.fp8[:, :128], xl.scale[:1], w.codes[:, :64], w.scales[:, :8],
                              w.mbs[:, :1], 128, bias, torch.float32)  # fmt: skip
    assert torch.equal(one, ref), "one chunk: one slice, whatever split_k asks"


@pytest.mark.parametrize("split_k", [2, 5, 32])
def test_packed_gemm_sums_its_slices_in_its_own_launch(triton_device, split_k, monkeypatch):
    """Split K summed by the launch's last slice per tile (`gemm_blocks.reduce_split_tile`,
    the counters of `gemm_launch.split_counters`): the bits of the same launch summed by
    `finish_output` (bias, bf16 and fp32 outputs, ragged M and N), the counters back at 0."""
    from vllm_mxplus.backends.triton import gemm_launch

    m, n = 19, 40
    k = 640 if split_k < 32 else 32 * 128  # 32 chunks: more slices than the sum unrolls
    w = _packed_weight(n, k, seed=8, mbs=True, device=triton_device)
    xl = _activation(m, k, seed=9, device=triton_device)
    bias = (torch.randn(n) * 2).to(triton_device)
    args = (xl.fp8, xl.scale, w.codes, w.scales, w.mbs, k, bias)
    counters = gemm_launch.split_counters(triton_device)
    for out, view in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        in_launch = fpg.fp8_packed_gemm(*args, out, split_k=split_k)
        assert not counters.cpu().any(), "a tile's counter was not set back to 0"
        with monkeypatch.context() as mp:
            mp.setattr(fpg, "split_counters", lambda device: None)
            second = fpg.fp8_packed_gemm(*args, out, split_k=split_k)
        assert in_launch.dtype == second.dtype == out
        assert torch.equal(in_launch.view(view), second.view(view))
