// The AVX-512 kernel of the integer GEMM for several activation rows (prefill, batched
// decode): mx_gemm_cpu.cpp states what it computes, docs/cpu_kernels.md how it is blocked.
//
// A pass takes a chunk of activation rows (their codes about half of L2) and walks the
// thread's weight tiles kPanelTiles at a time. Each tile is decoded once per pass into a
// panel: the four unsigned vpdpbusd operands of every group and each block's E8M0 base code
// as fp32 exponent bits (base << 23). The rows of the chunk then run against the panels
// kPanelRows at a time, each vpdpbusd taking its 4 activation codes as a broadcast: no
// weight decoding and no exponent arithmetic in the inner loop.
//
// Folded chunks. Within one MBS chunk a weight row whose block codes span at most
// kFoldMaxShift (max - min) is decoded as 2 * value * 2^(code - min) (|.| <= 96, an int8),
// its blocks all on the base code min; an activation row likewise (FoldRows), zero blocks on
// any base. A block sum I' of folded codes times 2^(base_a + base_w - 256) is the exact value
// I * 2^(ea + ew - 256) of the block term (both exact: the same fp32 number). Where both sides
// fold over a whole chunk every partial sum of its block terms is an integer multiple of
// 2^(EA + EW - 256) below 2^22 times it, so the fp32 sum of the terms in K order is exact and
// equals J * 2^(EA + EW - 256), J the chunk's integer sum: the kernel then sums the chunk in
// int32 and adds one term (FOLD), the same bits as the block terms. The weight bytes carry
// kFoldOffset (2 * value * 2^s + 96 in [0, 192]) folded or not; the rows' block sums start at
// -96 * (their folded codes' sum) to undo it.
//
// Block terms: when every 2^(ea + ew - 256) of a row tile against a weight tile is a normal
// fp32 (checked once per row tile and panel from the rows' and the tile's exponent
// extremes), the block term is I * 2^(ea + ew - 256) with the power of two built by one
// integer add of exponent bits: the same value as vscalefps (both exact). Otherwise the
// blocks take vscalefps as tile_avx512 does. Per output the same rounded operations in the
// same order as tile_avx512 (both kernels run in tile_frame, mx_tile_avx512.h, which adds the
// block terms per chunk, divides by the MBS factors and stores): the same results bit for bit.
#pragma once

#include <memory>

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
// Folded chunks (top of the file): codes times 2^s, s <= 3, stay within an int8 (12 * 8 =
// 96); the panels' unsigned bytes are 2 * value * 2^s + kFoldOffset; a chunk of at most
// kFoldMaxK elements keeps |J| <= 256 * 96 * 96 < 2^22, block_sum's range.
constexpr int kFoldMaxShift = 3;
constexpr int kFoldOffset = 96;
constexpr int64_t kFoldMaxK = 256;
// Largest ea + ew - 256 (the rows' and tiles' top codes) for which a folded chunk's terms and
// their partial sums, below 2^22 times 2^(EA + EW - 256), stay finite in fp32.
constexpr int kFoldMaxExp = 127 - 23;

// One weight tile decoded for a pass (see the top of this file).
struct Panel {
  const uint8_t* ops;     // [groups][4][64] unsigned operands, in vpdpbusd order
  const int32_t* ebits;   // [nb][16] base E8M0 code << 23 per tile row
  const uint8_t* folded;  // [nc] 1 where all 16 tile rows fold over the chunk
  int lo, hi;             // smallest / largest E8M0 code in the tile (255: a NaN block)
};

// The packed codes of the panels a pass decodes next, asked into L2 while the rows run against
// the current ones, two cache lines per 16-element group a row tile runs (so the first 8 rows
// cover both next tiles): without it each decode waited for its codes from memory.
struct PanelPrefetch {
  const uint8_t* next;
  const uint8_t* end;
};

// Whether a chunk of this shape can fold: with MBS (each chunk's sum starts from 0; without
// it the row is one running sum) and at most kFoldMaxK elements.
inline bool chunks_fold(const Shape& s) {
  return s.mbs && s.bpc * s.gpb * kGroupK <= kFoldMaxK;
}

// The unsigned operand bytes of a 64-byte half-group: u = 2 * value + 12 per byte (nib_lo /
// nib_hi) becomes u * 2^s + (96 - 12 * 2^s) = 2 * value * 2^s + 96; u * 2^s <= 192, so the
// 16-bit shift carries nothing into the next byte. sh: s per 16-bit lane, add: the byte added.
inline __m512i fold_bytes(__m512i u, __m512i sh, __m512i add) {
  return _mm512_add_epi8(_mm512_sllv_epi16(u, sh), add);
}

inline Panel decode_panel(const WeightTiles& w, const Shape& s, int64_t t, uint8_t* ops,
                          int32_t* ebits, uint8_t* folded) {
  const __m512i lut = weight_lut();
  const uint8_t* src = w.codes + t * w.groups * kGroupBytes;
  const uint8_t* sc = w.scales + t * w.nb * kTileN;
  const bool can_fold = chunks_fold(s);
  __m512i lo = _mm512_set1_epi32(kE8m0Nan), hi = _mm512_setzero_si512();
  for (int64_t c = 0; c < s.nc; ++c) {
    const int64_t b0 = c * s.bpc, b1 = std::min(b0 + s.bpc, w.nb);
    __m128i cmin = _mm_set1_epi8(static_cast<char>(0xFF)), cmax = _mm_setzero_si128();
    for (int64_t b = b0; b < b1; ++b) {
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * kTileN));
      cmin = _mm_min_epu8(cmin, e);
      cmax = _mm_max_epu8(cmax, e);
    }
    // every row spans <= kFoldMaxShift codes and none is a NaN block
    const bool fold = can_fold &&
        _mm_movemask_epi8(_mm_cmpgt_epi8(_mm_subs_epu8(cmax, cmin),
                                         _mm_set1_epi8(kFoldMaxShift))) == 0 &&
        _mm_movemask_epi8(_mm_cmpeq_epi8(cmax, _mm_set1_epi8(static_cast<char>(kE8m0Nan)))) == 0;
    folded[c] = fold;
    const __m512i base = _mm512_cvtepu8_epi32(cmin);
    for (int64_t b = b0; b < b1; ++b) {
      const __m512i e =
          _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * kTileN)));
      lo = _mm512_min_epu32(lo, e);
      hi = _mm512_max_epu32(hi, e);
      const __m512i sh32 = fold ? _mm512_sub_epi32(e, base) : _mm512_setzero_si512();
      _mm512_store_si512(ebits + b * kTileN, _mm512_slli_epi32(fold ? base : e, 23));
      // per 32-bit lane (one tile row): s in both 16-bit halves, 96 - 12 * 2^s in all 4 bytes
      const __m512i sh = _mm512_or_si512(sh32, _mm512_slli_epi32(sh32, 16));
      const __m512i add = _mm512_mullo_epi32(
          _mm512_sub_epi32(_mm512_set1_epi32(kFoldOffset),
                           _mm512_sllv_epi32(_mm512_set1_epi32(kOffset), sh32)),
          _mm512_set1_epi32(0x01010101));
      for (int64_t gg = 0; gg < s.gpb; ++gg) {
        const int64_t g = b * s.gpb + gg;
        const __m512i p0 = _mm512_loadu_si512(src + g * kGroupBytes);
        const __m512i p1 = _mm512_loadu_si512(src + g * kGroupBytes + 64);
        uint8_t* o = ops + g * kPanelGroupBytes;
        _mm512_store_si512(o, fold_bytes(nib_lo(p0, lut), sh, add));
        _mm512_store_si512(o + 64, fold_bytes(nib_hi(p0, lut), sh, add));
        _mm512_store_si512(o + 128, fold_bytes(nib_lo(p1, lut), sh, add));
        _mm512_store_si512(o + 192, fold_bytes(nib_hi(p1, lut), sh, add));
      }
    }
  }
  return {ops, ebits, folded, static_cast<int>(_mm512_reduce_min_epu32(lo)),
          static_cast<int>(_mm512_reduce_max_epu32(hi))};
}

// The activation rows as the panels take them (top of the file), built once per call: per
// row the codes folded per chunk where they fold, per block the base exponent (ea - 256 as
// fp32, NaN for a NaN block; as exponent bits (base - 256 + 127) << 23, 0 for NaN) and the
// block sum's start kMagicBits - 96 * (folded code sum), per chunk whether it folds and the
// chunk sum's start; the rows' exponent extremes as FastRows has them (the original codes').
struct FoldRows {
  std::unique_ptr<int8_t[]> codes;  // [M, kp], every byte written (no zeroing pass)
  std::vector<float> ebase;       // [M, nb]
  std::vector<int32_t> ebits;     // [M, nb]
  std::vector<int32_t> start;     // [M, nb]
  std::vector<int32_t> cstart;    // [M, nc]
  std::vector<uint8_t> fold;      // [M, nc]
  std::vector<RowExp> range;      // [M]
  int64_t kp, nb, nc;

  FoldRows(const ActRows& a, const Shape& s, int64_t M)
      : codes(new int8_t[M * a.kp]), ebase(M * a.nb), ebits(M * a.nb), start(M * a.nb), cstart(M * s.nc),
        fold(M * s.nc), range(M), kp(a.kp), nb(a.nb), nc(s.nc) {
    const bool can_fold = chunks_fold(s);
    const int64_t pieces = s.gpb;  // 16-byte pieces of codes per block
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      std::vector<uint8_t> nonzero(a.nb);
      for (int64_t r = r0; r < r1; ++r) {
        const float* ea = a.ea + r * a.nb;
        const int32_t* corr = a.corr + r * a.nb;  // -12 * (the block's code sum)
        const __m128i* x = reinterpret_cast<const __m128i*>(a.codes + r * a.kp);
        __m128i* xf = reinterpret_cast<__m128i*>(codes.get() + r * a.kp);
        range[r] = row_exp_range(ea, a.nb);
        for (int64_t b = 0; b < a.nb; ++b) {
          __m128i v = _mm_loadu_si128(x + b * pieces);
          for (int64_t p = 1; p < pieces; ++p) v = _mm_or_si128(v, _mm_loadu_si128(x + b * pieces + p));
          nonzero[b] = !_mm_test_all_zeros(v, v);
        }
        for (int64_t c = 0; c < s.nc; ++c) {
          const int64_t b0 = c * s.bpc, b1 = std::min(b0 + s.bpc, a.nb);
          // the base: the smallest exponent of a nonzero block (the first block's if none)
          bool ok = can_fold, any = false;
          float elo = ea[b0], ehi = ea[b0];
          for (int64_t b = b0; b < b1 && ok; ++b) {
            if (std::isnan(ea[b])) {
              ok = false;
            } else if (nonzero[b]) {
              elo = any ? std::min(elo, ea[b]) : ea[b];
              ehi = any ? std::max(ehi, ea[b]) : ea[b];
              any = true;
            }
          }
          ok = ok && ehi - elo <= kFoldMaxShift;
          fold[r * s.nc + c] = ok;
          int32_t csum = kMagicBits;
          for (int64_t b = b0; b < b1; ++b) {
            const int sh = ok && nonzero[b] ? static_cast<int>(ea[b] - elo) : 0;
            // codes * 2^sh (|.| <= 96): 16-bit shifts, the bits a byte pushes into the next
            // cleared (each byte's low sh bits are zero after its own shift)
            const __m128i cnt = _mm_cvtsi32_si128(sh);
            const __m128i keep = _mm_set1_epi8(static_cast<char>((0xFF << sh) & 0xFF));
            for (int64_t p = 0; p < pieces; ++p)
              _mm_storeu_si128(xf + b * pieces + p,
                               _mm_and_si128(_mm_sll_epi16(_mm_loadu_si128(x + b * pieces + p), cnt), keep));
            const float eb = ok ? elo : ea[b];
            ebase[r * a.nb + b] = eb;
            ebits[r * a.nb + b] = exp_bits(eb);
            // kMagicBits - 96 * (folded code sum) = kMagicBits + 8 * corr * 2^sh
            const int32_t term = (kFoldOffset / kOffset) * corr[b] * (1 << sh);
            start[r * a.nb + b] = kMagicBits + term;
            csum += term;
          }
          cstart[r * s.nc + c] = csum;
        }
      }
    });
  }
};

// y[m0 .. m0+MT, the 16 rows of each tile t0 .. t0+NTP] from the panels pn[0 .. NTP).
// GPB = 16-element groups per block; FAST: every block term's power of two is a normal fp32;
// FOLD (with FAST and MBS): chunks that fold for all MT rows and NTP tiles are summed in int32
// and enter as one term (the same bits: top of the file).
template <int MT, int NTP, int GPB, bool MBS, bool FAST, bool FOLD>
void panel_avx512(const Panel* pn, const WeightTiles& w, const ActRows& a, const FoldRows& fr,
                  const Shape& s, int64_t t0, int64_t m0, float* y, const float* bias,
                  PanelPrefetch* pf) {
  static_assert(!FOLD || (FAST && MBS), "folded chunks take the fast terms, with MBS");
  const int8_t* xr[MT];
  const int32_t* st[MT];
  const int32_t* eb[MT];
  const float* ef[MT];
  for (int m = 0; m < MT; ++m) {
    xr[m] = fr.codes.get() + (m0 + m) * fr.kp;
    st[m] = fr.start.data() + (m0 + m) * fr.nb;
    eb[m] = fr.ebits.data() + (m0 + m) * fr.nb;
    ef[m] = fr.ebase.data() + (m0 + m) * fr.nb;
  }
  // the dot products of group g for every row and tile
  auto group = [&](int64_t g, __m512i (&iacc)[NTP][MT]) MXPLUS_FORCE_INLINE {
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q) {
      __m512i wv[NTP];
      _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j)
        wv[j] = _mm512_load_si512(pn[j].ops + g * kPanelGroupBytes + 64 * q);
      _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
        const __m512i xb =
            _mm512_set1_epi32(reinterpret_cast<const int32_t*>(xr[m] + g * kGroupK)[q]);
        _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j)
          iacc[j][m] = dot4(iacc[j][m], wv[j], xb);
      }
    }
  };
  auto prefetch = [&]() MXPLUS_FORCE_INLINE {
    for (int l = 0; l < 2 * GPB && pf->next < pf->end; ++l, pf->next += 64)
      _mm_prefetch(reinterpret_cast<const char*>(pf->next), _MM_HINT_T1);
  };
  // FOLD: the current chunk (blocks b0 .. b1) and whether it folds for every row and tile
  bool chunk_folds = false;
  int64_t c = -1, b0 = 0, b1 = 0;
  // Block b's terms, from the panels (the register tile's rounding: see the top of the file).
  auto block = [&](int64_t b, __m512 (&acc)[NTP][MT]) MXPLUS_FORCE_INLINE {
    __m512i iacc[NTP][MT];
    if constexpr (FOLD) {
      if (b >= b1) {  // tile_frame runs the blocks in order: a new chunk
        ++c;
        b0 = b;
        b1 = std::min(b0 + s.bpc, w.nb);
        chunk_folds = true;
        for (int j = 0; j < NTP; ++j) chunk_folds &= pn[j].folded[c] != 0;
        for (int m = 0; m < MT; ++m) chunk_folds &= fr.fold[(m0 + m) * fr.nc + c] != 0;
      }
      if (chunk_folds) {  // the whole chunk at its first block; its other blocks add nothing
        if (b != b0) return;
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
          const __m512i c0 = _mm512_set1_epi32(fr.cstart[(m0 + m) * fr.nc + c]);
          _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j) iacc[j][m] = c0;
        }
        for (int64_t bb = b0; bb < b1; ++bb) {
          prefetch();
          _Pragma("GCC unroll 2") for (int gg = 0; gg < GPB; ++gg) group(bb * GPB + gg, iacc);
        }
        _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j) {  // + J * 2^(EA + EW - 256)
          const __m512i ewb = _mm512_load_si512(pn[j].ebits + b0 * kTileN);
          _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
            const __m512 p2 =
                _mm512_castsi512_ps(_mm512_add_epi32(ewb, _mm512_set1_epi32(eb[m][b0])));
            acc[j][m] = _mm512_fmadd_ps(block_sum(iacc[j][m]), p2, acc[j][m]);
          }
        }
        return;
      }
    }
    prefetch();
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
      const __m512i c0 = _mm512_set1_epi32(st[m][b]);
      _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j) iacc[j][m] = c0;
    }
    _Pragma("GCC unroll 2") for (int gg = 0; gg < GPB; ++gg) group(b * GPB + gg, iacc);
    _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j) {
      const __m512i ewb = _mm512_load_si512(pn[j].ebits + b * kTileN);
      if constexpr (FAST) {  // + I * 2^(ea + ew - 256), the power of two from its bits
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
          const __m512 p2 = _mm512_castsi512_ps(_mm512_add_epi32(ewb, _mm512_set1_epi32(eb[m][b])));
          acc[j][m] = _mm512_fmadd_ps(block_sum(iacc[j][m]), p2, acc[j][m]);
        }
      } else {  // the base codes as fp32, NaN for a NaN block (never folded)
        const __m512 ew = code_exponents(_mm512_srli_epi32(ewb, 23));
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m)
          acc[j][m] = _mm512_add_ps(
              acc[j][m], _mm512_scalef_ps(block_sum(iacc[j][m]),
                                          _mm512_add_ps(ew, _mm512_set1_ps(ef[m][b]))));
      }
    }
  };
  tile_frame<MT, NTP, MBS>(w, a, s, t0, m0, y, bias, block);
}

// terms_within (mx_tile_avx512.h) for rows m0 .. m0+mt against the ntp panels: kFastMaxExp for
// the fast block terms, kFoldMaxExp for folded chunks.
inline bool panel_terms_within(const Panel* pn, int ntp, const FoldRows& fr, int64_t m0,
                               int64_t mt, int max_exp) {
  int wlo = kE8m0Nan, whi = 0;
  for (int j = 0; j < ntp; ++j) {
    wlo = std::min(wlo, pn[j].lo);
    whi = std::max(whi, pn[j].hi);
  }
  return terms_within(wlo, whi, fr.range.data(), m0, mt, max_exp);
}

// panel_avx512 with the terms panel_rows chose (fold only with MBS).
template <int MT, int NTP, int GPB, bool MBS>
void panel_terms(bool fast, bool fold, const Panel* pn, const WeightTiles& w, const ActRows& a,
                 const FoldRows& fr, const Shape& s, int64_t t0, int64_t m0, float* y,
                 const float* bias, PanelPrefetch* pf) {
  if constexpr (MBS) {
    if (fold) return panel_avx512<MT, NTP, GPB, true, true, true>(pn, w, a, fr, s, t0, m0, y, bias, pf);
  }
  if (fast) return panel_avx512<MT, NTP, GPB, MBS, true, false>(pn, w, a, fr, s, t0, m0, y, bias, pf);
  panel_avx512<MT, NTP, GPB, MBS, false, false>(pn, w, a, fr, s, t0, m0, y, bias, pf);
}

// rows m0 .. m0+mt (mt <= MT) against NTP panels.
template <int MT, int NTP, bool MBS>
void panel_rows(const Panel* pn, const WeightTiles& w, const ActRows& a, const FoldRows& fr,
                const Shape& s, int64_t t0, int64_t m0, int64_t mt, float* y, const float* bias,
                PanelPrefetch* pf) {
  if constexpr (MT > 1) {
    if (mt < MT) return panel_rows<MT - 1, NTP, MBS>(pn, w, a, fr, s, t0, m0, mt, y, bias, pf);
  }
  const bool fast = panel_terms_within(pn, NTP, fr, m0, MT, kFastMaxExp);
  const bool fold = MBS && fast && chunks_fold(s) &&
                    panel_terms_within(pn, NTP, fr, m0, MT, kFoldMaxExp);
  if (s.gpb == 1)
    panel_terms<MT, NTP, 1, MBS>(fast, fold, pn, w, a, fr, s, t0, m0, y, bias, pf);
  else
    panel_terms<MT, NTP, 2, MBS>(fast, fold, pn, w, a, fr, s, t0, m0, y, bias, pf);
}
#endif

}  // namespace gemm_detail
}  // namespace mxplus_cpu
