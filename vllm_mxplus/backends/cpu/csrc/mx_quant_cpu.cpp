// CPU quantization ops of the E8M0 formats (docs/numerics.md, "E2M1 elements", "E8M0 block
// scales", "Macro Block Scaling", "MX+"):
//  - cpu_act_quant: activation rows -> the integer GEMM's input (2 * E2M1 value as int8,
//    E8M0 codes, MBS-S bytes), bit-exact with formats.quantize;
//  - cpu_act_fake_quant: the dequantized activation value*X/F in fp32, bit-exact with
//    formats.fake_quantize (the `mxplus kernels --check` self-test and the tests use it);
//  - cpu_dequant_weight: a checkpoint-layout packed weight dequantized to fp32, bit-exact with
//    QuantizedTensor.dequantize (tests and self-test only: no serving path keeps fp32 weights).
// Compiled with -ffp-contract=off: each fp32 operation rounds exactly as torch's does.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "mx_cpu_common.h"

namespace mxplus_cpu {

namespace {

// MX+ (docs/numerics.md, "MX+"): the block's first largest |y|, scaled value v = |y| / X, keeps
// 3 mantissa bits when v >= 4: 2 * value = 8 + j, j = round_half_even(2v - 8) clamped to 0..7
// (2v - 8 is exact for v in [4, 8)). Replaces that element's doubled E2M1 code and its share
// of *sum.
inline void mxplus_block_max(const float* y, int64_t len, int code, int8_t* out, int32_t* sum) {
  int64_t im = 0;
  float am = std::fabs(y[0]);
  for (int64_t i = 1; i < len; ++i)
    if (std::fabs(y[i]) > am) am = std::fabs(y[im = i]);
  const float v = am * pow2f(kE8m0Bias - code);
  if (!(v >= 4.0f)) return;  // none: zero block, or clamped at the bottom of the E8M0 range
  const int j = std::min(std::max(static_cast<int>(std::nearbyint(2.0f * v - 8.0f)), 0), 7);
  const int8_t c = static_cast<int8_t>(std::signbit(y[im]) ? -(8 + j) : 8 + j);
  if (sum) *sum += c - out[im];
  out[im] = c;
}

#ifdef MXPLUS_AVX512
// The E2M1 rounding of e2m1_mag, 16 lanes: v >= 0 finite rounded to the nearest of 0, 0.5,
// 1, 1.5, 2, 3, 4, 6, ties to the even code (e2m1_mag's thresholds: > at 0.25, 1.25, 2.5, 5;
// >= at 0.75, 1.75, 3.5), returned doubled (the int8 code 2 * value). On the grid's spacing s
// (0.5 below 2, 1 below 4, 2 above) adding and subtracting 1.5 * 2^23 * s rounds to a
// multiple of s ties to even, which is the even code: the two are the same function of v.
inline __m512i e2m1_doubled(__m512 v) {
  __m512 c = _mm512_set1_ps(6291456.0f);  // 1.5 * 2^22: spacing 0.5
  c = _mm512_mask_mov_ps(c, _mm512_cmp_ps_mask(v, _mm512_set1_ps(2.0f), _CMP_GE_OQ),
                         _mm512_set1_ps(12582912.0f));  // 1.5 * 2^23: spacing 1
  c = _mm512_mask_mov_ps(c, _mm512_cmp_ps_mask(v, _mm512_set1_ps(4.0f), _CMP_GE_OQ),
                         _mm512_set1_ps(25165824.0f));  // 1.5 * 2^24: spacing 2
  const __m512 r = _mm512_min_ps(_mm512_sub_ps(_mm512_add_ps(v, c), c), _mm512_set1_ps(6.0f));
  return _mm512_cvttps_epi32(_mm512_add_ps(r, r));
}

// A vector of 16 values y, times recip (their block's 2^(127 - code)): the signed doubled
// E2M1 codes as int32 lanes (quant_block's rounding, the sign from y's sign bit).
inline __m512i signed_codes(__m512 yv, __m512 recip) {
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512i d = e2m1_doubled(_mm512_mul_ps(_mm512_and_ps(yv, absmask), recip));
  const __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(yv));  // the sign bit
  return _mm512_mask_sub_epi32(d, neg, _mm512_setzero_si512(), d);
}

#endif

// Quantize one block of len <= 32 values y to doubled E2M1 codes (MX+: the block max as
// above); returns the E8M0 code and sets *sum (where not null) to the sum of the codes.
inline int quant_block(const float* y, int64_t len, int rule, int8_t* out, int32_t* sum) {
  const int code = scale_code(nan_absmax(y, len), rule);
  if (sum) *sum = 0;
  if (code == kE8m0Nan) {
    std::memset(out, 0, len);
    return code;
  }
  const float recip = pow2f(kE8m0Bias - code);  // exact power of two, as formats does
#ifdef MXPLUS_AVX512
  for (int64_t i = 0; i < len; i += 16) {
    const __mmask16 lm = len - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - i)) - 1);
    const __m512i d = signed_codes(_mm512_maskz_loadu_ps(lm, y + i), _mm512_set1_ps(recip));
    if (sum) *sum += _mm512_reduce_add_epi32(d);  // masked-off lanes are 0
    _mm512_mask_cvtepi32_storeu_epi8(out + i, lm, d);
  }
#else
  for (int64_t i = 0; i < len; ++i) {
    const int mag = e2m1_mag(std::fabs(y[i]) * recip);
    out[i] = kE2M1x2[mag | (std::signbit(y[i]) ? 8 : 0)];
    if (sum) *sum += out[i];
  }
#endif
  if (rule == kRuleMxplus) mxplus_block_max(y, len, code, out, sum);
  return code;
}

#ifdef MXPLUS_AVX512
// scale_code of 16 block maxima (NaN where a block holds a NaN) at once.
inline __m512i scale_codes(__m512 a, int rule) {
  const __mmask16 finite = _mm512_cmp_ps_mask(a, _mm512_set1_ps(3.40282347e+38f), _CMP_LE_OQ);
  const __mmask16 zero = _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_EQ_OQ);
  const __mmask16 sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.17549435e-38f), _CMP_LT_OQ);
  const __m512 an = _mm512_mask_mul_ps(a, sub, a, _mm512_set1_ps(18446744073709551616.0f));
  const __m512i b = _mm512_castps_si512(an);
  __m512i e = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 23), _mm512_set1_epi32(0xFF)),
                               _mm512_set1_epi32(127));
  e = _mm512_mask_sub_epi32(e, sub, e, _mm512_set1_epi32(64));
  const __m512i man = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFF));
  if (rule == kRuleFloor || rule == kRuleOas) {
    const uint32_t t = rule == kRuleFloor ? kFloorMantissa : kOasMantissa;
    e = _mm512_mask_add_epi32(e, _mm512_cmpgt_epu32_mask(man, _mm512_set1_epi32(static_cast<int>(t))),
                              e, _mm512_set1_epi32(1));
  }
  __m512i code = _mm512_add_epi32(e, _mm512_set1_epi32(kE8m0Bias - 2));
  code = _mm512_max_epi32(_mm512_min_epi32(code, _mm512_set1_epi32(254)), _mm512_setzero_si512());
  code = _mm512_mask_mov_epi32(code, zero, _mm512_setzero_si512());
  return _mm512_mask_mov_epi32(code, static_cast<__mmask16>(~finite), _mm512_set1_epi32(kE8m0Nan));
}

// Lanes [0, 8) the max of a's two halves, [8, 16) b's (the lanes of one result as
// pairs: kHalves picks each lane's two sources).
struct Halves {
  alignas(64) int32_t lo[4][16], hi[4][16];
  constexpr Halves() : lo(), hi() {
    // level l merges vectors whose blocks hold 16 >> l lanes each into blocks of 8 >> l
    for (int l = 0; l < 4; ++l) {
      const int w = 8 >> l;  // lanes per block in the result
      for (int o = 0; o < 16; ++o) {
        const int src = o < 8 ? 0 : 16, j = o % 8, blk = j / w, lane = j % w;
        lo[l][o] = src + blk * 2 * w + lane;
        hi[l][o] = src + blk * 2 * w + w + lane;
      }
    }
  }
};
constexpr Halves kHalves{};

// nan_absmax of gn <= 16 whole blocks of 16 or 32 values at y, as one vector (lane b: block
// b; 0 past gn). |y| is compared as integer bits: NaN's bits exceed Inf's and every finite
// value's, so a block with a NaN gets a NaN (scale_codes: the NaN code) as nan_absmax gives.
inline __m512 group_absmax(const float* y, int64_t block, int64_t gn) {
  const __m512i absbits = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i v[16];
  for (int b = static_cast<int>(gn); b < 16; ++b) v[b] = _mm512_setzero_si512();
  for (int b = 0; b < gn; ++b) {
    __m512i a = _mm512_and_si512(_mm512_loadu_si512(y + b * block), absbits);
    for (int64_t j = 16; j < block; j += 16)
      a = _mm512_max_epu32(a, _mm512_and_si512(_mm512_loadu_si512(y + b * block + j), absbits));
    v[b] = a;
  }
  for (int l = 0, n = 16; l < 4; ++l, n /= 2) {
    const __m512i lo = _mm512_load_si512(kHalves.lo[l]), hi = _mm512_load_si512(kHalves.hi[l]);
    for (int i = 0; i < n / 2; ++i)
      v[i] = _mm512_max_epu32(_mm512_permutex2var_epi32(v[2 * i], lo, v[2 * i + 1]),
                              _mm512_permutex2var_epi32(v[2 * i], hi, v[2 * i + 1]));
  }
  return _mm512_castsi512_ps(v[0]);
}

// The codes of 16 whole blocks at y (block 16 or 32), rc[b] block b's 2^(127 - code): as
// quant_block's loop, four 16-value vectors to one 64-byte store; with sums, each block's sum
// of codes (sums[0..16)).
inline void group_codes(const float* y, int64_t block, const float* rc, int8_t* out,
                        int32_t* sums) {
  if (sums) std::memset(sums, 0, 16 * sizeof(int32_t));
  const int64_t vpb = block / 16;  // vectors per block
  for (int64_t w0 = 0; w0 < 16 * vpb; w0 += 4) {
    __m128i part[4];
    for (int q = 0; q < 4; ++q) {
      const __m512i d = signed_codes(_mm512_loadu_ps(y + (w0 + q) * 16),
                                     _mm512_set1_ps(rc[(w0 + q) / vpb]));
      if (sums) sums[(w0 + q) / vpb] += _mm512_reduce_add_epi32(d);
      part[q] = _mm512_cvtepi32_epi8(d);
    }
    __m512i v = _mm512_castsi128_si512(part[0]);
    v = _mm512_inserti32x4(v, part[1], 1);
    v = _mm512_inserti32x4(v, part[2], 2);
    v = _mm512_inserti32x4(v, part[3], 3);
    _mm512_storeu_si512(out + w0 * 16, v);
  }
}

// quant_block for every block of y[0, len) (rules other than MX+), the blocks' scale codes 16
// at a time: the same codes, scales and sums.
void quant_blocks(const float* y, int64_t len, int64_t block, int rule, int8_t* out,
                  uint8_t* scales, int32_t* sums) {
  const int64_t nb = cdiv(len, block);
  for (int64_t g0 = 0; g0 < nb; g0 += 16) {
    const int64_t gn = std::min<int64_t>(16, nb - g0);
    __m512 amv;
    if ((g0 + gn) * block <= len) {  // whole blocks (check_rule: 16 or 32 values)
      amv = group_absmax(y + g0 * block, block, gn);
    } else {
      alignas(64) float am[16] = {};
      for (int64_t i = 0; i < gn; ++i) {
        const int64_t b0 = (g0 + i) * block;
        am[i] = nan_absmax(y + b0, std::min(block, len - b0));
      }
      amv = _mm512_load_ps(am);
    }
    const __m512i code = scale_codes(amv, rule);
    // 2^(127 - code): normal down to code 253, 2^-127 (subnormal) for 254
    __m512i rb = _mm512_slli_epi32(_mm512_sub_epi32(_mm512_set1_epi32(254), code), 23);
    rb = _mm512_mask_mov_epi32(rb, _mm512_cmpeq_epi32_mask(code, _mm512_set1_epi32(254)),
                               _mm512_set1_epi32(1 << 22));
    alignas(64) int32_t cd[16];
    alignas(64) float rc[16];
    _mm512_store_si512(cd, code);
    _mm512_store_si512(rc, rb);
    if (gn == 16 && (g0 + 16) * block <= len) {  // 16 whole blocks
      group_codes(y + g0 * block, block, rc, out + g0 * block, sums ? sums + g0 : nullptr);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(scales + g0), _mm512_cvtepi32_epi8(code));
      // a NaN block's codes are zero, and so is their sum (its recip above is not a scale)
      for (__mmask16 nan = _mm512_cmpeq_epi32_mask(code, _mm512_set1_epi32(kE8m0Nan)); nan;
           nan &= static_cast<__mmask16>(nan - 1)) {
        const int b = __builtin_ctz(nan);
        std::memset(out + (g0 + b) * block, 0, block);
        if (sums) sums[g0 + b] = 0;
      }
      continue;
    }
    for (int64_t i = 0; i < gn; ++i) {
      const int64_t b = g0 + i, b0 = b * block, blen = std::min(block, len - b0);
      scales[b] = static_cast<uint8_t>(cd[i]);
      int32_t sum = 0;
      if (cd[i] == kE8m0Nan) {
        std::memset(out + b0, 0, blen);
      } else {
        const __m512 recip = _mm512_set1_ps(rc[i]);
        for (int64_t j = 0; j < blen; j += 16) {
          const __mmask16 lm =
              blen - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (blen - j)) - 1);
          const __m512i d = signed_codes(_mm512_maskz_loadu_ps(lm, y + b0 + j), recip);
          if (sums) sum += _mm512_reduce_add_epi32(d);  // masked-off lanes are 0
          _mm512_mask_cvtepi32_storeu_epi8(out + b0 + j, lm, d);
        }
      }
      if (sums) sums[b] = sum;
    }
  }
}
#endif

}  // namespace

void quant_row(const float* x, int64_t K, int64_t block, int rule, bool mbs_on, int64_t macro,
               int8_t* codes, uint8_t* scales, uint8_t* mbs, int32_t* sums, float* ybuf) {
  // y = fp32(x * F) per macro block into ybuf first (the macro blocks' factors are independent
  // of one another), then the whole row's blocks: a block never crosses a macro block
  // (macro % block == 0), so each block's codes are those of its own macro block's y.
  const float* y = x;
  if (mbs_on) {
    for (int64_t u0 = 0; u0 < K; u0 += macro) {
      const int64_t ulen = std::min(macro, K - u0);
      const int m = mbs_static_byte(nan_absmax(x + u0, ulen));
      mbs[u0 / macro] = static_cast<uint8_t>(m);
      const float F = mbs_factor(m);
      for (int64_t i = 0; i < ulen; ++i) ybuf[u0 + i] = x[u0 + i] * F;
    }
    y = ybuf;
  }
#ifdef MXPLUS_AVX512
  if (rule != kRuleMxplus) {
    quant_blocks(y, K, block, rule, codes, scales, sums);
  } else
#endif
  {
    for (int64_t b0 = 0; b0 < K; b0 += block) {
      const int64_t blen = std::min(block, K - b0);
      int32_t sum;
      scales[b0 / block] = static_cast<uint8_t>(
          quant_block(y + b0, blen, rule, codes + b0, sums ? &sum : nullptr));
      if (sums) sums[b0 / block] = sum;
    }
  }
  const int64_t kp = cdiv(K, block) * block;
  if (kp > K) std::memset(codes + K, 0, kp - K);
}

namespace {

// One row of fake-quantization (fp32 in and out): quant_row, then value * X / F.
void fake_quant_row(const float* x, float* out, int64_t K, int64_t block, int rule, bool mbs,
                    int64_t macro, int8_t* codes, uint8_t* scales, uint8_t* mbytes,
                    float* ybuf) {
  quant_row(x, K, block, rule, mbs, macro, codes, scales, mbytes, nullptr, ybuf);
  for (int64_t k = 0; k < K; ++k) {
    const int sc = scales[k / block];
    if (sc == kE8m0Nan) {
      out[k] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    // value(code) = codes/2 exactly; a zero code keeps the sign of y = x * F, i.e. of x
    // (formats' -0.0).
    float val = 0.5f * static_cast<float>(codes[k]);
    if (codes[k] == 0 && std::signbit(x[k])) val = -0.0f;
    const float q = val * pow2f(sc - kE8m0Bias);
    out[k] = mbs ? q / mbs_factor(mbytes[k / macro]) : q;
  }
}

at::Tensor act_fake_quant(const at::Tensor& x, int64_t block, int64_t rule, bool mbs,
                          int64_t macro) {
  check_rule(block, rule, mbs, macro);
  TORCH_CHECK(x.device().is_cpu(), "vllm_mxplus::cpu_act_fake_quant: x must be on the CPU");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "vllm_mxplus::cpu_act_fake_quant: empty last dim");
  const int64_t K = x.size(-1);
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor out = at::empty({M, K}, xf.options());
  const float* xp = xf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> ybuf(mbs ? K : 0);
    std::vector<int8_t> codes(cdiv(K, block) * block);
    std::vector<uint8_t> scales(cdiv(K, block)), mbytes(cdiv(K, macro));
    for (int64_t r = r0; r < r1; ++r)
      fake_quant_row(xp + r * K, op + r * K, K, block, static_cast<int>(rule), mbs, macro,
                     codes.data(), scales.data(), mbytes.data(), ybuf.data());
  });
  return out.view(x.sizes());
}

// x [..., K] -> (codes int8 [M, K] = 2 * value, scales uint8 [M, nb], mbs uint8 [M, nm] or
// [M, 0]): the integer GEMM's activation operand, exposed so tests compare it with formats.
std::tuple<at::Tensor, at::Tensor, at::Tensor> act_quant(const at::Tensor& x, int64_t block,
                                                         int64_t rule, bool mbs,
                                                         int64_t macro) {
  check_rule(block, rule, mbs, macro);
  TORCH_CHECK(x.device().is_cpu(), "vllm_mxplus::cpu_act_quant: x must be on the CPU");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "vllm_mxplus::cpu_act_quant: empty last dim");
  const int64_t K = x.size(-1), nb = cdiv(K, block), kp = nb * block;
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor codes = at::empty({M, kp}, xf.options().dtype(at::kChar));
  at::Tensor scales = at::empty({M, nb}, xf.options().dtype(at::kByte));
  at::Tensor mbytes = at::zeros({M, mbs ? cdiv(K, macro) : 0}, xf.options().dtype(at::kByte));
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> ybuf(mbs ? K : 0);
    for (int64_t r = r0; r < r1; ++r)
      quant_row(xf.data_ptr<float>() + r * K, K, block, static_cast<int>(rule), mbs, macro,
                codes.data_ptr<int8_t>() + r * kp, scales.data_ptr<uint8_t>() + r * nb,
                mbs ? mbytes.data_ptr<uint8_t>() + r * mbytes.size(1) : nullptr, nullptr,
                ybuf.data());
  });
  return {codes.narrow(1, 0, K).contiguous(), scales, mbytes};
}

// ---- checkpoint-layout weights (tests and the self-test) --------------------------------

at::Tensor dequant_weight(const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& mbs, int64_t k, int64_t block, int64_t macro) {
  TORCH_CHECK(block == 16 || block == 32, "vllm_mxplus::cpu_dequant_weight: block must be 16 or "
              "32, got ", block);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && k > 0 &&
                  codes.size(1) == (k + 1) / 2,
              "vllm_mxplus::cpu_dequant_weight: weight codes must be uint8 [N, ceil(K/2)] for K=",
              k, ", got ", codes.sizes(), " ", codes.scalar_type());
  const int64_t N = codes.size(0), nb = cdiv(k, block);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kByte && scales.size(0) == N &&
                  scales.size(1) == nb,
              "vllm_mxplus::cpu_dequant_weight: weight scales must be uint8 [", N, ", ", nb,
              "], got ", scales.sizes());
  const bool has_mbs = mbs.numel() > 0;
  TORCH_CHECK(!has_mbs || (mbs.dim() == 2 && mbs.size(0) == N && mbs.size(1) == cdiv(k, macro)),
              "vllm_mxplus::cpu_dequant_weight: weight MBS bytes must be uint8 [", N, ", ",
              cdiv(k, macro), "], got ", mbs.sizes());
  const at::Tensor c = codes.contiguous(), s = scales.contiguous(), mb = mbs.contiguous();
  at::Tensor out = at::empty({N, k}, codes.options().dtype(at::kFloat));
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
  const uint8_t* mp = has_mbs ? mb.data_ptr<uint8_t>() : nullptr;
  float* op = out.data_ptr<float>();
  const int64_t kc = c.size(1), nm = has_mbs ? mb.size(1) : 0;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t kk = 0; kk < k; ++kk) {
        const uint8_t byte = cp[n * kc + (kk >> 1)];
        const int code = (kk & 1) ? (byte >> 4) : (byte & 0xF);
        const float q = kE2M1[code] * e8m0_value(sp[n * nb + kk / block]);  // (value * X) / F
        op[n * k + kk] = mp ? q / mbs_factor(mp[n * nm + kk / macro]) : q;
      }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mxplus, m) {
  m.def("cpu_act_fake_quant(Tensor x, int block, int rule, bool mbs, int macro) -> Tensor",
        cpu_kernel(&act_fake_quant));
  m.def("cpu_act_quant(Tensor x, int block, int rule, bool mbs, int macro) -> "
        "(Tensor, Tensor, Tensor)",
        cpu_kernel(&act_quant));
  m.def("cpu_dequant_weight(Tensor codes, Tensor scales, Tensor mbs, int k, int block, "
        "int macro) -> Tensor",
        cpu_kernel(&dequant_weight));
}

}  // namespace mxplus_cpu
