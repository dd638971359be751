// The AVX2 tile kernel of the integer GEMM, for x86-64 CPUs without AVX-512 (mx_gemm_cpu.cpp
// states what it computes). Half a weight tile (8 rows, one ymm lane each) per call: AVX2 has
// 16 vector registers. Integer dot products with AVX-VNNI vpdpbusd where present, else
// vpmaddubsw (int16 sums over a block) + vpmaddwd. I * 2^e is an fp32 multiply by 2^e built
// from its bits (exact: the same value as vscalefps) when e is in the normal range for all 8
// lanes; otherwise (NaN scale codes, exponents outside it) the lanes take ldexpf, as the
// portable kernel does.
#pragma once

#include "mx_tiles.h"

#if defined(__AVX2__) && !defined(MXPLUS_AVX512)
#include <immintrin.h>
#define MXPLUS_AVX2 1

namespace mxplus_cpu {
namespace gemm_detail {

// A block's integer dot products per lane. With AVX-VNNI vpdpbusd adds 4 u8 * s8 products
// into the int32 lanes. Without it vpmaddubsw gives pair sums of u8 * s8 (at most
// 2 * 24 * 15 = 720: it cannot saturate here), added in int16 over the block (at most 8 per
// lane: |sum| <= 5760, exact) and widened once per block by vpmaddwd: 3 instructions per 32
// products instead of 4.
#ifdef __AVXVNNI__
inline __m256i dot_begin(int32_t corr) { return _mm256_set1_epi32(corr); }
inline __m256i dot4_avx2(__m256i acc, __m256i w_u8, __m256i x_s8) {
  return _mm256_dpbusd_avx_epi32(acc, w_u8, x_s8);
}
inline __m256i dot_end(__m256i acc, int32_t) { return acc; }
#else
inline __m256i dot_begin(int32_t) { return _mm256_setzero_si256(); }
inline __m256i dot4_avx2(__m256i acc, __m256i w_u8, __m256i x_s8) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w_u8, x_s8));
}
inline __m256i dot_end(__m256i acc, int32_t corr) {
  return _mm256_add_epi32(_mm256_madd_epi16(acc, _mm256_set1_epi16(1)), _mm256_set1_epi32(corr));
}
#endif

// The E8M0 codes ew of one block for 8 tile rows, with their smallest and largest code: a row
// whose exponents ea + ew all lie in fp32's normal range (checked once per row and block
// from the two, not per lane) takes the fast path of scaled_term.
struct BlockScales8 {
  __m256i ew;
  int lo, hi;
};

inline BlockScales8 block_scales8(const uint8_t* p) {
  const __m128i e8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i e16 = _mm_cvtepu8_epi16(e8);
  const int lo = _mm_cvtsi128_si32(_mm_minpos_epu16(e16)) & 0xFFFF;
  const int hi =
      0xFFFF - (_mm_cvtsi128_si32(_mm_minpos_epu16(_mm_xor_si128(e16, _mm_set1_epi16(-1)))) &
                0xFFFF);
  return {_mm256_cvtepu8_epi32(e8), lo, hi};
}

// acc += I * 2^(ew + ea - 256) for the 8 lanes; ew the lanes' E8M0 codes, ea the row's float
// exponent (ea - 256, NaN for code 255).
inline __m256 scaled_term(__m256 acc, __m256i iacc, const BlockScales8& bs, float ea) {
  if (!std::isnan(ea) && bs.hi != kE8m0Nan) {
    const int e = static_cast<int>(ea);
    if (e + bs.lo >= -126 && e + bs.hi <= 127) {  // every lane: 2^(ea + ew) is a normal fp32
      const __m256 p2 = _mm256_castsi256_ps(
          _mm256_slli_epi32(_mm256_add_epi32(bs.ew, _mm256_set1_epi32(e + 127)), 23));
      return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(iacc), p2));
    }
  }
  const __m256i ew = bs.ew;
  alignas(32) int32_t iv[8], ev[8];
  alignas(32) float av[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(iv), iacc);
  _mm256_store_si256(reinterpret_cast<__m256i*>(ev), ew);
  _mm256_store_ps(av, acc);
  for (int i = 0; i < 8; ++i) {
    const float e = (ev[i] == kE8m0Nan ? std::numeric_limits<float>::quiet_NaN()
                                       : static_cast<float>(ev[i])) + ea;
    av[i] += std::isnan(e) ? e : std::ldexp(static_cast<float>(iv[i]), static_cast<int>(e));
  }
  return _mm256_load_ps(av);
}

// MX+ weight block maxima of one block for 8 tile rows (WeightTiles::bm): byte-shuffle
// selectors that put x[index] into byte 1 of each 32-bit lane (x * 256 as its low int16),
// one for indices 0..15 and one for 16..31, and the 2 * values as int16 in the low halves.
struct BlockMax8 {
  __m256i sel_lo, sel_hi, w16;
};

inline BlockMax8 block_max8(const uint8_t* p) {
  const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i zero_bytes = _mm256_set1_epi32(static_cast<int>(0x80808080u));  // vpshufb: 0
  const __m256i sel = _mm256_or_si256(_mm256_slli_epi32(idx, 8),
                                      _mm256_set1_epi32(static_cast<int>(0x80800080u)));
  const __m256i hi = _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(15));
  const __m256i w = _mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kTileN)));
  return {_mm256_or_si256(sel, _mm256_and_si256(hi, zero_bytes)),
          _mm256_or_si256(sel, _mm256_andnot_si256(hi, zero_bytes)),
          _mm256_and_si256(w, _mm256_set1_epi32(0xFFFF))};
}

// iacc + x[index] * (2 * value) per lane, x the 32 activation codes of the block: exact
// ((x * 256) * w fits int32 and is a multiple of 256).
inline __m256i block_max_term(__m256i iacc, const BlockMax8& bm, const int8_t* x) {
  const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m256i xh =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16)));
  const __m256i g = _mm256_or_si256(_mm256_shuffle_epi8(xl, bm.sel_lo),
                                    _mm256_shuffle_epi8(xh, bm.sel_hi));
  return _mm256_add_epi32(iacc, _mm256_srai_epi32(_mm256_madd_epi16(g, bm.w16), 8));
}

// The four decoded operands (2 * value + 12, as u8) of one group for the 8 rows of a half
// tile: wg points at the group's bytes of that half (pack_weight's order).
inline void group_weights8(const uint8_t* wg, __m256i* wv) {
  const __m256i lut = _mm256_broadcastsi128_si256(
      _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
  const __m256i lo4 = _mm256_set1_epi8(0x0F);
  const __m256i p0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg));
  const __m256i p1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 64));
  wv[0] = _mm256_shuffle_epi8(lut, _mm256_and_si256(p0, lo4));
  wv[1] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(p0, 4), lo4));
  wv[2] = _mm256_shuffle_epi8(lut, _mm256_and_si256(p1, lo4));
  wv[3] = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(p1, 4), lo4));
}

// iacc[m] += the products of one 16-element group: 8 tile rows (wg: the half tile's bytes of
// the group, pack_weight's order) times MT activation rows (x[m]: their 16 codes).
template <int MT>
inline void group_dots8(const uint8_t* wg, const int8_t* const* x, __m256i* iacc) {
  __m256i wv[4];
  group_weights8(wg, wv);
  for (int m = 0; m < MT; ++m) {
    const int32_t* x4 = reinterpret_cast<const int32_t*>(x[m]);
    for (int q = 0; q < 4; ++q) iacc[m] = dot4_avx2(iacc[m], wv[q], _mm256_set1_epi32(x4[q]));
  }
}

// y[m0 .. m0+MT, rows 8h .. 8h+7 of tile t]. GPB = 16-element groups per block; BM: MX+
// block maxima (GPB = 2).
template <int MT, int GPB, bool MBS, bool BM>
void tile_avx2(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t, int h,
               int64_t m0, float* y, const float* bias) {
  alignas(32) float ysum[MT][8];
  __m256 acc[MT];
  for (int m = 0; m < MT; ++m) {
    acc[m] = _mm256_setzero_ps();
    _mm256_store_ps(ysum[m], acc[m]);
  }
  for (int64_t c = 0; c < s.nc; ++c) {
    const int64_t b1 = std::min((c + 1) * s.bpc, w.nb);
    for (int64_t b = c * s.bpc; b < b1; ++b) {
      const BlockScales8 bs = block_scales8(w.scales + (t * w.nb + b) * kTileN + 8 * h);
      __m256i iacc[MT];
      for (int m = 0; m < MT; ++m) iacc[m] = dot_begin(a.corr[(m0 + m) * a.nb + b]);
      for (int gg = 0; gg < GPB; ++gg) {
        const int64_t g = b * GPB + gg;
        const int8_t* xg[MT];
        for (int m = 0; m < MT; ++m) xg[m] = a.codes + (m0 + m) * a.kp + g * kGroupK;
        group_dots8<MT>(w.codes + (t * w.groups + g) * kGroupBytes + 32 * h, xg, iacc);
      }
      for (int m = 0; m < MT; ++m) iacc[m] = dot_end(iacc[m], a.corr[(m0 + m) * a.nb + b]);
      if constexpr (BM) {
        const BlockMax8 bm = block_max8(w.bm + (t * w.nb + b) * 2 * kTileN + 8 * h);
        for (int m = 0; m < MT; ++m)
          iacc[m] = block_max_term(iacc[m], bm, a.codes + (m0 + m) * a.kp + b * 32);
      }
      for (int m = 0; m < MT; ++m) acc[m] = scaled_term(acc[m], iacc[m], bs, a.ea[(m0 + m) * a.nb + b]);
    }
    if (MBS) {  // ysum = fma(acc, t, ysum), t = fl(fl(1/Fa) * fl(1/Fw)) (mx_tile_avx512.h)
      __m256 rw = _mm256_set1_ps(1.0f);
      if (w.mbs) {
        const __m256i mw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(
            w.mbs + (t * w.nm + c) * kTileN + 8 * h)));
        const __m256 fw =
            _mm256_div_ps(_mm256_add_ps(_mm256_cvtepi32_ps(mw), _mm256_set1_ps(kMbsDenom)),
                          _mm256_set1_ps(kMbsDenom));  // exact: a power-of-two divisor
        rw = _mm256_div_ps(_mm256_set1_ps(1.0f), fw);
      }
      for (int m = 0; m < MT; ++m) {
        const __m256 tm =
            a.fa ? _mm256_mul_ps(_mm256_set1_ps(1.0f / a.fa[(m0 + m) * a.nm + c]), rw) : rw;
        _mm256_store_ps(ysum[m], _mm256_fmadd_ps(acc[m], tm, _mm256_load_ps(ysum[m])));
        acc[m] = _mm256_setzero_ps();
      }
    }
  }
  const int64_t n0 = t * kTileN + 8 * h;
  for (int m = 0; m < MT; ++m) {
    alignas(32) float v[8];
    _mm256_store_ps(v, MBS ? _mm256_load_ps(ysum[m]) : acc[m]);
    for (int64_t i = 0; i < 8 && n0 + i < w.n; ++i)
      y[(m0 + m) * w.n + n0 + i] = bias ? v[i] + bias[n0 + i] : v[i];
  }
}

// One activation row against a whole weight tile (16 rows, two ymm lanes of 8): the decode
// case, where the per-block work (dot_end, the scale terms) is not shared by several
// activation rows. Each group's four activation broadcasts serve both halves, and the
// exponent range is checked once per tile (tile_exp_fast; the row's extremes once per pass,
// row_exp_range) instead of per block; when the check fails the blocks take scaled_term, as
// tile_avx2 does. Same operations in the same
// order per output as tile_avx2<1, ...>, so the same results bit for bit.

// True when 2^(ea + ew) is a normal fp32 for every block of this row and tile: the row's
// exponent extremes and the tile's E8M0 codes (all 16 rows, nb blocks) checked from theirs.
inline bool tile_exp_fast(const uint8_t* sc, int64_t nb, const RowExp& re) {
  __m256i lo = _mm256_set1_epi8(static_cast<char>(0xFF)), hi = _mm256_setzero_si256();
  const int64_t bytes = nb * kTileN;
  int64_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + i));
    lo = _mm256_min_epu8(lo, v);
    hi = _mm256_max_epu8(hi, v);
  }
  alignas(32) uint8_t l[32], h[32];
  _mm256_store_si256(reinterpret_cast<__m256i*>(l), lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(h), hi);
  int wlo = 255, whi = 0;
  for (int j = 0; j < 32; ++j) {
    wlo = std::min<int>(wlo, l[j]);
    whi = std::max<int>(whi, h[j]);
  }
  for (; i < bytes; ++i) {
    wlo = std::min<int>(wlo, sc[i]);
    whi = std::max<int>(whi, sc[i]);
  }
  if (!re.finite || whi == kE8m0Nan) return false;
  return re.lo + wlo >= -126 && re.hi + whi <= 127;
}

// Bytes ahead of the current group that the decode tile asks the cache for: the weight
// stream is read once per call, from memory for a model larger than the caches (a prefetch
// past the end of the weight is a hint only: it cannot fault).
constexpr int64_t kPrefetchAhead = 16 * kGroupBytes;

template <int GPB, bool MBS>
void tile16_avx2(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t, int64_t m,
                 const RowExp& re, float* y, const float* bias) {
  const uint8_t* sc = w.scales + t * w.nb * kTileN;
  const int8_t* xrow = a.codes + m * a.kp;
  const int32_t* corr = a.corr + m * a.nb;
  const float* ea = a.ea + m * a.nb;
  const bool fast = tile_exp_fast(sc, w.nb, re);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 ysum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t c = 0; c < s.nc; ++c) {
    const int64_t b1 = std::min((c + 1) * s.bpc, w.nb);
    for (int64_t b = c * s.bpc; b < b1; ++b) {
      __m256i iacc[2] = {dot_begin(corr[b]), dot_begin(corr[b])};
      for (int gg = 0; gg < GPB; ++gg) {
        const int64_t g = b * GPB + gg;
        const int32_t* x4 = reinterpret_cast<const int32_t*>(xrow + g * kGroupK);
        const uint8_t* wg = w.codes + (t * w.groups + g) * kGroupBytes;
        _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(wg + kPrefetchAhead + 64), _MM_HINT_T0);
        const __m256i xb[4] = {_mm256_set1_epi32(x4[0]), _mm256_set1_epi32(x4[1]),
                               _mm256_set1_epi32(x4[2]), _mm256_set1_epi32(x4[3])};
        for (int h = 0; h < 2; ++h) {
          __m256i wv[4];
          group_weights8(wg + 32 * h, wv);
          for (int q = 0; q < 4; ++q) iacc[h] = dot4_avx2(iacc[h], wv[q], xb[q]);
        }
      }
      for (int h = 0; h < 2; ++h) iacc[h] = dot_end(iacc[h], corr[b]);
      if (fast) {
        const __m128i e16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * kTileN));
        const __m256i e = _mm256_set1_epi32(static_cast<int>(ea[b]) + 127);
        const __m256i ew[2] = {_mm256_cvtepu8_epi32(e16),
                               _mm256_cvtepu8_epi32(_mm_srli_si128(e16, 8))};
        for (int h = 0; h < 2; ++h) {
          const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(ew[h], e), 23));
          acc[h] = _mm256_add_ps(acc[h], _mm256_mul_ps(_mm256_cvtepi32_ps(iacc[h]), p2));
        }
      } else {
        for (int h = 0; h < 2; ++h)
          acc[h] = scaled_term(acc[h], iacc[h], block_scales8(sc + b * kTileN + 8 * h), ea[b]);
      }
    }
    if (MBS) {
      for (int h = 0; h < 2; ++h) {
        __m256 tm = _mm256_set1_ps(1.0f);  // t = fl(fl(1/Fa) * fl(1/Fw)), as above
        if (w.mbs) {
          const __m256i mw = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
              reinterpret_cast<const __m128i*>(w.mbs + (t * w.nm + c) * kTileN + 8 * h)));
          tm = _mm256_div_ps(_mm256_set1_ps(1.0f),
                             _mm256_div_ps(_mm256_add_ps(_mm256_cvtepi32_ps(mw),
                                                         _mm256_set1_ps(kMbsDenom)),
                                           _mm256_set1_ps(kMbsDenom)));  // exact: 2^8 divisor
        }
        if (a.fa) tm = _mm256_mul_ps(_mm256_set1_ps(1.0f / a.fa[m * a.nm + c]), tm);
        ysum[h] = _mm256_fmadd_ps(acc[h], tm, ysum[h]);
        acc[h] = _mm256_setzero_ps();
      }
    }
  }
  const int64_t n0 = t * kTileN;
  alignas(32) float v[kTileN];
  _mm256_store_ps(v, MBS ? ysum[0] : acc[0]);
  _mm256_store_ps(v + 8, MBS ? ysum[1] : acc[1]);
  for (int64_t i = 0; i < kTileN && n0 + i < w.n; ++i)
    y[m * w.n + n0 + i] = bias ? v[i] + bias[n0 + i] : v[i];
}

}  // namespace gemm_detail
}  // namespace mxplus_cpu
#endif
