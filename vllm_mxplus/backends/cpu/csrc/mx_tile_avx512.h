// The AVX-512 tile kernel of the integer GEMM (mx_gemm_cpu.cpp states what it computes).
#pragma once

#include "mx_tiles.h"

namespace mxplus_cpu {
namespace gemm_detail {

// ---- the AVX-512 kernel (VNNI vpdpbusd where present, vpmaddubsw + vpmaddwd otherwise) ----
#ifdef MXPLUS_AVX512
inline __m512i dot4(__m512i acc, __m512i w_u8, __m512i x_s8) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, w_u8, x_s8);
#else
  // u8 * s8 pair sums are at most 2 * 24 * 12 = 576: vpmaddubsw cannot saturate here.
  const __m512i p = _mm512_maddubs_epi16(w_u8, x_s8);
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
#endif
}

// The 16-entry table of unsigned weight bytes, as vpermb / vpshufb wants it.
inline __m512i weight_lut() {
  return _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24,
                                              12, 11, 10, 9, 8, 6, 4, 0));
}

inline __m512i nib_lo(__m512i p, __m512i lut) {
#ifdef __AVX512VBMI__
  return _mm512_permutexvar_epi8(p, lut);  // reads bits 0..5: the table repeats every 16
#else
  return _mm512_shuffle_epi8(lut, _mm512_and_si512(p, _mm512_set1_epi8(0x0F)));
#endif
}

inline __m512i nib_hi(__m512i p, __m512i lut) { return nib_lo(_mm512_srli_epi16(p, 4), lut); }

// 16 E8M0 codes (one per 32-bit lane) as fp32 exponents ew - 0 (NaN for code 255).
inline __m512 code_exponents(__m512i ewi) {
  return _mm512_mask_mov_ps(_mm512_cvtepi32_ps(ewi),
                            _mm512_cmpeq_epi32_mask(ewi, _mm512_set1_epi32(kE8m0Nan)),
                            _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

// The E8M0 exponents of one block of the tile's 16 rows (code_exponents).
inline __m512 weight_exponents(const uint8_t* p) {
  return code_exponents(
      _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Bytes ahead of the current group (block) of a weight tile that the register tiles ask the
// cache for: each tile's codes, and its scales, are one sequential stream, read once per call
// from memory for a model larger than the caches (a prefetch past the end of the weight is a
// hint only: no fault).
constexpr int64_t kTilePrefetchAhead = 16 * kGroupBytes;
constexpr int64_t kScalePrefetchAhead = 16 * kTileN;

// The offset from position `at` of a tile's stream (`len` bytes per tile) to the byte the
// walk reads `ahead` bytes on: past the tile's end that is in the tile `ntp` on, not the next
// one, since the register tiles walk the weight ntp tiles at a time side by side (the tile
// after this one is read now, by its neighbour). So the next tiles' first groups are in cache
// when they start, where otherwise each new tile pair began on cold lines.
inline int64_t stream_ahead(int64_t at, int64_t len, int64_t ahead, int ntp) {
  return ahead + (at + ahead >= len ? (ntp - 1) * len : 0);
}

// iacc[j][m] += group g (elements koff .. koff+15) of rows m against NTP weight tiles.
// The unsigned weight bytes of one group of NTP tiles (wv[j][q]: the 4 elements of every row
// lane that the activation's int32 q of the group meets), prefetching each tile's stream `pf`
// bytes on (stream_ahead).
template <int NTP>
inline void group_weights(const uint8_t* const* wg, __m512i lut, __m512i (*wv)[4], int64_t pf) {
  _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(wg[j] + pf), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wg[j] + pf + 64), _MM_HINT_T0);
    const __m512i p0 = _mm512_loadu_si512(wg[j]), p1 = _mm512_loadu_si512(wg[j] + 64);
    wv[j][0] = nib_lo(p0, lut);
    wv[j][1] = nib_hi(p0, lut);
    wv[j][2] = nib_lo(p1, lut);
    wv[j][3] = nib_hi(p1, lut);
  }
}

template <int MT, int NTP>
inline void group_dots(const uint8_t* const* wg, const int8_t* const* xr, int64_t koff,
                       __m512i lut, __m512i (*iacc)[MT], int64_t pf) {
  __m512i wv[NTP][4];
  group_weights<NTP>(wg, lut, wv, pf);
  _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
    const int32_t* x4 = reinterpret_cast<const int32_t*>(xr[m] + koff);
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q) {
      const __m512i xb = _mm512_set1_epi32(x4[q]);  // one broadcast serves NTP tiles
      _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j)
        iacc[j][m] = dot4(iacc[j][m], wv[j][q], xb);
    }
  }
}

// group_dots with the rows' codes side by side (TileRows::codes_t): xg points at row m0's
// 16 codes of the group, row m0 + m's at xg + 16 m.
template <int MT, int NTP>
inline void group_dots_t(const uint8_t* const* wg, const int8_t* xg, __m512i lut,
                         __m512i (*iacc)[MT], int64_t pf) {
  __m512i wv[NTP][4];
  group_weights<NTP>(wg, lut, wv, pf);
  const int32_t* x4 = reinterpret_cast<const int32_t*>(xg);
  _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q) {
      const __m512i xb = _mm512_set1_epi32(x4[m * 4 + q]);  // one broadcast serves NTP tiles
      _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j)
        iacc[j][m] = dot4(iacc[j][m], wv[j][q], xb);
    }
  }
}

// MX+ weight block maxima of one block for a tile's 16 rows (WeightTiles::bm): the indices as
// int16 in the low half of each 32-bit lane (high half 0), the 2 * values likewise.
inline void block_max16(const uint8_t* p, __m512i* sel, __m512i* w16) {
  *sel = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  *w16 = _mm512_and_si512(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + kTileN))),
      _mm512_set1_epi32(0xFFFF));
}

// The kernels' helpers are inlined always: what the compiler makes of each kernel must not
// depend on its inlining heuristics.
#define MXPLUS_FORCE_INLINE __attribute__((always_inline))

// The fast block term of both AVX-512 kernels. The integer block sums start at the bits of the
// fp32 1.5 * 2^23 (plus the offset correction): I in [-2^22, 2^22) leaves them the bits of
// 1.5 * 2^23 + I, so one exact subtraction gives I as fp32 (on a port other than vpdpbusd's,
// unlike vcvtdq2ps). Where every 2^(ea + ew - 256) is a normal fp32 and |I| * 2^(ea + ew - 256)
// < 2^128 (`fast_block_terms`), the power of two is built by one integer add of exponent bits
// and one FMA adds I times it: the product is exact, so the FMA rounds as the add alone and
// the term is the value vscalefps gives (the same bits as the general block term).
constexpr int32_t kMagicBits = 0x4B400000;  // 1.5 * 2^23
inline __m512 block_sum(__m512i iacc) {
  return _mm512_sub_ps(_mm512_castsi512_ps(iacc), _mm512_set1_ps(12582912.0f));
}

// The exponent bits (ea - 256 + 127) << 23 of an activation block exponent ea - 256
// (ActRows::ea), as unsigned (ea may be < -127): 2^(ea + ew - 256) from ew << 23 by one
// integer add. 0 where ea is NaN (such rows never take the fast block terms).
inline int32_t exp_bits(float ea) {
  return std::isnan(ea) ? 0
                        : static_cast<int32_t>(static_cast<uint32_t>(static_cast<int>(ea) + 127)
                                               << 23);
}

// The activation side of the register tiles' fast block terms, built once per call
// (`FastRows`): per block b the M rows' block sums' start (corr + kMagicBits) and exponent bits
// (exp_bits) side by side ([nb, M]), per 16-element group g the M rows' codes side by side
// ([groups, M, 16]), so a tile reads each from one pointer (with a pointer per row the row
// pointers outnumbered the registers and were reloaded per block); per row its exponent
// extremes.
struct TileRows {
  const int32_t* start_t = nullptr;
  const int32_t* ebits_t = nullptr;
  const int8_t* codes_t = nullptr;
  const RowExp* range = nullptr;  // [M]
  int64_t m = 0;
};

struct FastRows {
  std::vector<int32_t> start_t, ebits_t;
  std::vector<RowExp> range;
  std::vector<int8_t> codes_t;
  int64_t m;
  FastRows(const ActRows& a, int64_t M, int64_t groups)
      : start_t(M * a.nb), ebits_t(M * a.nb), range(M), codes_t(groups * M * kGroupK), m(M) {
    for (int64_t r = 0; r < M; ++r) {
      const float* ea = a.ea + r * a.nb;
      range[r] = row_exp_range(ea, a.nb);
      for (int64_t b = 0; b < a.nb; ++b) {
        start_t[b * M + r] = a.corr[r * a.nb + b] + kMagicBits;
        ebits_t[b * M + r] = exp_bits(ea[b]);
      }
      for (int64_t g = 0; g < groups; ++g)
        std::memcpy(&codes_t[(g * M + r) * kGroupK], a.codes + r * a.kp + g * kGroupK, kGroupK);
    }
  }
  TileRows rows() const {
    return {start_t.data(), ebits_t.data(), codes_t.data(), range.data(), m};
  }
};

// Whether every block term of rows m0 .. m0+mt against weight tiles whose E8M0 codes lie in
// [wlo, whi] (255: a NaN block) has a normal fp32 power of two 2^(ea + ew - 256) with
// |I| * 2^(ea + ew - 256) < 2^128 (|I| < 2^13): then I times it is exact and finite.
// terms_within: the same with ea + ew - 256 <= max_exp for the rows' extremes `range`.
constexpr int kFastMaxExp = 127 - 13;
inline bool terms_within(int wlo, int whi, const RowExp* range, int64_t m0, int64_t mt,
                         int max_exp) {
  if (whi == kE8m0Nan) return false;
  for (int64_t m = m0; m < m0 + mt; ++m) {
    const RowExp& r = range[m];
    if (!r.finite || r.lo + wlo < -126 || r.hi + whi > max_exp) return false;
  }
  return true;
}
inline bool fast_block_terms(int wlo, int whi, const TileRows& pr, int64_t m0, int64_t mt) {
  return terms_within(wlo, whi, pr.range, m0, mt, kFastMaxExp);
}

// Per row of a register tile (MT rows from m0), for the general block terms: its codes, its block
// sums' start (ActRows::corr) and its block exponents.
template <int MT>
struct RowPtrs {
  const int8_t* x[MT];
  const int32_t* c[MT];
  const float* e[MT];
};

template <int MT>
inline MXPLUS_FORCE_INLINE RowPtrs<MT> row_ptrs(const ActRows& a, int64_t m0) {
  RowPtrs<MT> r;
  for (int m = 0; m < MT; ++m) {
    r.x[m] = a.codes + (m0 + m) * a.kp;
    r.c[m] = a.corr + (m0 + m) * a.nb;
    r.e[m] = a.ea + (m0 + m) * a.nb;
  }
  return r;
}

// The frame of both AVX-512 kernels, tile_avx512 and panel_avx512 (one code path, so the
// panel kernel rounds as the register tile does): y[m0 .. m0+MT, the 16 rows of each tile
// t0 .. t0+NTP]. acc [NTP][MT] gets the current chunk's block terms, block(b, acc) adding
// block b's for the blocks of each macro chunk in K order; with MBS each chunk then enters
// the row sums ysum (in memory, updated once per chunk: keeping both in zmm registers spills)
// as ysum = fma(acc, t, ysum), t = fl(fl(1/Fa) * fl(1/Fw)) (the AMX tiles' chunk scaling, so a
// row's chunk enters y alike on every path; docs/cpu_kernels.md). Last the sums (+ bias)
// are stored, the rows of a tile past N left out. Always inlined (`block` too: the kernels
// mark their lambdas so) so acc stays in registers as a local array of the kernel would.
template <int MT, int NTP, bool MBS, class Block>
inline MXPLUS_FORCE_INLINE void tile_frame(const WeightTiles& w, const ActRows& a,
                                           const Shape& s, int64_t t0, int64_t m0, float* y,
                                           const float* bias, Block&& block) {
  alignas(64) float ysum[NTP][MT][kTileN];
  __m512 acc[NTP][MT];
  for (int j = 0; j < NTP; ++j)
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
      acc[j][m] = _mm512_setzero_ps();
      if (MBS) _mm512_store_ps(ysum[j][m], acc[j][m]);
    }
  for (int64_t c = 0; c < s.nc; ++c) {
    const int64_t b1 = std::min((c + 1) * s.bpc, w.nb);
    for (int64_t b = c * s.bpc; b < b1; ++b) block(b, acc);
    if (!MBS) continue;
    for (int j = 0; j < NTP; ++j) {
      __m512 rw = _mm512_set1_ps(1.0f);  // fl(1 / Fw)
      if (w.mbs) {
        const __m512i mw = _mm512_cvtepu8_epi32(_mm_loadu_si128(
            reinterpret_cast<const __m128i*>(w.mbs + ((t0 + j) * w.nm + c) * kTileN)));
        const __m512 fw =
            _mm512_div_ps(_mm512_add_ps(_mm512_cvtepi32_ps(mw), _mm512_set1_ps(kMbsDenom)),
                          _mm512_set1_ps(kMbsDenom));  // exact: a power-of-two divisor
        rw = _mm512_div_ps(_mm512_set1_ps(1.0f), fw);
      }
      _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
        const __m512 t =
            a.fa ? _mm512_mul_ps(_mm512_set1_ps(1.0f / a.fa[(m0 + m) * a.nm + c]), rw) : rw;
        _mm512_store_ps(ysum[j][m], _mm512_fmadd_ps(acc[j][m], t, _mm512_load_ps(ysum[j][m])));
        acc[j][m] = _mm512_setzero_ps();
      }
    }
  }
  for (int j = 0; j < NTP; ++j) {
    const int64_t n0 = (t0 + j) * kTileN;
    const int64_t valid = std::min<int64_t>(kTileN, w.n - n0);
    const __mmask16 lm = static_cast<__mmask16>((1u << valid) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(lm, bias + n0) : _mm512_setzero_ps();
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
      const __m512 v = MBS ? _mm512_load_ps(ysum[j][m]) : acc[j][m];
      _mm512_mask_storeu_ps(y + (m0 + m) * w.n + n0, lm, bias ? _mm512_add_ps(v, bv) : v);
    }
  }
}

// y[m0 .. m0+MT, the 16 rows of each tile t0 .. t0+NTP]. GPB = 16-element groups per block;
// BM: MX+ block maxima (GPB = 2): + x[index] * (2 * value), exact, per lane (vpermw picks
// x[index] from the block's 32 codes widened to int16; vpmaddwd multiplies it, the lane's
// other int16 product is x[0] * 0). FAST (not with BM; pr the rows' FastRows): every block
// term takes the fast form, which gives the same bits where `fast_block_terms` holds for these
// rows and tiles. Whether it holds is known only at the end: the tiles' smallest and largest
// E8M0 codes are gathered from the scale bytes the blocks load anyway (not by a pass of their
// own over them before the tiles: one burst of memory reads per tile pair that nothing
// overlapped, when the weight streams from memory). Returns false when it does not hold: then
// y's entries here are not the sums, and the caller runs the general block terms over them.
template <int MT, int NTP, int GPB, bool MBS, bool BM, bool FAST = false>
bool tile_avx512(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t0,
                 int64_t m0, float* y, const float* bias, const TileRows* pr = nullptr) {
  static_assert(!(FAST && BM), "the MX+ tile keeps the general block terms");
  const __m512i lut = weight_lut();
  // the general block terms' row pointers; FAST reads the tiles' layout instead (gemm_tiles
  // builds it): one pointer each for the rows' starts, ebits and codes
  const RowPtrs<MT> r = row_ptrs<MT>(a, m0);
  if constexpr (FAST) TORCH_CHECK(pr->codes_t != nullptr, "tile_avx512: no tiles' layout");
  // FAST: the smallest and largest E8M0 code byte of the tiles so far
  __m128i code_lo = _mm_set1_epi8(static_cast<char>(0xFF)), code_hi = _mm_setzero_si128();
  // Block b's terms: + I * 2^(ea + ew - 256) per row and tile.
  auto block = [&](int64_t b, __m512 (&acc)[NTP][MT]) MXPLUS_FORCE_INLINE {
    __m512 ew[NTP];
    __m512i ewb[NTP];
    __m512i iacc[NTP][MT];
    _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j) {
      const uint8_t* sc = w.scales + ((t0 + j) * w.nb + b) * kTileN;
      _mm_prefetch(reinterpret_cast<const char*>(
                       sc + stream_ahead(b * kTileN, w.nb * kTileN, kScalePrefetchAhead, NTP)),
                   _MM_HINT_T0);
      if constexpr (FAST) {
        const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
        code_lo = _mm_min_epu8(code_lo, codes);
        code_hi = _mm_max_epu8(code_hi, codes);
        ewb[j] = _mm512_slli_epi32(_mm512_cvtepu8_epi32(codes), 23);
      } else {
        ew[j] = weight_exponents(sc);
      }
      _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m)
        iacc[j][m] = _mm512_set1_epi32(FAST ? pr->start_t[b * pr->m + m0 + m] : r.c[m][b]);
    }
    _Pragma("GCC unroll 2") for (int gg = 0; gg < GPB; ++gg) {
      const int64_t g = b * GPB + gg;
      const uint8_t* wg[NTP];
      for (int j = 0; j < NTP; ++j) wg[j] = w.codes + ((t0 + j) * w.groups + g) * kGroupBytes;
      const int64_t pf =
          stream_ahead(g * kGroupBytes, w.groups * kGroupBytes, kTilePrefetchAhead, NTP);
      if constexpr (FAST)
        group_dots_t<MT, NTP>(wg, pr->codes_t + (g * pr->m + m0) * kGroupK, lut, iacc, pf);
      else
        group_dots<MT, NTP>(wg, r.x, g * kGroupK, lut, iacc, pf);
    }
    if constexpr (BM) {
      __m512i sel[NTP], w16[NTP];
      for (int j = 0; j < NTP; ++j)
        block_max16(w.bm + ((t0 + j) * w.nb + b) * 2 * kTileN, &sel[j], &w16[j]);
      for (int m = 0; m < MT; ++m) {
        const __m512i x16 = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.x[m] + b * 32)));
        for (int j = 0; j < NTP; ++j)
          iacc[j][m] = _mm512_add_epi32(
              iacc[j][m], _mm512_madd_epi16(_mm512_permutexvar_epi16(sel[j], x16), w16[j]));
      }
    }
    if constexpr (FAST) {
      _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
        const __m512i eab = _mm512_set1_epi32(pr->ebits_t[b * pr->m + m0 + m]);
        _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j) {  // the power of two from bits
          const __m512 p2 = _mm512_castsi512_ps(_mm512_add_epi32(ewb[j], eab));
          acc[j][m] = _mm512_fmadd_ps(block_sum(iacc[j][m]), p2, acc[j][m]);
        }
      }
    } else {
      _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
        const __m512 ea = _mm512_set1_ps(r.e[m][b]);
        _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j)  // + I * 2^(ea + ew - 256)
          acc[j][m] = _mm512_add_ps(acc[j][m], _mm512_scalef_ps(_mm512_cvtepi32_ps(iacc[j][m]),
                                                                _mm512_add_ps(ew[j], ea)));
      }
    }
  };
  tile_frame<MT, NTP, MBS>(w, a, s, t0, m0, y, bias, block);
  if constexpr (FAST) {
    alignas(16) uint8_t lo[16], hi[16];
    _mm_store_si128(reinterpret_cast<__m128i*>(lo), code_lo);
    _mm_store_si128(reinterpret_cast<__m128i*>(hi), code_hi);
    int wlo = 255, whi = 0;
    for (int i = 0; i < 16; ++i) {
      wlo = std::min<int>(wlo, lo[i]);
      whi = std::max<int>(whi, hi[i]);
    }
    return fast_block_terms(wlo, whi, *pr, m0, MT);
  }
  return true;
}
#endif


}  // namespace gemm_detail
}  // namespace mxplus_cpu
