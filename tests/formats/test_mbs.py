"""MBS-S against the bit formula of paper eq. 3; the fast MBS-D search against brute force."""

import struct

import numpy as np
import pytest
import torch

from vllm_mxplus.formats import (
    mbs_dynamic,
    mbs_dynamic_bruteforce,
    mbs_search,
    mbs_static,
    quantize,
)


def eq3_reference(block: list[float]) -> int:
    """Paper eq. 3 with Python's struct: m = (bits(fp32(6 / a)) & 0x007F8000) >> 15."""
    a = max(abs(v) for v in block)
    if a == 0:
        return 0
    r = np.float32(6.0) / np.float32(a)
    bits = struct.unpack("<I", struct.pack("<f", float(r)))[0]
    return (bits & 0x007F8000) >> 15


@pytest.mark.parametrize("scale", [1e-3, 1.0, 37.0, 1e4], ids=lambda s: f"x{s:g}")
def test_mbs_static_matches_eq3(scale):
    x = torch.randn(40, 384) * scale
    got = mbs_static(x, 128)
    expected = [[eq3_reference(row[i : i + 128]) for i in range(0, 384, 128)] for row in x.tolist()]
    assert got.tolist() == expected


def test_mbs_static_special_blocks():
    x = torch.zeros(3, 128)
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    assert mbs_static(x, 128).tolist() == [[0], [0], [0]]


def test_mbs_factor_is_exact():
    m = torch.arange(256, dtype=torch.uint8)
    from vllm_mxplus.formats.mx import mbs_factor

    f = mbs_factor(m).double()
    assert torch.equal(f, 1.0 + torch.arange(256, dtype=torch.float64) / 256)


def _cases():
    g = torch.Generator().manual_seed(7)
    yield "normal", torch.randn(32, 512, generator=g)
    yield "bf16", torch.randn(32, 512, generator=g).bfloat16().float()
    out = torch.randn(32, 512, generator=g)
    out[:, ::41] *= 30
    yield "outliers", out
    yield "integers", torch.randint(-7, 8, (32, 512), generator=g).float()
    yield "mixed_rows", torch.randn(32, 512, generator=g) * torch.logspace(-20, 20, 32)[:, None]
    tiny = torch.randn(8, 256, generator=g) * 1e-35  # below the fast path's safe range
    yield "tiny", tiny
    sparse = torch.zeros(16, 256)
    sparse[:, 3] = torch.randn(16, generator=g)
    yield "one_nonzero", sparse


@pytest.mark.parametrize("name,x", list(_cases()), ids=[c[0] for c in _cases()])
def test_mbs_dynamic_equals_bruteforce(name, x):
    assert torch.equal(mbs_dynamic(x, 128), mbs_dynamic_bruteforce(x, 128))


def test_mbs_dynamic_rescoring_path_is_exercised():
    # a lone power of two is exact for m = 0 and m = 128 (F = 1.5): tied SSEs of zero
    # that must go through exact re-scoring and resolve to the smaller m
    x = torch.zeros(64, 128)
    x[:, 9] = 2.0 ** torch.randint(-5, 5, (64,)).float()
    sse, tol = mbs_search._approx_sse(x, 16)
    ncand = ((sse - tol) <= (sse + tol).amin(-1, keepdim=True)).sum(-1)
    assert bool((ncand > 1).all())
    assert torch.equal(mbs_dynamic(x, 128), mbs_dynamic_bruteforce(x, 128))
    assert bool((mbs_dynamic(x, 128) == 0).all())


def test_mbs_dynamic_is_argmin_with_ties_to_smaller_m():
    """Independent float64 brute force on a tiny tensor (no shared quantization code)."""
    vals = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])

    def e2m1(v):
        i = np.argmin(np.abs(v[..., None] - vals), axis=-1)
        d = np.abs(v[..., None] - vals)
        best = d.min(-1, keepdims=True)
        ties = d == best
        even = ties & (np.arange(8) % 2 == 0)
        i = np.where(ties.sum(-1) > 1, even.argmax(-1), i)
        return vals[i]

    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    got = mbs_dynamic(torch.from_numpy(x), 128).tolist()
    for row, m_got in zip(x, got):
        sses = []
        for m in range(256):
            f = np.float32(1 + m / 256)
            y = (row * f).astype(np.float32).reshape(8, 16)
            a = np.abs(y).max(-1)
            mant, ex = np.frexp(a.astype(np.float64))
            sig, e = mant * 2, ex - 1
            s = e - 2 + (sig > 1.75)
            xs = 2.0**s
            q = np.sign(y) * e2m1(np.abs(y) / xs[:, None]) * xs[:, None]
            xhat = (q.astype(np.float32) / f).astype(np.float32).reshape(-1)
            sses.append(float(((row.astype(np.float64) - xhat) ** 2).sum()))
        assert m_got[0] == int(np.argmin(sses))


@pytest.mark.parametrize("k", [100, 576, 700], ids=lambda k: f"K{k}")
def test_partial_macro_block_is_a_shorter_macro_block(k):
    x = torch.randn(5, k)
    for fmt in ("mxfp4-mbs-s", "mxfp4-mbs-d"):
        q = quantize(x, fmt)
        assert q.mbs.shape == (5, -(-k // 128))
        tail = k % 128 or 128
        # the last macro block quantized alone gives the same byte and values
        q_tail = quantize(x[:, k - tail :], fmt)
        assert torch.equal(q.mbs[:, -1:], q_tail.mbs)
        assert torch.equal(q.dequantize()[:, k - tail :], q_tail.dequantize())
