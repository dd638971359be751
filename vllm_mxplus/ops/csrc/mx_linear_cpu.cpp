// CPU kernels for the E8M0 (MX) formats: activation fake-quantization and a linear that
// streams the packed FP4 weights (codes + E8M0 scales + MBS bytes) and dequantizes them in
// registers. Built at first use by vllm_mxplus/ops/cpu_kernels.py (torch cpp_extension).
//
// Numerics (DESIGN.md §1, CPU path of §3): every dequantized weight element and every
// fake-quantized activation element is the bit pattern `vllm_mxplus.formats` produces;
// only the order in which the fp32 dot products accumulate differs from torch's GEMM.
//  - activations: optional MBS-S factor F = 1 + m/256 with m from eq. 3, y = fp32(x * F),
//    E8M0 block scale by rule (ocp / floor / oas), E2M1 ties-to-even-code, value*X/F.
//  - weights: w = (value(code) * X) / F. The fast path computes (value/F) * X from a 16-entry
//    table per macro block; it equals (value*X)/F whenever both stay in the fp32 normal range,
//    which holds for scale codes 3..250. Other blocks (and NaN blocks) take the exact
//    per-element formula.
// Compiled with -ffp-contract=off: no multiply/add is fused except the explicit FMAs of the
// dot products.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MXPLUS_AVX512 1
#endif

namespace mxplus_cpu {
namespace {

constexpr int kRuleOcp = 0, kRuleFloor = 1, kRuleOas = 2;
constexpr int kMaxTileM = 16;  // rows of x per register tile in the GEMV (<= 16 zmm accumulators)

alignas(64) const float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Exact fp32 2^k for integer k in [-149, 127].
inline float pow2f(int k) {
  if (k >= -126) return u2f(static_cast<uint32_t>(k + 127) << 23);
  return u2f(1u << (k + 149));
}

// fp32 value of an E8M0 code (255 = NaN).
inline float e8m0_value(int code) {
  return code == 255 ? std::numeric_limits<float>::quiet_NaN() : pow2f(code - 127);
}

// E8M0 code of a block absmax under a scale rule (formats/e8m0.py: e8m0_block_scale).
inline int scale_code(float absmax, int rule) {
  if (!std::isfinite(absmax)) return 255;
  if (absmax == 0.0f) return 0;
  float an = absmax;
  int sub = 0;
  if (an < 1.17549435e-38f) { an *= 18446744073709551616.0f; sub = 64; }  // 2^64, exact
  const uint32_t b = f2u(an);
  const int e = static_cast<int>((b >> 23) & 0xFF) - 127 - sub;
  const uint32_t man = b & 0x7FFFFF;
  int d = 0;
  if (rule == kRuleFloor) d = man > 0x400000;
  if (rule == kRuleOas) d = man > 0x600000;
  return std::min(std::max(e - 2 + d + 127, 0), 254);
}

// E2M1 magnitude code of a non-negative scaled value (round to nearest, ties to even code).
inline int e2m1_mag(float v) {
  return (v > 0.25f) + (v >= 0.75f) + (v > 1.25f) + (v >= 1.75f) + (v > 2.5f) + (v >= 3.5f) +
         (v > 5.0f);
}

// The MBS factor F = 1 + m/256 of a byte m (exact in fp32).
inline float mbs_factor(int m) { return (static_cast<float>(m) + 256.0f) / 256.0f; }

// The MBS-S factor of a macro block with absmax a (NaN if the block holds a NaN).
inline float mbs_static_factor(float a) {
  int m = 0;
  if (std::isfinite(a)) m = static_cast<int>((f2u(6.0f / a) & 0x007F8000u) >> 15);
  return mbs_factor(m);
}

inline float nan_absmax(const float* v, int64_t n) {
  float a = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float t = std::fabs(v[i]);
    if (std::isnan(t)) return t;
    a = t > a ? t : a;
  }
  return a;
}

// One row of fake-quantization, fp32 in, fp32 out, K elements (trailing partial blocks and
// macro blocks are shorter; never padded by the caller).
void fake_quant_row(const float* x, float* out, int64_t K, int64_t block, int rule, bool mbs,
                    int64_t macro, float* ybuf) {
  const int64_t unit = mbs ? macro : block;
  for (int64_t u0 = 0; u0 < K; u0 += unit) {
    const int64_t ulen = std::min(unit, K - u0);
    float F = 1.0f;
    if (mbs) F = mbs_static_factor(nan_absmax(x + u0, ulen));
    for (int64_t i = 0; i < ulen; ++i) ybuf[i] = mbs ? x[u0 + i] * F : x[u0 + i];
    for (int64_t b0 = 0; b0 < ulen; b0 += block) {
      const int64_t blen = std::min(block, ulen - b0);
      const float* y = ybuf + b0;
      float* o = out + u0 + b0;
      const int code = scale_code(nan_absmax(y, blen), rule);
      if (code == 255) {
        for (int64_t i = 0; i < blen; ++i) o[i] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float recip = pow2f(127 - code);
      const float X = pow2f(code - 127);
      for (int64_t i = 0; i < blen; ++i) {
        const int mag = e2m1_mag(std::fabs(y[i]) * recip);
        const float val = kE2M1[mag | (std::signbit(y[i]) ? 8 : 0)];
        const float q = val * X;
        o[i] = mbs ? q / F : q;
      }
    }
  }
}

void check_rule(int64_t block, int64_t rule, bool mbs, int64_t macro) {
  TORCH_CHECK(block == 16 || block == 32, "mxplus_cpu: block size must be 16 or 32, got ", block);
  TORCH_CHECK(rule >= kRuleOcp && rule <= kRuleOas, "mxplus_cpu: unknown scale rule ", rule);
  TORCH_CHECK(!mbs || (macro > 0 && macro % block == 0),
              "mxplus_cpu: macro block ", macro, " must be a positive multiple of ", block);
}

// x [M, K] (any float dtype) -> fp32 fake-quantized [M, K]
at::Tensor fake_quant_2d(const at::Tensor& x2, int64_t block, int64_t rule, bool mbs,
                         int64_t macro) {
  const at::Tensor xf = x2.to(at::kFloat).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  at::Tensor out = at::empty({M, K}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t unit = mbs ? macro : block;
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> ybuf(unit);
    for (int64_t r = r0; r < r1; ++r)
      fake_quant_row(xp + r * K, op + r * K, K, block, static_cast<int>(rule), mbs, macro,
                     ybuf.data());
  });
  return out;
}

at::Tensor act_fake_quant(const at::Tensor& x, int64_t block, int64_t rule, bool mbs,
                          int64_t macro) {
  check_rule(block, rule, mbs, macro);
  TORCH_CHECK(x.device().is_cpu(), "mxplus_cpu.act_fake_quant: x must be on the CPU");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "mxplus_cpu.act_fake_quant: empty last dim");
  const int64_t K = x.size(-1);
  at::Tensor out = fake_quant_2d(x.reshape({-1, K}), block, rule, mbs, macro);
  return out.view(x.sizes());
}

// ---- weights --------------------------------------------------------------------------------

struct PackedWeight {
  const uint8_t* codes;   // [N, Kc] two codes per byte, element 2i in the low nibble
  const uint8_t* scales;  // [N, nb] E8M0
  const uint8_t* mbs;     // [N, nm] or nullptr
  int64_t K, Kc, nb, nm, block, macro;
  int block_shift;  // log2(block): the hot loops shift instead of dividing (an idiv per vector)
};

inline int code_at(const uint8_t* row, int64_t k) {
  const uint8_t b = row[k >> 1];
  return (k & 1) ? (b >> 4) : (b & 0xF);
}

// F of the macro block holding element k of row n (1 without MBS).
inline float row_factor(const PackedWeight& w, int64_t n, int64_t k) {
  return w.mbs ? mbs_factor(w.mbs[n * w.nm + k / w.macro]) : 1.0f;
}

// Exact dequantized weight element (value*X)/F (F = 1 without MBS: no division).
inline float weight_elem(const PackedWeight& w, int64_t n, int64_t k) {
  const int code = code_at(w.codes + n * w.Kc, k);
  const float q = kE2M1[code] * e8m0_value(w.scales[n * w.nb + k / w.block]);
  return w.mbs ? q / row_factor(w, n, k) : q;
}

// The exact formula for the 16 elements of a block outside the fast range (rare): kept out
// of line so that the hot loops keep their accumulators in registers.
__attribute__((noinline)) void slow_block(const PackedWeight& w, int64_t n, int64_t k,
                                          float* out) {
  for (int i = 0; i < 16; ++i) out[i] = weight_elem(w, n, k + i);
}

// Per-(row, macro-unit) table value(code)/F for the fast path.
inline void lut_for(float F, float* lut) {
  for (int c = 0; c < 16; ++c) lut[c] = kE2M1[c] / F;
}

inline bool fast_scale(int code) { return code >= 3 && code <= 250; }

#ifdef MXPLUS_AVX512
// The 16 codes of 8 packed bytes as vpermps indices. u16 lane i = b | b << 4: its low byte's
// low nibble is b & 15, its high byte's low nibble is b >> 4, and vpermps only reads the low
// 4 bits of each 32-bit index.
inline __m512i nibble_index(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtepu8_epi32(_mm_or_si128(b, _mm_slli_epi16(b, 4)));
}
#endif

// Dequantize rows [n0, n1) of the weight into fp32 (row stride K). Bit-exact to formats.
void dequant_rows(const PackedWeight& w, float* out, int64_t n0, int64_t n1) {
  const int64_t kfull = w.K / 16 * 16;
  const int64_t unit = w.mbs ? w.macro : 128;
  alignas(64) float lut[16];
  for (int64_t n = n0; n < n1; ++n) {
    float* o = out + (n - n0) * w.K;
    const uint8_t* cr = w.codes + n * w.Kc;
    const uint8_t* sr = w.scales + n * w.nb;
    for (int64_t u0 = 0; u0 < kfull; u0 += unit) {
      lut_for(row_factor(w, n, u0), lut);
      const int64_t uend = std::min(u0 + unit, kfull);
      for (int64_t k = u0; k < uend; k += 16) {
        const int code = sr[k >> w.block_shift];
        if (fast_scale(code)) {
          const float X = pow2f(code - 127);
#ifdef MXPLUS_AVX512
          _mm512_storeu_ps(o + k, _mm512_mul_ps(_mm512_permutexvar_ps(nibble_index(cr + (k >> 1)),
                                                                      _mm512_load_ps(lut)),
                                                _mm512_set1_ps(X)));
          continue;
#endif
          for (int i = 0; i < 16; i += 2) {
            const uint8_t b = cr[(k + i) >> 1];
            o[k + i] = lut[b & 0xF] * X;
            o[k + i + 1] = lut[b >> 4] * X;
          }
        } else {
          slow_block(w, n, k, o + k);
        }
      }
    }
    for (int64_t k = kfull; k < w.K; ++k) o[k] = weight_elem(w, n, k);
  }
}

#ifdef MXPLUS_AVX512
// acc[m] += xq[m, k0:k0+16] * w(n, k0:k0+16) for m < MT; 16-aligned full blocks only.
template <int MT>
void gemv_row_avx512(const PackedWeight& w, int64_t n, const float* xq, int64_t ldx,
                     int64_t kfull, float* y, int64_t ldy, const float* bias) {
  // Fully unrolled m loops keep acc[] in registers: without them GCC 12 spilled the MT = 2
  // accumulators to the stack on every step (M = 2 ran slower than M = 3).
  __m512 acc[MT];
  _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  const uint8_t* cr = w.codes + n * w.Kc;
  const uint8_t* sr = w.scales + n * w.nb;
  const __m512 table = _mm512_load_ps(kE2M1);
  const int64_t unit = w.mbs ? w.macro : 128;  // the LUT is rebuilt per unit
  alignas(64) float slow[16];
  for (int64_t u0 = 0; u0 < kfull; u0 += unit) {
    const float F = row_factor(w, n, u0);
    const __m512 lut = w.mbs ? _mm512_div_ps(table, _mm512_set1_ps(F)) : table;
    const int64_t uend = std::min(u0 + unit, kfull);
    for (int64_t k = u0; k < uend; k += 16) {
      const int code = sr[k >> w.block_shift];
      __m512 wv;
      if (fast_scale(code)) {
        wv = _mm512_mul_ps(_mm512_permutexvar_ps(nibble_index(cr + (k >> 1)), lut),
                           _mm512_set1_ps(pow2f(code - 127)));
      } else {
        slow_block(w, n, k, slow);
        wv = _mm512_load_ps(slow);
      }
      _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m)
        acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xq + m * ldx + k), wv, acc[m]);
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < MT; ++m) {
    float s = _mm512_reduce_add_ps(acc[m]);
    for (int64_t k = kfull; k < w.K; ++k) s = std::fma(xq[m * ldx + k], weight_elem(w, n, k), s);
    if (bias) s += bias[n];
    y[m * ldy + n] = s;
  }
}
#endif

// Portable version of the same computation (used without AVX-512).
template <int MT>
void gemv_row_scalar(const PackedWeight& w, int64_t n, const float* xq, int64_t ldx,
                     int64_t kfull, float* y, int64_t ldy, const float* bias) {
  float acc[MT][16] = {};
  const uint8_t* cr = w.codes + n * w.Kc;
  const uint8_t* sr = w.scales + n * w.nb;
  const int64_t unit = w.mbs ? w.macro : 128;
  float lut[16], wv[16];
  for (int64_t u0 = 0; u0 < kfull; u0 += unit) {
    const float F = row_factor(w, n, u0);
    lut_for(F, lut);
    const int64_t uend = std::min(u0 + unit, kfull);
    for (int64_t k = u0; k < uend; k += 16) {
      const int code = sr[k >> w.block_shift];
      if (fast_scale(code)) {
        const float X = pow2f(code - 127);
        for (int i = 0; i < 16; ++i) {
          const uint8_t b = cr[(k >> 1) + (i >> 1)];
          wv[i] = lut[(i & 1) ? (b >> 4) : (b & 0xF)] * X;
        }
      } else {
        slow_block(w, n, k, wv);
      }
      for (int m = 0; m < MT; ++m)
        for (int i = 0; i < 16; ++i) acc[m][i] = std::fma(xq[m * ldx + k + i], wv[i], acc[m][i]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += acc[m][i];
    for (int64_t k = kfull; k < w.K; ++k) s = std::fma(xq[m * ldx + k], weight_elem(w, n, k), s);
    if (bias) s += bias[n];
    y[m * ldy + n] = s;
  }
}

template <int MT>
void gemv_tile(const PackedWeight& w, const float* xq, int64_t ldx, float* y, int64_t ldy,
               const float* bias, int64_t N) {
  const int64_t kfull = w.K / 16 * 16;
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
#ifdef MXPLUS_AVX512
      gemv_row_avx512<MT>(w, n, xq, ldx, kfull, y, ldy, bias);
#else
      gemv_row_scalar<MT>(w, n, xq, ldx, kfull, y, ldy, bias);
#endif
    }
  });
}

void gemv(const PackedWeight& w, const float* xq, int64_t M, float* y, int64_t N,
          const float* bias) {
  // 16-row tiles halve the dequantization work per row of x, but the tile's x rows are re-read
  // for every weight row: above K = 768 (48 KiB of fp32 x) they fall out of L1, and measured
  // 16-row tiles were slower than 8 (benchmarks/bench_cpu_linear.py, K = 1536).
  const int64_t tile = w.K * 16 * 4 <= 48 * 1024 ? kMaxTileM : 8;
  for (int64_t m0 = 0; m0 < M; m0 += tile) {
    const int64_t mt = std::min<int64_t>(tile, M - m0);
    const float* xt = xq + m0 * w.K;
    float* yt = y + m0 * N;
    switch (mt) {
#define MXPLUS_TILE(T) case T: gemv_tile<T>(w, xt, w.K, yt, N, bias, N); break;
      MXPLUS_TILE(1) MXPLUS_TILE(2) MXPLUS_TILE(3) MXPLUS_TILE(4) MXPLUS_TILE(5) MXPLUS_TILE(6)
      MXPLUS_TILE(7) MXPLUS_TILE(8) MXPLUS_TILE(9) MXPLUS_TILE(10) MXPLUS_TILE(11)
      MXPLUS_TILE(12) MXPLUS_TILE(13) MXPLUS_TILE(14) MXPLUS_TILE(15)
#undef MXPLUS_TILE
      default: gemv_tile<kMaxTileM>(w, xt, w.K, yt, N, bias, N); break;
    }
  }
}

PackedWeight packed_weight(const at::Tensor& codes, const at::Tensor& scales,
                           const at::Tensor& mbs, int64_t k, int64_t block, int64_t macro) {
  TORCH_CHECK(block == 16 || block == 32, "mxplus_cpu: weight block must be 16 or 32, got ", block);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "mxplus_cpu: weight codes must be contiguous uint8 [N, ceil(K/2)], got ",
              codes.sizes(), " ", codes.scalar_type());
  const int64_t N = codes.size(0);
  TORCH_CHECK(k > 0 && codes.size(1) == (k + 1) / 2, "mxplus_cpu: weight codes ", codes.sizes(),
              " do not hold K=", k);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                  scales.size(0) == N && scales.size(1) == (k + block - 1) / block,
              "mxplus_cpu: weight scales must be contiguous uint8 [", N, ", ",
              (k + block - 1) / block, "], got ", scales.sizes(), " ", scales.scalar_type());
  const bool has_mbs = mbs.numel() > 0;
  if (has_mbs) {
    TORCH_CHECK(macro > 0 && macro % 16 == 0 && block == 16,
                "mxplus_cpu: MBS needs block 16 and a macro block multiple of 16");
    TORCH_CHECK(mbs.dim() == 2 && mbs.scalar_type() == at::kByte && mbs.is_contiguous() &&
                    mbs.size(0) == N && mbs.size(1) == (k + macro - 1) / macro,
                "mxplus_cpu: weight MBS bytes must be contiguous uint8 [", N, ", ",
                (k + macro - 1) / macro, "], got ", mbs.sizes());
  }
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu() && mbs.device().is_cpu(),
              "mxplus_cpu: weights must be on the CPU");
  return PackedWeight{codes.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
                      has_mbs ? mbs.data_ptr<uint8_t>() : nullptr,
                      k, codes.size(1), scales.size(1), has_mbs ? mbs.size(1) : 0, block,
                      has_mbs ? macro : 128, block == 16 ? 4 : 5};
}

// The whole weight [N, K] dequantized to fp32.
at::Tensor dequant_all(const PackedWeight& w, int64_t N, const at::TensorOptions& opts) {
  at::Tensor out = at::empty({N, w.K}, opts.dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    dequant_rows(w, op + n0 * w.K, n0, n1);
  });
  return out;
}

at::Tensor dequant_weight(const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& mbs, int64_t k, int64_t block, int64_t macro) {
  return dequant_all(packed_weight(codes, scales, mbs, k, block, macro), codes.size(0),
                     codes.options());
}

// y = fakequant_act(x) @ W_hat^T + bias, fp32 accumulation, cast to out_dtype.
// Rows M <= gemv_max_m stream the packed weight; larger M dequantize it once per call to fp32
// and use torch's GEMM (the same values, another accumulation order).
at::Tensor mx_linear(const at::Tensor& x, int64_t act_block, int64_t act_rule, bool act_mbs,
                     int64_t macro, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& mbs, int64_t k, int64_t w_block,
                     const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                     int64_t gemv_max_m) {
  check_rule(act_block, act_rule, act_mbs, macro);
  TORCH_CHECK(x.device().is_cpu(), "mxplus_cpu.mx_linear: x must be on the CPU");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "mxplus_cpu.mx_linear: x has last dim ",
              x.size(-1), " but the weight has K=", k);
  const PackedWeight w = packed_weight(codes, scales, mbs, k, w_block, macro);
  const int64_t N = codes.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  const int64_t M = x.numel() / k;
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "mxplus_cpu.mx_linear: bias has ", bias->numel(),
                " elements, expected N=", N);
    bias_f = bias->to(at::kFloat).contiguous();
  }
  if (M == 0) return at::empty(out_shape, x.options().dtype(out_dtype));
  const at::Tensor xq = fake_quant_2d(x.reshape({M, k}), act_block, act_rule, act_mbs, macro);
  at::Tensor y;
  if (M <= gemv_max_m) {
    y = at::empty({M, N}, xq.options());
    gemv(w, xq.data_ptr<float>(), M, y.data_ptr<float>(), N,
         bias_f.defined() ? bias_f.data_ptr<float>() : nullptr);
  } else {
    const at::Tensor wf = dequant_all(w, N, codes.options());
    y = bias_f.defined() ? at::addmm(bias_f, xq, wf.t()) : at::mm(xq, wf.t());
  }
  return y.to(out_dtype).view(out_shape);
}

}  // namespace

TORCH_LIBRARY(mxplus_cpu, m) {
  m.def("act_fake_quant(Tensor x, int block, int rule, bool mbs, int macro) -> Tensor");
  m.def("dequant_weight(Tensor codes, Tensor scales, Tensor mbs, int k, int block, int macro)"
        " -> Tensor");
  m.def("mx_linear(Tensor x, int act_block, int act_rule, bool act_mbs, int macro, "
        "Tensor codes, Tensor scales, Tensor mbs, int k, int w_block, Tensor? bias, "
        "ScalarType out_dtype, int gemv_max_m) -> Tensor");
}

TORCH_LIBRARY_IMPL(mxplus_cpu, CPU, m) {
  m.impl("act_fake_quant", &act_fake_quant);
  m.impl("dequant_weight", &dequant_weight);
  m.impl("mx_linear", &mx_linear);
}

}  // namespace mxplus_cpu
