"""An independent re-derivation of docs/numerics.md in numpy, for tests only.

It shares no code with `vllm_mxplus.formats`: scale exponents come from `np.frexp` instead of
bit masks, E2M1 rounding from distances to the value table instead of thresholds, E4M3 from
an explicit quantum instead of a dtype cast, MBS-S from the value of 6/a instead of its bits,
MBS-D from an exhaustive search over all 256 bytes at once, and partial blocks are handled as
shorter blocks instead of zero padding. fp32 steps use numpy float32 (IEEE, nearest even)
exactly where the spec says fp32; everything exact is done in float64.

`ref_quantize(x, fmt, per_row)` returns a dict for a 2-D fp32 numpy array x [R, K]:
  codes int64 [R, K] (unpacked 4-bit codes), scales [R, nB] (E8M0 codes, or E4M3 values as
  float64 for nvfp4), mbs int64 [R, nM], bm_index int64 [R, nB] (mxplus), global_scale
  float32 [R] (nvfp4), x_hat float32 [R, K].
"""

from __future__ import annotations

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
BLOCK = {
    "mxfp4-ocp": 32,
    "mxplus": 32,
    "mxfp4-16": 16,
    "mxfp4-16-oas": 16,
    "mxfp4-mbs-s": 16,
    "mxfp4-mbs-d": 16,
    "nvfp4": 16,
}
RULE = {
    "mxfp4-ocp": "ocp",
    "mxplus": "ocp",
    "mxfp4-16": "floor",
    "mxfp4-16-oas": "oas",
    "mxfp4-mbs-s": "oas",
    "mxfp4-mbs-d": "oas",
}
D_ABOVE = {"ocp": np.inf, "floor": 1.5, "oas": 1.75}  # d = 1 when the significand f > this
MACRO = 128
E4M3_MAX = 448.0


def e2m1_round(v: np.ndarray) -> np.ndarray:
    """Magnitude codes of v >= 0 (float64): nearest table value, ties to the even code,
    saturating at 6."""
    d = np.abs(np.minimum(v, 6.0)[..., None] - E2M1)
    idx = np.argmin(d, axis=-1)  # the lower code on a tie
    nxt = np.minimum(idx + 1, 7)
    tie = np.take_along_axis(d, nxt[..., None], -1)[..., 0] == d.min(-1)
    return np.where(tie & (idx % 2 == 1) & (nxt != idx), nxt, idx)


def decode(codes: np.ndarray) -> np.ndarray:
    """float32 values of 4-bit codes; code 8 is -0."""
    mag = E2M1[codes & 7]
    return np.where(codes & 8, -mag, mag).astype(np.float32)


def e8m0_codes(a: np.ndarray, rule: str) -> np.ndarray:
    """E8M0 code per block absmax a (docs/numerics.md, E8M0 block scales)."""
    with np.errstate(invalid="ignore"):
        mant, e = np.frexp(np.where(np.isfinite(a) & (a > 0), a, 1.0))  # a = mant * 2^e
        f, big_e = 2 * mant, e - 1
        code = np.clip(big_e - 2 + (f > D_ABOVE[rule]) + 127, 0, 254)
    code = np.where(a == 0, 0, code)
    return np.where(np.isfinite(a), code, 255).astype(np.int64)


def pow2_f32(k: np.ndarray) -> np.ndarray:
    return np.ldexp(1.0, k).astype(np.float32)


def blocks_e8m0(y: np.ndarray, bs: int, rule: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """fp32 y [..., K] in blocks of bs along K (a shorter last block): codes, scales, and the
    fp32 values value * X."""
    codes, scales, vx = [], [], []
    for s in range(0, y.shape[-1], bs):
        b = y[..., s : s + bs].astype(np.float64)
        with np.errstate(invalid="ignore"):
            a = np.abs(b).max(-1)  # NaN propagates; Inf stays Inf
        sc = e8m0_codes(a, rule)
        bad = (sc == 255)[..., None]
        x_scale = np.ldexp(1.0, np.minimum(sc, 254) - 127)[..., None]
        with np.errstate(invalid="ignore"):
            c = e2m1_round(np.where(bad, 0.0, np.abs(b) / x_scale))  # exact: a power of two
        c = np.where(bad, 0, c | (np.signbit(b) * 8))
        v = decode(c) * pow2_f32(np.minimum(sc, 254) - 127)[..., None]
        codes.append(c)
        scales.append(sc)
        vx.append(np.where(bad, np.float32(np.nan), v))
    return np.concatenate(codes, -1), np.stack(scales, -1), np.concatenate(vx, -1)


def mbs_factor(m: np.ndarray) -> np.ndarray:
    return (1 + np.asarray(m) / 256).astype(np.float32)  # exact: 8 fraction bits


def mbs_static_byte(xm: np.ndarray) -> int:
    """Paper eq. 3 from the value of r = fp32(6 / a): its 8 leading fraction bits."""
    a = np.float32(np.abs(xm.astype(np.float64)).max())
    if not np.isfinite(a) or a == 0:
        return 0
    with np.errstate(over="ignore"):
        r = np.float32(6.0) / a
    if not np.isfinite(r):
        return 0
    mant, _ = np.frexp(float(r))
    return int(np.floor((2 * mant - 1) * 256))


def mbs_quantize(xm: np.ndarray, m: np.ndarray):
    """MBS with bytes m [C] for one macro block xm [L]: y = fp32(x * F), OAS blocks of 16,
    x_hat = fp32(value * X) / F in fp32. Returns codes [C, L], scales [C, nB], x_hat [C, L]."""
    f = mbs_factor(m)[:, None]
    y = (xm[None, :] * f).astype(np.float32)
    codes, scales, vx = blocks_e8m0(y, 16, "oas")
    return codes, scales, (vx / f).astype(np.float32)


def mbs_dynamic_byte(xm: np.ndarray) -> int:
    """argmin over all 256 bytes of the float64 SSE; np.argmin takes the first (smaller m)."""
    if not np.isfinite(xm).all():
        return 0
    _, _, xh = mbs_quantize(xm, np.arange(256))
    sse = ((xm.astype(np.float64)[None, :] - xh.astype(np.float64)) ** 2).sum(-1)
    return int(np.argmin(sse))


def e4m3_round(s: np.ndarray) -> np.ndarray:
    """fp32 s >= 0 to float8_e4m3fn values: nearest, ties to even, subnormals kept (quantum
    2^-9 below 2^-6), saturating at 448."""
    s = np.minimum(s.astype(np.float64), E4M3_MAX)
    _, e = np.frexp(np.where(s > 0, s, 1.0))
    quantum = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    return np.rint(s / quantum) * quantum  # np.rint: half to even; s / quantum is exact


def nvfp4(x: np.ndarray, per_row: bool) -> dict:
    finite = np.where(np.isfinite(x), np.abs(x), 0).astype(np.float32)
    amax = finite.max(-1) if per_row else np.full(x.shape[0], finite.max(), np.float32)
    g = (amax / np.float32(6.0 * E4M3_MAX)).astype(np.float32)[:, None]
    codes, scales, xh = [], [], []
    for s in range(0, x.shape[-1], 16):
        b = x[:, s : s + 16]
        with np.errstate(invalid="ignore", divide="ignore"):
            amax_b = np.abs(b).max(-1, keepdims=True).astype(np.float32)
            s32 = ((amax_b / np.float32(6.0)).astype(np.float32) / g).astype(np.float32)
        s32 = np.where(g > 0, s32, np.float32(0))
        nan = ~np.isfinite(b).all(-1, keepdims=True)
        sc = np.where(nan, np.nan, e4m3_round(np.where(nan, 0, s32))).astype(np.float32)
        zero = (sc == 0) | nan
        denom = np.where(zero, np.float32(1), (sc * g).astype(np.float32))
        with np.errstate(invalid="ignore"):
            v = (np.abs(b) / denom).astype(np.float32)
            c = e2m1_round(np.where(zero, 0.0, v.astype(np.float64)))
        c = np.where(zero, 0, c | (np.signbit(b) * 8))
        out = ((decode(c) * sc).astype(np.float32) * g).astype(np.float32)
        codes.append(c)
        scales.append(sc[:, 0].astype(np.float64))
        xh.append(np.where(nan, np.float32(np.nan), out))
    return {
        "codes": np.concatenate(codes, -1),
        "scales": np.stack(scales, -1),
        "x_hat": np.concatenate(xh, -1),
        "global_scale": g[:, 0],
    }


def mxplus(x: np.ndarray) -> dict:
    """MXFP4-OCP, then the first largest |x| of each block keeps 3 mantissa bits."""
    codes, scales, vx = blocks_e8m0(x, 32, "ocp")
    bm = np.full(scales.shape, 255, np.int64)
    for r in range(x.shape[0]):
        for blk, s in enumerate(range(0, x.shape[1], 32)):
            b = x[r, s : s + 32].astype(np.float64)
            sc = scales[r, blk]
            if sc == 255:
                continue
            i = int(np.argmax(np.abs(b)))  # first maximal index
            v = abs(b[i]) / np.ldexp(1.0, sc - 127)
            if v < 4.0:
                continue
            j = int(min(max(np.rint(2 * v - 8), 0), 7))  # half to even, saturating at 7.5
            bm[r, blk] = i
            codes[r, s + i] = j | (8 if np.signbit(b[i]) else 0)
            mag = np.float32(4 * (1 + j / 8)) * pow2_f32(sc - 127)
            vx[r, s + i] = -mag if np.signbit(b[i]) else mag
    return {"codes": codes, "scales": scales, "x_hat": vx, "bm_index": bm}


def ref_quantize(x: np.ndarray, fmt: str, per_row: bool = False) -> dict:
    """Independent quantization of fp32 x [R, K] (see the module docstring)."""
    x = np.ascontiguousarray(x, np.float32)
    if fmt == "nvfp4":
        return nvfp4(x, per_row)
    if fmt == "mxplus":
        return mxplus(x)
    if fmt not in ("mxfp4-mbs-s", "mxfp4-mbs-d"):
        codes, scales, vx = blocks_e8m0(x, BLOCK[fmt], RULE[fmt])
        return {"codes": codes, "scales": scales, "x_hat": vx}
    pick = mbs_static_byte if fmt == "mxfp4-mbs-s" else mbs_dynamic_byte
    rows, k = x.shape
    out = {"codes": [], "scales": [], "x_hat": [], "mbs": []}
    for r in range(rows):
        c_r, s_r, x_r, m_r = [], [], [], []
        for s in range(0, k, MACRO):
            xm = x[r, s : s + MACRO]
            m = pick(xm)
            c, sc, xh = mbs_quantize(xm, np.array([m]))
            c_r.append(c[0])
            s_r.append(sc[0])
            x_r.append(xh[0])
            m_r.append(m)
        out["codes"].append(np.concatenate(c_r))
        out["scales"].append(np.concatenate(s_r))
        out["x_hat"].append(np.concatenate(x_r))
        out["mbs"].append(m_r)
    return {key: np.array(v) for key, v in out.items()}


def pack(codes: np.ndarray) -> np.ndarray:
    """Element 2i in the low nibble, 2i+1 in the high nibble; odd K: high nibble 0."""
    rows, k = codes.shape
    padded = np.zeros((rows, k + k % 2), np.int64)
    padded[:, :k] = codes
    return (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8)
