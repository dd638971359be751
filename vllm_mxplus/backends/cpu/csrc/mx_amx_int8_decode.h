// The weight side of the E8M0 linear on AMX-INT8 tiles (mx_amx_int8_cpu.cpp states what it
// computes): the integer kernels' packed tiles decoded per call into `tdpbssd` B tiles, each
// column's block scales folded into its codes where exact, what the decode found per step, and
// the check that the fold was exact for the call.
#pragma once

#include <cstdint>
#include <cstring>

#include "mx_amx_int8_rows.h"

namespace mxplus_cpu {
namespace int8_detail {

#ifdef MXPLUS_AMX
using gemm_detail::WeightTiles;

constexpr int kPackedPerStep = 4;    // 16-element packed groups per step
// EA + EW >= this: 2^(EA + EW - 256) is normal, and so is its product with an MBS factor
// t = fl(1/Fa) fl(1/Fw) > 1/4
constexpr int kLowWindow = 256 - 124;
constexpr int kHighWindow = 256 + 107;  // EA + EW <= this: |J| 2^(EA + EW - 256) < 2^127

// 2 * value(code) * 2^shift at index shift << 4 | code: the B tiles' table.
struct Int8Table {
  alignas(64) int8_t v[64];
  constexpr Int8Table() : v() {
    for (int s = 0; s < 4; ++s)
      for (int c = 0; c < 16; ++c) v[s * 16 + c] = static_cast<int8_t>(kE2M1x2[c] * (1 << s));
  }
};
constexpr Int8Table kInt8Table{};

// Byte o of a 64-byte vector reads byte o / 4 of a 16-byte one (a column's shift to its 4
// codes of a B row).
struct Spread4 {
  alignas(64) uint8_t idx[64];
  constexpr Spread4() : idx() {
    for (int o = 0; o < 64; ++o) idx[o] = static_cast<uint8_t>(o / 4);
  }
};
constexpr Spread4 kSpread4{};

// What a step's decode of one column tile found.
struct StepMeta {
  alignas(64) int32_t ew_bits[16];  // EW << 23 of a folded column (kDummyExp for none)
  alignas(16) uint8_t lo[16];       // the column's lowest nonzero-block code (255: none)
  uint16_t fold_lanes;              // columns whose spread folds
  bool folded;                      // every column folds
  bool unit_folded;                 // every column folds over the step's unit (same EW)
};

// Per column lane of tile t, the lowest and highest nonzero E8M0 code of blocks [b0, b1)
// (lo 255 and hi 0 where all are zero).
MXPLUS_AMX_INT8_TARGET inline void scale_range(const WeightTiles& w, int64_t t, int64_t b0,
                                               int64_t b1, __m128i* lo, __m128i* hi) {
  *lo = _mm_set1_epi8(char(255));
  *hi = _mm_setzero_si128();
  for (int64_t b = b0; b < std::min(b1, w.nb); ++b) {
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales + (t * w.nb + b) * 16));
    const __mmask16 live = _mm_test_epi8_mask(e, e);
    *lo = _mm_mask_min_epu8(*lo, live, *lo, e);
    *hi = _mm_mask_max_epu8(*hi, live, *hi, e);
  }
}

// The lanes whose nonzero codes in [lo, hi] fold (spread <= 3, or none).
MXPLUS_AMX_INT8_TARGET inline __mmask16 fold_lanes(__m128i lo, __m128i hi) {
  const __mmask16 any = _mm_cmpneq_epi8_mask(lo, _mm_set1_epi8(char(255)));
  return static_cast<__mmask16>(
      ~any | _mm_mask_cmple_epu8_mask(any, _mm_sub_epi8(hi, lo), _mm_set1_epi8(kMaxSpread)));
}

// The weight codes one thread's decodes met: the extremes of the nonzero blocks' E8M0 codes
// (per column lane; a NaN block's 255 is among them) and whether a block of scale code 0 held
// a nonzero code. Checked once the thread is done (`fits`), not per tile: where they fail
// the call's results are discarded and the integer kernels compute it.
struct WeightSeen {
  __m128i lo, hi;
  bool tiny = false;
};

// The B tile of column tile t, step s (16 rows x 64 bytes), and its StepMeta.
MXPLUS_AMX_INT8_TARGET inline void decode_step(const WeightTiles& w, int64_t block, int64_t t, int64_t s,
                                        __m128i ulo, __mmask16 ufold, int8_t* out,
                                        StepMeta* meta, WeightSeen* seen) {
  const __m512i table = _mm512_load_si512(kInt8Table.v);
  const __m512i spread = _mm512_load_si512(kSpread4.idx);
  const __m512i nib = _mm512_set1_epi8(0x0F);
  if (t >= w.nt) {  // past the weight: zero columns
    std::memset(out, 0, kAmxRows * kStepK);
    for (int i = 0; i < 16; ++i) meta->ew_bits[i] = static_cast<int32_t>(kDummyExp) << 23;
    std::memset(meta->lo, 255, 16);
    meta->fold_lanes = 0xFFFF;
    meta->folded = meta->unit_folded = true;
    return;
  }
  const int64_t bps = kStepK / block, ppb = block / 16, b0 = s * bps;
  __m128i lo, hi;
  scale_range(w, t, b0, b0 + bps, &lo, &hi);
  seen->lo = _mm_min_epu8(seen->lo, lo);
  seen->hi = _mm_max_epu8(seen->hi, hi);
  // the lanes that fold over the unit take its base (ulo) in both its steps
  lo = _mm_mask_blend_epi8(ufold, lo, ulo);
  const __mmask16 any = _mm_cmpneq_epi8_mask(lo, _mm_set1_epi8(char(255)));
  const __mmask16 fold = ufold | fold_lanes(lo, hi);
  const __m512i ew = _mm512_mask_blend_epi32(any, _mm512_set1_epi32(kDummyExp),
                                             _mm512_cvtepu8_epi32(lo));
  _mm512_store_si512(meta->ew_bits, _mm512_slli_epi32(ew, 23));
  _mm_store_si128(reinterpret_cast<__m128i*>(meta->lo), lo);
  meta->fold_lanes = fold;
  meta->folded = fold == 0xFFFF;
  // and every lane's unit base at least kMinUnitWeightExp (W normal: unit_row_scale)
  meta->unit_folded =
      ufold == 0xFFFF && !_mm_mask_cmplt_epu8_mask(any, lo, _mm_set1_epi8(kMinUnitWeightExp));
  __m128i sc[4];
  for (int64_t b = b0; b < std::min(w.nb, b0 + bps); ++b)
    sc[b - b0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales + (t * w.nb + b) * 16));
  for (int p = 0; p < kPackedPerStep; ++p) {
    const int64_t grp = s * kPackedPerStep + p, b = b0 + p / ppb;
    int8_t* rows = out + 4 * p * kStepK;
    if (grp >= w.groups) {
      std::memset(rows, 0, 4 * kStepK);
      continue;
    }
    const __m128i e = sc[b - b0];
    const __mmask16 live = _mm_test_epi8_mask(e, e);
    // shift << 4 for the columns that fold, 0 for the others and for all-zero blocks
    const __m128i sh = _mm_slli_epi16(_mm_maskz_sub_epi8(live & fold, e, lo), 4);
    const __m512i shift = _mm512_permutexvar_epi8(spread, _mm512_castsi128_si512(sh));
    const uint8_t* g = w.codes + (t * w.groups + grp) * gemm_detail::kGroupBytes;
    const __m512i p0 = _mm512_loadu_si512(g), p1 = _mm512_loadu_si512(g + 64);
    constexpr int kAndOr = 0xEA;  // (a & b) | c
    const __m512i r0 = _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(p0, nib, shift, kAndOr), table);
    const __m512i r1 = _mm512_permutexvar_epi8(
        _mm512_ternarylogic_epi32(_mm512_srli_epi16(p0, 4), nib, shift, kAndOr), table);
    const __m512i r2 = _mm512_permutexvar_epi8(_mm512_ternarylogic_epi32(p1, nib, shift, kAndOr), table);
    const __m512i r3 = _mm512_permutexvar_epi8(
        _mm512_ternarylogic_epi32(_mm512_srli_epi16(p1, 4), nib, shift, kAndOr), table);
    _mm512_storeu_si512(rows, r0);
    _mm512_storeu_si512(rows + kStepK, r1);
    _mm512_storeu_si512(rows + 2 * kStepK, r2);
    _mm512_storeu_si512(rows + 3 * kStepK, r3);
    if (live != 0xFFFF) {  // a block of scale code 0 must be all zero (not tiny values)
      const __m512i any_code = _mm512_or_si512(_mm512_or_si512(r0, r1), _mm512_or_si512(r2, r3));
      if (_mm512_mask_test_epi32_mask(static_cast<__mmask16>(~live), any_code, any_code) != 0)
        seen->tiny = true;
    }
  }
}

// Steps [u0, u0 + unit) of column tile t (clipped to `steps`), as a call decodes them: the
// lanes that fold over the whole unit take its lowest code as base in each of its steps. The
// step at index i goes to out + i * 1024 and meta[i].
MXPLUS_AMX_INT8_TARGET inline void decode_unit(const WeightTiles& w, int64_t block, int64_t unit,
                                               int64_t steps, int64_t t, int64_t u0, int8_t* out,
                                               StepMeta* meta, WeightSeen* seen) {
  const int64_t bps = kStepK / block;
  __m128i ulo = _mm_setzero_si128(), uhi;
  __mmask16 ufold = 0;
  if (unit > 1 && t < w.nt) {  // past the weight: zero tiles (decode_step)
    scale_range(w, t, u0 * bps, (u0 + unit) * bps, &ulo, &uhi);
    ufold = fold_lanes(ulo, uhi);
  }
  for (int64_t s = u0; s < std::min(steps, u0 + unit); ++s)
    decode_step(w, block, t, s, ulo, ufold, out + (s - u0) * 1024, meta + (s - u0), seen);
}

// Whether the fold was exact for a thread's weights `seen` and the rows' exponents [alo, ahi]:
// no NaN block, no tiny block, every scale 2^(EA + EW - 256) in the window.
MXPLUS_AMX_INT8_TARGET inline bool fits(const WeightSeen& seen, int alo, int ahi) {
  alignas(16) uint8_t l[16], h[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(l), seen.lo);
  _mm_store_si128(reinterpret_cast<__m128i*>(h), seen.hi);
  int wlo = 255, whi = 0;
  for (int i = 0; i < 16; ++i) {
    wlo = std::min<int>(wlo, l[i]);
    whi = std::max<int>(whi, h[i]);
  }
  if (seen.tiny || whi == kE8m0Nan) return false;
  if (wlo > whi || alo > ahi) return true;  // no nonzero block on one side
  return alo + wlo >= kLowWindow && ahi + whi <= kHighWindow;
}

// EW << 23 of block b (of the step) for the per-block pass: lo of a folded column (its codes
// were shifted), the block's own code of another, kDummyExp for an all-zero block.
MXPLUS_AMX_INT8_TARGET inline __m512i block_ew_bits(const WeightTiles& w, int64_t t, int64_t b,
                                             const StepMeta& meta) {
  if (t >= w.nt || b >= w.nb) return _mm512_set1_epi32(kDummyExp << 23);
  const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.scales + (t * w.nb + b) * 16));
  const __mmask16 live = _mm_test_epi8_mask(e, e);
  const __m128i lo = _mm_load_si128(reinterpret_cast<const __m128i*>(meta.lo));
  const __m128i own = _mm_mask_blend_epi8(meta.fold_lanes, e, lo);
  const __m512i v = _mm512_mask_blend_epi32(live, _mm512_set1_epi32(kDummyExp),
                                            _mm512_cvtepu8_epi32(own));
  return _mm512_slli_epi32(v, 23);
}
#endif

}  // namespace int8_detail
}  // namespace mxplus_cpu
