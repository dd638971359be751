// The AVX-512 kernel of the integer GEMM for several activation rows (prefill, batched
// decode): mx_gemm_cpu.cpp states what it computes, docs/cpu_kernels.md how it is blocked.
//
// A pass takes a chunk of activation rows (their codes about half of L2) and walks the
// thread's weight tiles kPanelTiles at a time. Each tile is decoded once per pass into a
// panel: the four unsigned vpdpbusd operands of every group (2 * value + 12 per byte, what
// tile_avx512 decodes in registers per group and row tile) and each block's E8M0 codes as
// fp32 exponent bits (ew << 23). The rows of the chunk then run against the panels
// kPanelRows at a time, each vpdpbusd taking its 4 activation codes as a broadcast: no
// weight decoding and no exponent arithmetic in the inner loop.
//
// Block terms: when every 2^(ea + ew - 256) of a row tile against a weight tile is a normal
// fp32 (checked once per row tile and panel from the rows' and the tile's exponent
// extremes), the block term is I * 2^(ea + ew - 256) with the power of two built by one
// integer add of exponent bits: the same value as vscalefps (both exact). Otherwise the
// blocks take vscalefps as tile_avx512 does. Per output the same operations in the same
// order as tile_avx512 (both kernels run in tile_frame, mx_tile_avx512.h, which adds the
// block terms per chunk, divides by the MBS factors and stores): the same results bit for bit.
#pragma once

#include "mx_tile_avx512.h"

namespace mxplus_cpu {
namespace gemm_detail {

#ifdef MXPLUS_AVX512
constexpr int kPanelTiles = 2;                       // weight tiles per register tile
constexpr int kPanelRows = 4;                        // activation rows per register tile
constexpr int64_t kPanelMinRows = 32;                // M from which the panel kernel runs
// Activation codes per pass. Each pass decodes every weight tile of its thread again, from
// memory where the weight outgrows the caches: fewer, longer passes (their rows read from L3
// rather than L2) measured faster than passes of 2^19 bytes (docs/cpu_kernels.md, "Panel
// passes"; the same within the spread for weights that stay in the caches).
constexpr int64_t kPanelActBytes = int64_t{1} << 21;
constexpr int64_t kPanelGroupBytes = 4 * 64;         // decoded operands of one group

// One weight tile decoded for a pass (see the top of this file).
struct Panel {
  const uint8_t* ops;    // [groups][4][64] unsigned operands, in vpdpbusd order
  const int32_t* ebits;  // [nb][16] E8M0 code << 23 per tile row
  int lo, hi;            // smallest / largest E8M0 code in the tile (255: a NaN block)
};

// The packed codes of the panels a pass decodes next, asked into L2 while the rows run against
// the current ones, two cache lines per 16-element group a row tile runs (so the first 8 rows
// cover both next tiles): without it each decode waited for its codes from memory.
struct PanelPrefetch {
  const uint8_t* next;
  const uint8_t* end;
};

inline Panel decode_panel(const WeightTiles& w, int64_t t, uint8_t* ops, int32_t* ebits) {
  const __m512i lut = weight_lut();
  const uint8_t* src = w.codes + t * w.groups * kGroupBytes;
  for (int64_t g = 0; g < w.groups; ++g) {
    const __m512i p0 = _mm512_loadu_si512(src + g * kGroupBytes);
    const __m512i p1 = _mm512_loadu_si512(src + g * kGroupBytes + 64);
    uint8_t* o = ops + g * kPanelGroupBytes;
    _mm512_store_si512(o, nib_lo(p0, lut));
    _mm512_store_si512(o + 64, nib_hi(p0, lut));
    _mm512_store_si512(o + 128, nib_lo(p1, lut));
    _mm512_store_si512(o + 192, nib_hi(p1, lut));
  }
  const uint8_t* sc = w.scales + t * w.nb * kTileN;
  __m512i lo = _mm512_set1_epi32(kE8m0Nan), hi = _mm512_setzero_si512();
  for (int64_t b = 0; b < w.nb; ++b) {
    const __m512i e =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * kTileN)));
    lo = _mm512_min_epu32(lo, e);
    hi = _mm512_max_epu32(hi, e);
    _mm512_store_si512(ebits + b * kTileN, _mm512_slli_epi32(e, 23));
  }
  return {ops, ebits, static_cast<int>(_mm512_reduce_min_epu32(lo)),
          static_cast<int>(_mm512_reduce_max_epu32(hi))};
}

// y[m0 .. m0+MT, the 16 rows of each tile t0 .. t0+NTP] from the panels pn[0 .. NTP).
// GPB = 16-element groups per block; FAST: every block term's power of two is a normal fp32.
template <int MT, int NTP, int GPB, bool MBS, bool FAST>
void panel_avx512(const Panel* pn, const WeightTiles& w, const ActRows& a, const PanelRows& pr,
                  const Shape& s, int64_t t0, int64_t m0, float* y, const float* bias,
                  PanelPrefetch* pf) {
  const RowPtrs<MT> r = row_ptrs<MT>(a, pr.start, m0);
  const int32_t* eb[MT];
  for (int m = 0; m < MT; ++m) eb[m] = pr.ebits + (m0 + m) * a.nb;
  // Block b's terms, from the panels (the register tile's rounding: see the top of the file).
  auto block = [&](int64_t b, __m512 (&acc)[NTP][MT]) MXPLUS_FORCE_INLINE {
    for (int l = 0; l < 2 * GPB && pf->next < pf->end; ++l, pf->next += 64)
      _mm_prefetch(reinterpret_cast<const char*>(pf->next), _MM_HINT_T1);
    __m512i iacc[NTP][MT];
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
      const __m512i c0 = _mm512_set1_epi32(r.c[m][b]);
      _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j) iacc[j][m] = c0;
    }
    _Pragma("GCC unroll 2") for (int gg = 0; gg < GPB; ++gg) {
      const int64_t g = b * GPB + gg;
      _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q) {
        __m512i wv[NTP];
        _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j)
          wv[j] = _mm512_load_si512(pn[j].ops + g * kPanelGroupBytes + 64 * q);
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
          const __m512i xb =
              _mm512_set1_epi32(reinterpret_cast<const int32_t*>(r.x[m] + g * kGroupK)[q]);
          _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j)
            iacc[j][m] = dot4(iacc[j][m], wv[j], xb);
        }
      }
    }
    _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j) {
      if constexpr (FAST) {  // + I * 2^(ea + ew - 256), the power of two from its bits
        const __m512i ewb = _mm512_load_si512(pn[j].ebits + b * kTileN);
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
          const __m512 p2 = _mm512_castsi512_ps(_mm512_add_epi32(ewb, _mm512_set1_epi32(eb[m][b])));
          acc[j][m] = _mm512_fmadd_ps(block_sum(iacc[j][m]), p2, acc[j][m]);
        }
      } else {
        const __m512 ew = weight_exponents(w.scales + ((t0 + j) * w.nb + b) * kTileN);
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m)
          acc[j][m] = _mm512_add_ps(
              acc[j][m], _mm512_scalef_ps(block_sum(iacc[j][m]),
                                          _mm512_add_ps(ew, _mm512_set1_ps(r.e[m][b]))));
      }
    }
  };
  tile_frame<MT, NTP, MBS>(w, a, s, t0, m0, y, bias, block);
}

// fast_block_terms (mx_tile_avx512.h) for rows m0 .. m0+mt against ntp panels.
inline bool panel_fast(const Panel* pn, int ntp, const PanelRows& pr, int64_t m0, int64_t mt) {
  int wlo = kE8m0Nan, whi = 0;
  for (int j = 0; j < ntp; ++j) {
    wlo = std::min(wlo, pn[j].lo);
    whi = std::max(whi, pn[j].hi);
  }
  return fast_block_terms(wlo, whi, pr, m0, mt);
}

// rows m0 .. m0+mt (mt <= MT) against NTP panels.
template <int MT, int NTP, bool MBS>
void panel_rows(const Panel* pn, const WeightTiles& w, const ActRows& a, const PanelRows& pr,
                const Shape& s, int64_t t0, int64_t m0, int64_t mt, float* y, const float* bias,
                PanelPrefetch* pf) {
  if constexpr (MT > 1) {
    if (mt < MT) return panel_rows<MT - 1, NTP, MBS>(pn, w, a, pr, s, t0, m0, mt, y, bias, pf);
  }
  const bool fast = panel_fast(pn, NTP, pr, m0, MT);
  if (s.gpb == 1) {
    if (fast) panel_avx512<MT, NTP, 1, MBS, true>(pn, w, a, pr, s, t0, m0, y, bias, pf);
    else panel_avx512<MT, NTP, 1, MBS, false>(pn, w, a, pr, s, t0, m0, y, bias, pf);
  } else {
    if (fast) panel_avx512<MT, NTP, 2, MBS, true>(pn, w, a, pr, s, t0, m0, y, bias, pf);
    else panel_avx512<MT, NTP, 2, MBS, false>(pn, w, a, pr, s, t0, m0, y, bias, pf);
  }
}
#endif

}  // namespace gemm_detail
}  // namespace mxplus_cpu
