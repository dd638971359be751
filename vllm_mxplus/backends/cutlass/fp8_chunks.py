"""The sm_90a operand layout: MXFP4 (E8M0 block 16, optional MBS) re-encoded as FP8 E4M3 with
one fp32 scale per (row, 128-K chunk). Pure torch, any device; the definition that the fused
Triton encoder (`act_fp8`) and the CUTLASS GEMM (`gemm`) are held to.

Lossless FP8 re-encoding (docs/numerics.md, "Kernel numerics and error bounds"). An element is
value(code)·2^(s-127)/F with value = 2^p·{1, 1.5}, p in {-1..2}. With d = s - ref its FP8 code
must hold value·2^d. E4M3 (fn) holds 2^q for q in [-9, 8] (2^-9 is its smallest subnormal) and
1.5·2^q for q in [-8, 8] (448 = 1.75·2^8 is the max). Taking ref = (largest block exponent of
the chunk) - 6 puts the top block at d = 6 (6·2^6 = 384 <= 448; d = 7 would give 768). Every
E2M1 value is then exact for d in [-8, 6] (0.5·2^-8 = 2^-9 and 1.5·2^-8 = 3·2^-9 are
subnormals), so a chunk whose nonzero block exponents span <= 14 binades is always lossless.
The exact per-element condition is weaker (value 4 survives down to d = -11);
`encode_fp8_chunks` tests every element by an FP8 round trip and marks the chunk `exact` only
if all survive and the folded scale is a normal fp32 (ref >= MIN_EXACT_REF).

Rows with a chunk that is not exact (a wider span, a NaN block, a scale under 2^-125) are
recomputed by the CUTLASS path's exact fallback from the packed operands (`gemm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_mxplus.formats.constants import (
    E8M0_BIAS,
    E8M0_NAN,
    MACRO_BLOCK,
    SMALL_BLOCK,
    ceil_div,
)
from vllm_mxplus.formats.e2m1 import e2m1_decode, unpack_fp4
from vllm_mxplus.formats.e8m0 import pow2_f32
from vllm_mxplus.formats.mx import mbs_factor

CHUNK = MACRO_BLOCK  # 128: the K extent of one scale / one MBS factor
BLOCK = SMALL_BLOCK  # 16
BLOCK_PER_CHUNK = CHUNK // BLOCK
TOP_SHIFT = 6  # 6 * 2^6 = 384 <= F8E4M3_MAX; 6 * 2^7 = 768 is not
MIN_EXACT_REF = 2  # 2^(ref-127) * sigma stays a normal fp32 (sigma in (0.5, 1])
_EXP_LO, _EXP_HI = -149, 127  # pow2_f32's exact range


@dataclass
class Fp8ChunkLayout:
    """One operand [R, K] re-encoded for the sm_90a GEMM (K padded to whole chunks, Kp).

    fp8: float8_e4m3fn [R, Kp]; scale: fp32 [Kp/128, R] = 2^(ref-127) / F folded (kernel);
    ref: int32 [R, nc]; mbs: uint8 [R, nc]; exact: bool [R, nc] (chunk reproduced exactly).
    """

    fp8: torch.Tensor
    scale: torch.Tensor
    ref: torch.Tensor
    mbs: torch.Tensor
    exact: torch.Tensor
    k: int

    @property
    def exact_rows(self) -> torch.Tensor:
        return self.exact.all(dim=-1)

    def fields(self) -> tuple[torch.Tensor, ...]:
        """(fp8, scale, ref, mbs, exact): the tensors, in the order the custom ops take them."""
        return self.fp8, self.scale, self.ref, self.mbs, self.exact


def ceil_to(a: int, b: int) -> int:
    """a rounded up to a multiple of b."""
    return ceil_div(a, b) * b


def pad_last(t: torch.Tensor, n: int, value: int = 0) -> torch.Tensor:
    return F.pad(t, (0, n - t.shape[-1]), value=value) if t.shape[-1] < n else t


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return F.pad(t, (0, 0, 0, rows - t.shape[0])) if t.shape[0] < rows else t


def _unpacked(codes: torch.Tensor, scales: torch.Tensor, mbs: torch.Tensor | None, k: int):
    """(codes [R, Kp] 0..15, scales int32 [R, Kp/16], mbs uint8 [R, nc]) padded to chunks."""
    r = codes.shape[0]
    kp = ceil_to(k, CHUNK)
    nc, nb = kp // CHUNK, kp // BLOCK
    c = F.pad(unpack_fp4(codes, k), (0, kp - k))
    s = pad_last(scales, nb).to(torch.int32)  # padded blocks: code 0, all-zero elements
    m = pad_last(mbs, nc) if mbs is not None else codes.new_zeros((r, nc))
    return c, s, m


def _encode(c: torch.Tensor, s: torch.Tensor, m: torch.Tensor, live: torch.Tensor, k: int):
    """FP8 layout of the blocks where `live` [R, Kp/16] is True (the others encode as zeros).
    Returns (layout, ok per element [R, Kp]); `exact` covers the live blocks only."""
    r, kp = c.shape
    nc = kp // CHUNK
    nonzero_block = ((c & 7) != 0).view(r, -1, BLOCK).any(-1) & live
    s_live = torch.where(nonzero_block, s, torch.full_like(s, -1)).view(r, nc, BLOCK_PER_CHUNK)
    s_max = s_live.amax(-1)  # -1: an all-zero chunk
    ref = torch.where(s_max >= 0, s_max - TOP_SHIFT, torch.full_like(s_max, E8M0_BIAS))
    d = s.view(r, nc, BLOCK_PER_CHUNK) - ref[..., None]  # [R, nc, 8]
    d = d.clamp(_EXP_LO, _EXP_HI).repeat_interleave(BLOCK, dim=-1).view(r, kp)
    live_el = live.repeat_interleave(BLOCK, dim=-1)
    val = torch.where(live_el, e2m1_decode(c) * pow2_f32(d), 0.0)  # exact fp32
    fp8 = val.to(torch.float8_e4m3fn)
    # An element survives if FP8 holds it exactly and it did not underflow to 0 in fp32.
    ok = (fp8.to(torch.float32) == val) & ((val != 0) | ((c & 7) == 0) | ~live_el)
    survives = ok.view(r, nc, CHUNK).all(-1)
    no_nan = ((s != E8M0_NAN) | ~live).view(r, nc, BLOCK_PER_CHUNK).all(-1)
    exact = survives & no_nan & (ref >= MIN_EXACT_REF)
    sigma = 1.0 / mbs_factor(m)  # fp32(1/F); the kernel folds it with the power of two
    scale = pow2_f32((ref - E8M0_BIAS).clamp(_EXP_LO, _EXP_HI)) * sigma
    lay = Fp8ChunkLayout(
        fp8=fp8, scale=scale.t().contiguous(), ref=ref, mbs=m.to(torch.uint8), exact=exact, k=k
    )
    return lay, ok


def encode_fp8_chunks(
    codes: torch.Tensor, scales: torch.Tensor, mbs: torch.Tensor | None, k: int
) -> Fp8ChunkLayout:
    """E2M1 codes [R, ceil(K/2)] + E8M0 scales [R, ceil(K/16)] + MBS bytes [R, ceil(K/128)]
    (None: F = 1) -> the FP8 per-(row, chunk) layout."""
    c, s, m = _unpacked(codes, scales, mbs, k)
    live = torch.ones(s.shape, dtype=torch.bool, device=s.device)
    return _encode(c, s, m, live, k)[0]


def dequantize_fp8_chunks(layout: Fp8ChunkLayout) -> torch.Tensor:
    """(fp8 · 2^(ref-127)) / F per element, fp32 [R, K]: bit-exact to formats' x_hat on every
    `exact` chunk (the power of two is exact; the division is the spec's IEEE division)."""
    pow2 = pow2_f32(layout.ref - E8M0_BIAS).repeat_interleave(CHUNK, dim=-1)
    f = mbs_factor(layout.mbs).repeat_interleave(CHUNK, dim=-1)
    return ((layout.fp8.to(torch.float32) * pow2) / f)[:, : layout.k]


# The FP8 form read from the packed weight inside the GEMM (`triton.fp8_packed_gemm`): ref is
# the largest block scale of the chunk (nonzero blocks or not) - TOP_SHIFT, and a block at
# d = s - ref is looked up in a table that holds only normal E4M3 bytes, d >= PACKED_MIN_D.
PACKED_MIN_D = -5  # 0.5 * 2^-5 = 2^-6, E4M3's smallest normal


def packed_narrow_chunks(codes: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """bool [R, nc]: whether every nonzero 16-block of the chunk lies within 6 - PACKED_MIN_D
    = 11 binades of the chunk's largest block scale (`packed_fallback_rows`)."""
    r = codes.shape[0]
    c, s, _ = _unpacked(codes, scales, None, k)
    nc = c.shape[1] // CHUNK
    nonzero = ((c & 7) != 0).view(r, nc, BLOCK_PER_CHUNK, BLOCK).any(-1)
    s = s.view(r, nc, BLOCK_PER_CHUNK)
    d = s - (s.amax(-1, keepdim=True) - TOP_SHIFT)
    return ((d >= PACKED_MIN_D) | ~nonzero).all(-1)


def packed_fallback_rows(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mbs: torch.Tensor | None,
    k: int,
    exact: torch.Tensor | None = None,
) -> torch.Tensor:
    """bool [R]: the weight rows the packed-weight FP8 GEMM does not serve exactly, recomputed
    from the packed operands: a chunk the FP8 form cannot hold (not `exact`) or one wider than
    its tables (`packed_narrow_chunks`). exact: the layout's `exact` [R, nc] where the caller
    has encoded the rows already (else encoded here)."""
    if exact is None:
        exact = encode_fp8_chunks(codes, scales, mbs, k).exact
    return ~(exact & packed_narrow_chunks(codes, scales, k)).all(-1)
