// Shared scalar helpers of the CPU kernels (the E8M0 formats of docs/numerics.md): fp32 bit
// access, exact powers of two, the E8M0 scale rules, E2M1 rounding and the MBS factors.
// Every function here is the scalar form of a `vllm_mxplus.formats` function, bit for bit
// (and cpu_kernel, how each translation unit registers its ops).
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>

#if (defined(__AVX512F__) && defined(__AVX512BW__)) || defined(__F16C__) || \
    (defined(__x86_64__) && defined(__GNUC__))
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MXPLUS_AVX512 1
#endif

namespace mxplus_cpu {

// cpu_kernels.RULE_IDS; kRuleMxplus: `ocp` block 32, the block max keeps 3 mantissa bits
constexpr int kRuleOcp = 0, kRuleFloor = 1, kRuleOas = 2, kRuleMxplus = 3;
constexpr int kE8m0Nan = 255;                               // E8M0_NAN
constexpr int kE8m0Bias = 127;                              // E8M0_BIAS
constexpr uint32_t kFloorMantissa = 0x400000;               // FLOOR_MANTISSA
constexpr uint32_t kOasMantissa = 0x600000;                 // OAS_MANTISSA
constexpr int kMbsDenom = 256;                              // MBS_DENOM
constexpr uint32_t kMbsStaticMask = 0x007F8000;             // MBS_STATIC_MASK
constexpr int kMbsStaticShift = 15;                         // MBS_STATIC_SHIFT

alignas(64) inline const float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,
                                            4.0f,  6.0f,  -0.0f, -0.5f, -1.0f, -1.5f,
                                            -2.0f, -3.0f, -4.0f, -6.0f};
// 2 * value(code): an exact integer in [-12, 12] (the integer GEMM's element).
alignas(16) inline const int8_t kE2M1x2[16] = {0, 1,  2,  3,  4,  6,  8,  12,
                                               0, -1, -2, -3, -4, -6, -8, -12};

inline uint32_t f2u(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// Exact fp32 2^k for integer k in [-149, 127].
inline float pow2f(int k) {
  if (k >= -126) return u2f(static_cast<uint32_t>(k + 127) << 23);
  return u2f(1u << (k + 149));
}

// fp32 value of an E8M0 code (255 = NaN).
inline float e8m0_value(int code) {
  return code == kE8m0Nan ? std::numeric_limits<float>::quiet_NaN() : pow2f(code - kE8m0Bias);
}

// E8M0 code of a block absmax under a scale rule (formats/e8m0.py: e8m0_block_scale).
inline int scale_code(float absmax, int rule) {
  if (!std::isfinite(absmax)) return kE8m0Nan;
  if (absmax == 0.0f) return 0;
  float an = absmax;
  int sub = 0;
  if (an < 1.17549435e-38f) { an *= 18446744073709551616.0f; sub = 64; }  // 2^64, exact
  const uint32_t b = f2u(an);
  const int e = static_cast<int>((b >> 23) & 0xFF) - 127 - sub;
  const uint32_t man = b & 0x7FFFFF;
  int d = 0;
  if (rule == kRuleFloor) d = man > kFloorMantissa;
  if (rule == kRuleOas) d = man > kOasMantissa;
  return std::min(std::max(e - 2 + d + kE8m0Bias, 0), 254);
}

// E2M1 magnitude code of a non-negative scaled value (round to nearest, ties to even code).
inline int e2m1_mag(float v) {
  return (v > 0.25f) + (v >= 0.75f) + (v > 1.25f) + (v >= 1.75f) + (v > 2.5f) + (v >= 3.5f) +
         (v > 5.0f);
}

// The MBS factor F = 1 + m/256 of a byte m (exact in fp32).
inline float mbs_factor(int m) {
  return (static_cast<float>(m) + kMbsDenom) / static_cast<float>(kMbsDenom);
}

// The MBS-S byte of a macro block with absmax a (paper eq. 3; 0 for a = 0, NaN or Inf).
inline int mbs_static_byte(float a) {
  if (!std::isfinite(a)) return 0;
  return static_cast<int>((f2u(6.0f / a) & kMbsStaticMask) >> kMbsStaticShift);
}

// max |v| over n values, NaN if any is NaN.
inline float nan_absmax(const float* v, int64_t n) {
#ifdef MXPLUS_AVX512
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  __m512 mx = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lm = n - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 a = _mm512_and_ps(_mm512_maskz_loadu_ps(lm, v + i), absmask);
    nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, a);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(mx);
#else
  float a = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float t = std::fabs(v[i]);
    if (std::isnan(t)) return t;
    a = t > a ? t : a;
  }
  return a;
#endif
}

inline void check_rule(int64_t block, int64_t rule, bool mbs, int64_t macro) {
  TORCH_CHECK(block == 16 || block == 32, "mxplus CPU kernels: block size must be 16 or 32, got ",
              block);
  TORCH_CHECK(rule >= kRuleOcp && rule <= kRuleMxplus, "mxplus CPU kernels: unknown scale rule ",
              rule);
  TORCH_CHECK(rule != kRuleMxplus || (block == 32 && !mbs),
              "mxplus CPU kernels: MX+ takes block 32 without MBS");
  TORCH_CHECK(!mbs || (macro > 0 && macro % block == 0), "mxplus CPU kernels: macro block ",
              macro, " must be a positive multiple of ", block);
}

// Whether value(code) * 2^(scale - 127) overflows fp32 (to +-Inf in the spec: E8M0 codes 253
// and 254 with |value| >= 4 and >= 2). `twice` = 2 * |value| (MX+ block max: 8 .. 15).
inline bool overflows(int scale, int twice) {
  return (scale == 254 && twice >= 4) || (scale == 253 && twice >= 8);
}

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// An op's kernel for the CPU dispatch key, for Library::def: each translation unit's
// TORCH_LIBRARY_FRAGMENT defines its ops together with their kernels (the ops' fakes, for
// torch.compile, are backends/cpu/fakes.py).
template <class Fn>
torch::CppFunction cpu_kernel(Fn* fn) {
  return torch::dispatch(c10::DispatchKey::CPU, fn);
}

// ---- shared between the quantization and the GEMM translation units ----------------------

// x [..., k] as contiguous rows [M, k] in its own dtype where that is fp32, bf16 or fp16 (each
// row read as fp32 by row_f32, exactly: no fp32 copy of x), as fp32 otherwise.
inline at::Tensor rows_operand(const at::Tensor& x, int64_t k) {
  at::Tensor x2 = x.reshape({-1, k});
  const at::ScalarType xt = x2.scalar_type();
  if (xt != at::kFloat && xt != at::kBFloat16 && xt != at::kHalf) x2 = x2.to(at::kFloat);
  return x2.contiguous();
}

// Row `row` of x (fp32, bf16 or fp16, contiguous [M, k]) as fp32: x's own memory, or buf.
inline const float* row_f32(const at::Tensor& x, int64_t row, int64_t k, float* buf) {
  switch (x.scalar_type()) {
    case at::kFloat:
      return x.data_ptr<float>() + row * k;
    case at::kBFloat16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(x.data_ptr()) + row * k;
      for (int64_t i = 0; i < k; ++i) buf[i] = u2f(static_cast<uint32_t>(p[i]) << 16);
      return buf;
    }
    default: {
      const at::Half* p = x.data_ptr<at::Half>() + row * k;
      int64_t i = 0;
#ifdef __F16C__
      for (; i + 8 <= k; i += 8)  // vcvtph2ps: exact, as the scalar conversion
        _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(p + i))));
#endif
      for (; i < k; ++i) buf[i] = static_cast<float>(p[i]);
      return buf;
    }
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// 16 fp32 outputs rounded to bf16 bits in int32 lanes: to nearest even, a NaN 0x7FC0. Compiled
// for AVX-512 whatever the build's target (the AMX GEMMs' store_outputs runs in every x86-64
// build, on AVX-512 hosts only; round_outputs in the AVX-512 build).
__attribute__((target("avx512f,avx512bw"))) inline __m512i bf16_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC0));
}
#endif

// len fp32 outputs y rounded to bf16 (`bf16`) or fp16 at o: round to nearest even, a NaN stays
// a NaN (bf16: 0x7FC0, as the AMX GEMMs' store_outputs and at::BFloat16; fp16: the sign and
// 0x7E00, as at::Half). The integer GEMMs' last step, in the task that wrote y
// (LinearCall::store).
inline void round_outputs(const float* y, uint16_t* o, int64_t len, bool bf16) {
  int64_t i = 0;
  if (bf16) {
#ifdef MXPLUS_AVX512
    for (; i + 16 <= len; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i),
                          _mm512_cvtepi32_epi16(bf16_bits16(_mm512_loadu_ps(y + i))));
#endif
    for (; i < len; ++i) o[i] = at::BFloat16(y[i]).x;  // torch's rounding: the same bits
    return;
  }
#ifdef __F16C__
  for (; i + 8 <= len; i += 8)  // vcvtps2ph: round to nearest even, as at::Half's conversion
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(y + i), _MM_FROUND_TO_NEAREST_INT));
#endif
  for (; i < len; ++i) o[i] = at::Half(y[i]).x;
}

// Quantize one activation row to what the integer GEMM multiplies (docs/numerics.md,
// "E8M0 block scales" and "Macro Block Scaling"): `codes` [cdiv(K, block) * block] get
// 2 * value(code) (zero past K and in NaN blocks), `scales` [cdiv(K, block)] the E8M0 codes,
// `mbs` [cdiv(K, macro)] the MBS-S bytes (only when `mbs_on`), `sums` (if not null) the sum
// of each block's codes. Bit-exact with formats.quantize(x, fmt); with `mbs_on`, `ybuf`
// holds K floats of scratch (without, it is not read and may be null).
void quant_row(const float* x, int64_t K, int64_t block, int rule, bool mbs_on, int64_t macro,
               int8_t* codes, uint8_t* scales, uint8_t* mbs, int32_t* sums, float* ybuf);

}  // namespace mxplus_cpu
