// The CPU W4A4 linear of the E8M0 formats on integer dot products (docs/numerics.md,
// "Kernel numerics and error bounds"):
//
//   y[m, n] = sum over macro chunks c of  S_c / (Fa[m,c] * Fw[n,c])  (+ bias[n])
//   S_c     = sum over blocks b in c of   I_b * 2^(ea[m,b] + ew[n,b] - 256)
//   I_b     = sum over k in b of          (2 va_k) * (2 vw_k)        (exact int32)
//
// with va, vw the E2M1 values of the activation and weight codes, ea, ew their E8M0 codes and
// F = 1 + m/256 the MBS factors (1 for a side without MBS; without MBS on either side the
// whole row is one chunk and there is no division). The activation rows are quantized once
// per call (quant_row, bit-exact with formats.quantize); the weight stays packed (0.5 byte
// per element + one E8M0 byte per block + one MBS byte per macro block), re-ordered at load
// by cpu_pack_weight into 16-row tiles. No fp32 copy of the weight exists at any time.
//
// What is computed, exactly: I_b is exact (|I_b| <= 32 * 144). I_b * 2^e is formed by
// vscalefps (scalar: ldexpf), exact unless it leaves the fp32 normal range (then correctly
// rounded, to a subnormal, 0 or Inf); S_c adds those terms in fp32 in block order; Fa * Fw
// is exact (a product of two 9-bit significands); S_c / (Fa * Fw) is one IEEE division; y
// adds the chunks in fp32 in order, then the bias. A NaN scale code (255) on either side
// makes its terms NaN; so does a block holding an element whose spec value overflows fp32
// (E8M0 code 253 or 254 with a large code: the spec's x_hat or w_hat is +-Inf there, and
// every output it touches is +-Inf or NaN; here NaN).
//
// Error bound against the spec (u = 2^-24; x_hat, w_hat the spec's fp32 values, e.g.
// x_hat = fp32((va * Xa) / Fa); y64 = the float64 sum of x_hat * w_hat + b; n_b blocks and
// n_c chunks in K; no partial sum overflowing fp32):
//   |y - y64| <= (n_b + n_c + 4) * u * (sum_k |x_hat_k| |w_hat_k| + |b|)
//                + 2^-146 * (sum_k |x_hat_k| + sum_k |w_hat_k| + n_b)
// The first term: 2u from the two spec divisions (x_hat and w_hat are the quotients rounded
// once each; the integer path uses the exact quotients), n_b + n_c + 1 fp32 additions of
// terms bounded by the same magnitudes, one division and the bias addition. The second
// (absolute) term covers roundings below the fp32 normal range (subnormal x_hat, w_hat or
// block terms), each at most 2^-150 per element or per block.
// Compiled with -ffp-contract=off: no multiply-add is fused.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "mx_cpu_common.h"

namespace mxplus_cpu {
namespace {

constexpr int kTileN = 16;      // weight rows per tile: one 32-bit lane each
constexpr int kGroupK = 16;     // K elements per packed group (128 bytes per tile)
constexpr int kGroupBytes = kTileN * kGroupK / 2;
constexpr int kMaxTileM = 8;    // activation rows per register tile
constexpr int kTilesPerPass = 4;  // weight tiles sharing one pass over an activation row tile
constexpr int kOffset = 12;     // unsigned weight byte = 2 * value + 12 in [0, 24]

struct WeightTiles {
  const uint8_t* codes;   // [nt, groups, 128]: see pack_weight for the byte order
  const uint8_t* scales;  // [nt, nb, 16] E8M0 codes, one per tile row
  const uint8_t* mbs;     // [nt, nm, 16] MBS bytes, or nullptr
  int64_t nt, groups, nb, nm, n;
};

struct ActRows {
  const int8_t* codes;  // [M, kp] 2 * value, zero padded
  const int32_t* corr;  // [M, nb] -12 * (sum of the block's codes): undoes the weight offset
  const float* ea;      // [M, nb] ea - 256 (NaN for code 255)
  const float* fa;      // [M, nm] Fa (1 without activation MBS), or nullptr
  int64_t kp, nb, nm;
};

struct Shape {
  int64_t gpb;  // 16-element groups per block (1 for block 16, 2 for block 32)
  int64_t bpc;  // blocks per chunk (a macro block with MBS, else all of K)
  int64_t nc;   // chunks
  bool mbs;     // divide each chunk by Fa * Fw
};

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

// The E8M0 exponents ew - 0 of one block of the tile's 16 rows as fp32 (NaN for code 255).
inline __m512 weight_exponents(const uint8_t* p) {
  const __m512i ewi = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_mask_mov_ps(_mm512_cvtepi32_ps(ewi),
                            _mm512_cmpeq_epi32_mask(ewi, _mm512_set1_epi32(kE8m0Nan)),
                            _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
}

// iacc[j][m] += group g (elements koff .. koff+15) of rows m against NTP weight tiles.
template <int MT, int NTP>
inline void group_dots(const uint8_t* const* wg, const int8_t* const* xr, int64_t koff,
                       __m512i lut, __m512i (*iacc)[MT]) {
  __m512i wv[NTP][4];
  _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j) {
    const __m512i p0 = _mm512_loadu_si512(wg[j]), p1 = _mm512_loadu_si512(wg[j] + 64);
    wv[j][0] = nib_lo(p0, lut);
    wv[j][1] = nib_hi(p0, lut);
    wv[j][2] = nib_lo(p1, lut);
    wv[j][3] = nib_hi(p1, lut);
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
    const int32_t* x4 = reinterpret_cast<const int32_t*>(xr[m] + koff);
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; ++q) {
      const __m512i xb = _mm512_set1_epi32(x4[q]);  // one broadcast serves NTP tiles
      _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j)
        iacc[j][m] = dot4(iacc[j][m], wv[j][q], xb);
    }
  }
}

// y[m0 .. m0+MT, the 16 rows of each tile t0 .. t0+NTP]. GPB = 16-element groups per block.
template <int MT, int NTP, int GPB, bool MBS>
void tile_avx512(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t0,
                 int64_t m0, float* y, const float* bias) {
  const __m512i lut = weight_lut();
  const int8_t* xr[MT];
  const int32_t* cr[MT];
  const float* er[MT];
  for (int m = 0; m < MT; ++m) {
    xr[m] = a.codes + (m0 + m) * a.kp;
    cr[m] = a.corr + (m0 + m) * a.nb;
    er[m] = a.ea + (m0 + m) * a.nb;
  }
  // With MBS the chunk sums live in registers and the row sums in memory (updated once per
  // chunk): keeping both in zmm registers spills.
  alignas(64) float ysum[NTP][MT][kTileN];
  __m512 acc[NTP][MT];
  for (int j = 0; j < NTP; ++j)
    _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
      acc[j][m] = _mm512_setzero_ps();
      if (MBS) _mm512_store_ps(ysum[j][m], acc[j][m]);
    }
  for (int64_t c = 0; c < s.nc; ++c) {
    const int64_t b1 = std::min((c + 1) * s.bpc, w.nb);
    for (int64_t b = c * s.bpc; b < b1; ++b) {
      __m512 ew[NTP];
      __m512i iacc[NTP][MT];
      _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j) {
        ew[j] = weight_exponents(w.scales + ((t0 + j) * w.nb + b) * kTileN);
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m)
          iacc[j][m] = _mm512_set1_epi32(cr[m][b]);
      }
      _Pragma("GCC unroll 2") for (int gg = 0; gg < GPB; ++gg) {
        const int64_t g = b * GPB + gg;
        const uint8_t* wg[NTP];
        for (int j = 0; j < NTP; ++j) wg[j] = w.codes + ((t0 + j) * w.groups + g) * kGroupBytes;
        group_dots<MT, NTP>(wg, xr, g * kGroupK, lut, iacc);
      }
      _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
        const __m512 ea = _mm512_set1_ps(er[m][b]);
        _Pragma("GCC unroll 2") for (int j = 0; j < NTP; ++j)  // + I * 2^(ea + ew - 256)
          acc[j][m] = _mm512_add_ps(acc[j][m], _mm512_scalef_ps(_mm512_cvtepi32_ps(iacc[j][m]),
                                                                _mm512_add_ps(ew[j], ea)));
      }
    }
    if (MBS) {
      for (int j = 0; j < NTP; ++j) {
        __m512 fw = _mm512_set1_ps(1.0f);
        if (w.mbs) {
          const __m512i mw = _mm512_cvtepu8_epi32(_mm_loadu_si128(
              reinterpret_cast<const __m128i*>(w.mbs + ((t0 + j) * w.nm + c) * kTileN)));
          fw = _mm512_div_ps(_mm512_add_ps(_mm512_cvtepi32_ps(mw), _mm512_set1_ps(kMbsDenom)),
                             _mm512_set1_ps(kMbsDenom));  // exact: a power-of-two divisor
        }
        _Pragma("GCC unroll 8") for (int m = 0; m < MT; ++m) {
          const __m512 f =
              a.fa ? _mm512_mul_ps(fw, _mm512_set1_ps(a.fa[(m0 + m) * a.nm + c])) : fw;
          _mm512_store_ps(ysum[j][m], _mm512_add_ps(_mm512_load_ps(ysum[j][m]),
                                                    _mm512_div_ps(acc[j][m], f)));
          acc[j][m] = _mm512_setzero_ps();
        }
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
#endif

// ---- the portable kernel (same operations, one lane at a time) -------------------------
template <int MT, bool MBS>
void tile_scalar(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t,
                 int64_t m0, float* y, const float* bias) {
  const uint8_t* wc = w.codes + t * w.groups * kGroupBytes;
  const uint8_t* ws = w.scales + t * w.nb * kTileN;
  const int64_t n0 = t * kTileN;
  const int64_t valid = std::min<int64_t>(kTileN, w.n - n0);
  for (int64_t i = 0; i < valid; ++i) {
    float yacc[MT] = {}, cacc[MT] = {};
    for (int64_t c = 0; c < s.nc; ++c) {
      const int64_t b1 = std::min((c + 1) * s.bpc, w.nb);
      for (int m = 0; m < MT; ++m) cacc[m] = 0.0f;
      for (int64_t b = c * s.bpc; b < b1; ++b) {
        const int ewc = ws[b * kTileN + i];
        const float ew = ewc == kE8m0Nan ? std::numeric_limits<float>::quiet_NaN()
                                         : static_cast<float>(ewc);
        int32_t iacc[MT] = {};
        for (int64_t g = b * s.gpb; g < (b + 1) * s.gpb; ++g) {
          const uint8_t* p = wc + g * kGroupBytes;
          for (int j = 0; j < 16; ++j) {  // group element j: byte (j / 8) * 64 + 4 i + j % 4
            const uint8_t byte = p[(j >> 3) * 64 + 4 * i + (j & 3)];
            const int wv = kE2M1x2[(j & 4) ? (byte >> 4) : (byte & 0xF)];
            for (int m = 0; m < MT; ++m) iacc[m] += wv * a.codes[(m0 + m) * a.kp + g * kGroupK + j];
          }
        }
        for (int m = 0; m < MT; ++m) {
          const float e = ew + a.ea[(m0 + m) * a.nb + b];
          const float term = std::isnan(e) ? e : std::ldexp(static_cast<float>(iacc[m]),
                                                            static_cast<int>(e));
          if (MBS) cacc[m] += term;
          else yacc[m] += term;
        }
      }
      if (MBS) {
        const float fw = w.mbs ? mbs_factor(w.mbs[(t * w.nm + c) * kTileN + i]) : 1.0f;
        for (int m = 0; m < MT; ++m)
          yacc[m] += cacc[m] / (a.fa ? fw * a.fa[(m0 + m) * a.nm + c] : fw);
      }
    }
    for (int m = 0; m < MT; ++m)
      y[(m0 + m) * w.n + n0 + i] = bias ? yacc[m] + bias[n0 + i] : yacc[m];
  }
}

#ifdef MXPLUS_AVX512
// Rows m0 .. m0+mt (mt <= MT) against NTP tiles from t.
template <int MT, int NTP, bool MBS>
void tile_rows(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t, int64_t m0,
               int64_t mt, float* y, const float* bias) {
  if constexpr (MT > 1) {
    if (mt < MT) return tile_rows<MT - 1, NTP, MBS>(w, a, s, t, m0, mt, y, bias);
  }
  if (s.gpb == 1) tile_avx512<MT, NTP, 1, MBS>(w, a, s, t, m0, y, bias);
  else tile_avx512<MT, NTP, 2, MBS>(w, a, s, t, m0, y, bias);
}

// Pairs of weight tiles share each activation broadcast (half the loads per product); an odd
// last tile runs alone. Register tiles: 2 x 4 rows, or 1 x 8.
template <bool MBS>
void tiles_rows(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t, int64_t tend,
                int64_t m0, int64_t mt, float* y, const float* bias) {
  for (int64_t mm = m0; mm < m0 + mt; mm += 4) {
    int64_t tt = t;
    for (; tt + 2 <= tend; tt += 2)
      tile_rows<4, 2, MBS>(w, a, s, tt, mm, std::min<int64_t>(4, m0 + mt - mm), y, bias);
    if (tt < tend)
      tile_rows<4, 1, MBS>(w, a, s, tt, mm, std::min<int64_t>(4, m0 + mt - mm), y, bias);
  }
}
#else
template <bool MBS>
void tiles_rows(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t, int64_t tend,
                int64_t m0, int64_t mt, float* y, const float* bias) {
  for (int64_t tt = t; tt < tend; ++tt) {
    switch (mt) {
#define MXPLUS_TILE(T) case T: tile_scalar<T, MBS>(w, a, s, tt, m0, y, bias); break;
      MXPLUS_TILE(1) MXPLUS_TILE(2) MXPLUS_TILE(3) MXPLUS_TILE(4) MXPLUS_TILE(5)
      MXPLUS_TILE(6) MXPLUS_TILE(7)
#undef MXPLUS_TILE
      default: tile_scalar<kMaxTileM, MBS>(w, a, s, tt, m0, y, bias); break;
    }
  }
}
#endif

// Threads over N (weight tiles); each thread walks its tiles kTilesPerPass at a time, and
// for each activation row tile runs those weight tiles, so the row tile is read from cache.
template <bool MBS>
void gemm(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t M, float* y,
          const float* bias) {
  at::parallel_for(0, w.nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t tp = t0; tp < t1; tp += kTilesPerPass) {
      const int64_t tend = std::min(tp + kTilesPerPass, t1);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTileM)
        tiles_rows<MBS>(w, a, s, tp, tend, m0, std::min<int64_t>(kMaxTileM, M - m0), y, bias);
    }
  });
}

// ---- ops ------------------------------------------------------------------------------------

// Checkpoint layout (codes [N, ceil(K/2)], scales [N, nb], mbs [N, nm]) -> tiles. The scales
// are copied, except that a block whose dequantized values overflow fp32 gets code 255. Tile t,
// group g (elements 16g .. 16g+15 of rows 16t .. 16t+15), 128 bytes: byte 64q + 4i + j holds
// row 16t+i's element 16g + 8q + j in its low nibble and 16g + 8q + 4 + j in its high nibble,
// so the low / high nibbles of each 64-byte half are vpdpbusd operands (4 elements per row
// lane). Rows past N and elements past K are code 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_weight(const at::Tensor& codes,
                                                           const at::Tensor& scales,
                                                           const at::Tensor& mbs, int64_t k,
                                                           int64_t block, int64_t macro) {
  TORCH_CHECK(block == 16 || block == 32, "vllm_mxplus::cpu_pack_weight: block must be 16 or "
              "32, got ", block);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && k > 0 &&
                  codes.size(1) == (k + 1) / 2 && codes.device().is_cpu(),
              "vllm_mxplus::cpu_pack_weight: weight codes must be CPU uint8 [N, ceil(K/2)] for "
              "K=", k, ", got ", codes.sizes(), " ", codes.scalar_type());
  const int64_t N = codes.size(0), nb = cdiv(k, block), nt = cdiv(N, kTileN);
  const int64_t groups = nb * block / kGroupK;
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kByte && scales.size(0) == N &&
                  scales.size(1) == nb,
              "vllm_mxplus::cpu_pack_weight: weight scales must be uint8 [", N, ", ", nb,
              "], got ", scales.sizes(), " ", scales.scalar_type());
  const bool has_mbs = mbs.numel() > 0;
  const int64_t nm = has_mbs ? cdiv(k, macro) : 0;
  TORCH_CHECK(!has_mbs || (macro > 0 && macro % block == 0 && mbs.dim() == 2 &&
                           mbs.scalar_type() == at::kByte && mbs.size(0) == N &&
                           mbs.size(1) == nm),
              "vllm_mxplus::cpu_pack_weight: weight MBS bytes must be uint8 [", N, ", ",
              cdiv(k, std::max<int64_t>(macro, 1)), "] with a macro block multiple of ", block,
              ", got ", mbs.sizes(), " (macro ", macro, ")");
  const at::Tensor c = codes.contiguous(), s = scales.contiguous(), mb = mbs.contiguous();
  auto opts = codes.options();
  at::Tensor wc = at::zeros({nt, groups * kGroupBytes}, opts);
  at::Tensor ws = at::zeros({nt, nb * kTileN}, opts);
  at::Tensor wm = at::zeros({has_mbs ? nt : 0, nm * kTileN}, opts);
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const int64_t kc = c.size(1);
  auto code_at = [&](int64_t n, int64_t kk) -> int {
    if (n >= N || kk >= k) return 0;
    const uint8_t byte = cp[n * kc + (kk >> 1)];
    return (kk & 1) ? (byte >> 4) : (byte & 0xF);
  };
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      uint8_t* out = wc.data_ptr<uint8_t>() + t * groups * kGroupBytes;
      for (int64_t g = 0; g < groups; ++g)
        for (int q = 0; q < 2; ++q)
          for (int i = 0; i < kTileN; ++i)
            for (int j = 0; j < 4; ++j) {
              const int64_t n = t * kTileN + i, kk = g * kGroupK + 8 * q + j;
              out[g * kGroupBytes + 64 * q + 4 * i + j] =
                  static_cast<uint8_t>(code_at(n, kk) | (code_at(n, kk + 4) << 4));
            }
      for (int i = 0; i < kTileN && t * kTileN + i < N; ++i) {
        const int64_t n = t * kTileN + i;
        for (int64_t b = 0; b < nb; ++b) {
          int sc = s.data_ptr<uint8_t>()[n * nb + b];
          int big = 0;
          for (int64_t kk = b * block; sc >= 253 && kk < (b + 1) * block; ++kk)
            big = std::max(big, static_cast<int>(std::abs(kE2M1x2[code_at(n, kk)])));
          if (overflows(sc, big)) sc = kE8m0Nan;  // the spec's w_hat is +-Inf: NaN outputs
          ws.data_ptr<uint8_t>()[(t * nb + b) * kTileN + i] = static_cast<uint8_t>(sc);
        }
        for (int64_t cc = 0; cc < nm; ++cc)
          wm.data_ptr<uint8_t>()[(t * nm + cc) * kTileN + i] = mb.data_ptr<uint8_t>()[n * nm + cc];
      }
    }
  });
  return {wc, ws, wm};
}

at::Tensor mx_linear(const at::Tensor& x, int64_t act_block, int64_t act_rule, bool act_mbs,
                     int64_t macro, const at::Tensor& wcodes, const at::Tensor& wscales,
                     const at::Tensor& wmbs, int64_t n, int64_t k, int64_t w_block,
                     const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  check_rule(act_block, act_rule, act_mbs, macro);
  TORCH_CHECK(w_block == act_block, "vllm_mxplus::cpu_mx_linear: weight block ", w_block,
              " differs from the activation block ", act_block);
  TORCH_CHECK(x.device().is_cpu(), "vllm_mxplus::cpu_mx_linear: x must be on the CPU");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "vllm_mxplus::cpu_mx_linear: x has last dim ",
              x.size(-1), " but the weight has K=", k);
  const int64_t block = act_block, nb = cdiv(k, block), kp = nb * block, nt = cdiv(n, kTileN);
  const bool w_mbs = wmbs.numel() > 0;
  const int64_t nm = cdiv(k, macro);
  TORCH_CHECK(wcodes.scalar_type() == at::kByte && wcodes.is_contiguous() &&
                  wcodes.sizes() == at::IntArrayRef({nt, kp / kGroupK * kGroupBytes}),
              "vllm_mxplus::cpu_mx_linear: packed weight codes must be contiguous uint8 [", nt,
              ", ", kp / kGroupK * kGroupBytes, "] (cpu_pack_weight), got ", wcodes.sizes());
  TORCH_CHECK(wscales.scalar_type() == at::kByte && wscales.is_contiguous() &&
                  wscales.sizes() == at::IntArrayRef({nt, nb * kTileN}),
              "vllm_mxplus::cpu_mx_linear: packed weight scales must be contiguous uint8 [", nt,
              ", ", nb * kTileN, "] (cpu_pack_weight), got ", wscales.sizes());
  TORCH_CHECK(!w_mbs || (wmbs.scalar_type() == at::kByte && wmbs.is_contiguous() &&
                         wmbs.sizes() == at::IntArrayRef({nt, nm * kTileN})),
              "vllm_mxplus::cpu_mx_linear: packed weight MBS bytes must be contiguous uint8 [",
              nt, ", ", nm * kTileN, "] (cpu_pack_weight), got ", wmbs.sizes());
  TORCH_CHECK(wcodes.device().is_cpu() && wscales.device().is_cpu() && wmbs.device().is_cpu(),
              "vllm_mxplus::cpu_mx_linear: weights must be on the CPU");
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  const int64_t M = x.numel() / k;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "vllm_mxplus::cpu_mx_linear: bias has ", bias->numel(),
                " elements, expected N=", n);
    bias_f = bias->to(at::kFloat).contiguous();
  }
  if (M == 0) return at::empty(out_shape, x.options().dtype(out_dtype));

  // Activation rows, quantized once per call.
  const at::Tensor xf = x.reshape({M, k}).to(at::kFloat).contiguous();
  const auto o = xf.options();
  at::Tensor acodes = at::empty({M, kp}, o.dtype(at::kChar));
  at::Tensor corr = at::empty({M, nb}, o.dtype(at::kInt));
  at::Tensor ea = at::empty({M, nb}, o);
  at::Tensor fa = at::empty({act_mbs ? M : 0, nm}, o);
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> ybuf(std::max(macro, block));
    std::vector<uint8_t> sc(nb), mb(nm);
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* cr = acodes.data_ptr<int8_t>() + r * kp;
      int32_t* sums = corr.data_ptr<int32_t>() + r * nb;
      quant_row(xf.data_ptr<float>() + r * k, k, block, static_cast<int>(act_rule), act_mbs,
                macro, cr, sc.data(), mb.data(), sums, ybuf.data());
      for (int64_t b = 0; b < nb; ++b) {
        int big = 0;
        for (int64_t i = 0; sc[b] >= 253 && i < block; ++i)  // rare: see overflows()
          big = std::max(big, std::abs(static_cast<int>(cr[b * block + i])));
        sums[b] *= -kOffset;
        ea.data_ptr<float>()[r * nb + b] = sc[b] == kE8m0Nan || overflows(sc[b], big)
            ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(sc[b]) - 256.0f;
      }
      for (int64_t c = 0; act_mbs && c < nm; ++c) fa.data_ptr<float>()[r * nm + c] = mbs_factor(mb[c]);
    }
  });
  const bool any_mbs = act_mbs || w_mbs;
  const WeightTiles w{wcodes.data_ptr<uint8_t>(), wscales.data_ptr<uint8_t>(),
                      w_mbs ? wmbs.data_ptr<uint8_t>() : nullptr, nt, kp / kGroupK, nb, nm, n};
  const ActRows a{acodes.data_ptr<int8_t>(), corr.data_ptr<int32_t>(), ea.data_ptr<float>(),
                  act_mbs ? fa.data_ptr<float>() : nullptr, kp, nb, nm};
  const Shape s{block / kGroupK, any_mbs ? macro / block : nb, any_mbs ? nm : 1, any_mbs};
  at::Tensor y = at::empty({M, n}, o);
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (any_mbs) gemm<true>(w, a, s, M, y.data_ptr<float>(), bp);
  else gemm<false>(w, a, s, M, y.data_ptr<float>(), bp);
  return y.to(out_dtype).view(out_shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mxplus, m) {
  m.def("cpu_pack_weight(Tensor codes, Tensor scales, Tensor mbs, int k, int block, int macro)"
        " -> (Tensor, Tensor, Tensor)");
  m.def("cpu_mx_linear(Tensor x, int act_block, int act_rule, bool act_mbs, int macro, "
        "Tensor wcodes, Tensor wscales, Tensor wmbs, int n, int k, int w_block, Tensor? bias, "
        "ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_mxplus, CPU, m) {
  m.impl("cpu_pack_weight", &pack_weight);
  m.impl("cpu_mx_linear", &mx_linear);
}

}  // namespace mxplus_cpu
