// NVFP4 on the CPU integer path (docs/numerics.md, "NVFP4"): E2M1 elements, E4M3 block-16
// scales s and an fp32 global scale g (per weight row, per activation row):
//
//   y[m, n] = (sum over blocks b of I_b * (sa_b * sw_b)) * ((ga * gw) * 1/4)  (+ bias[n])
//   I_b     = sum over k in b of (2 va_k) * (2 vw_k)                          (exact int32)
//
// sa * sw is exact in fp32 (two 4-bit significands, exponents within fp32's normal range)
// and so is I_b * (sa * sw) (at most 12 + 8 bits): each block term enters the fp32 sum with
// one rounding (an FMA). Then ga * gw rounds once and the product with the sum once.
// Error bound against y64 = float64 sum of the spec's x_hat * w_hat + b (x_hat = (v * s) * g
// rounded once; n_b blocks; u = 2^-24):
//   |y - y64| <= (n_b + 6) * u * (sum_k |x_hat_k| |w_hat_k| + |b|) + 2^-146 * n_b * ga * gw
// (2u: the spec's roundings of x_hat and w_hat; n_b + 1 additions; 2u the global product and
// the final multiply; u for second-order terms; the absolute term: underflow of ga * gw).
// A block with the E4M3 NaN scale (NaN or Inf in it) makes its outputs NaN.
// The weight tiles are those of cpu_pack_weight (E4M3 bytes in place of E8M0 codes).

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <vector>

#include "mx_tile_avx2.h"
#include "mx_tile_avx512.h"

namespace mxplus_cpu {
namespace {

using namespace gemm_detail;

constexpr float kNvfp4Denom = 6.0f * 448.0f;  // E2M1_MAX * F8E4M3_MAX = 2688, exact
#if defined(MXPLUS_AVX2) && defined(__FMA__)
constexpr int kNvfp4TileM = 4;  // AVX2 has 16 vector registers: 4 rows of accumulators
#else
constexpr int kNvfp4TileM = kMaxTileM;
#endif

inline float e4m3_value(uint8_t b) {
  return static_cast<float>(c10::Float8_e4m3fn(b, c10::Float8_e4m3fn::from_bits()));
}

// One row (formats/nvfp4.py: quantize_nvfp4_blocks with per-row g): doubled codes [nb * 16],
// E4M3 scale bytes [nb], block code sums [nb]; g = amax / 2688 over finite |x| unless given
// (g_in >= 0). Returns g.
float nvfp4_quant_row(const float* x, int64_t K, float g_in, int8_t* codes, uint8_t* scales,
                      int32_t* sums) {
  float g = g_in;
  if (g < 0.0f) {
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k)
      if (std::isfinite(x[k])) amax = std::max(amax, std::fabs(x[k]));
    g = amax / kNvfp4Denom;
  }
  const int64_t nb = cdiv(K, 16);
  std::memset(codes + K, 0, nb * 16 - K);
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t len = std::min<int64_t>(16, K - b * 16);
    const float* xb = x + b * 16;
    const float absmax = nan_absmax(xb, len);
    float s32 = absmax / 6.0f / g;  // left to right, as formats
    if (!(g > 0.0f)) s32 = 0.0f;
    if (!std::isfinite(absmax)) s32 = std::numeric_limits<float>::quiet_NaN();
    const c10::Float8_e4m3fn s(std::isnan(s32) ? s32 : std::min(s32, 448.0f));
    scales[b] = s.x;
    const float sf = static_cast<float>(s);
    const bool zero = sf == 0.0f || !std::isfinite(sf);
    const float denom = zero ? 1.0f : sf * g;
    int32_t sum = 0;
    for (int64_t i = 0; i < len; ++i) {
      const int mag = zero ? 0 : e2m1_mag(std::fabs(xb[i]) / denom);
      codes[b * 16 + i] = kE2M1x2[mag | (std::signbit(xb[i]) ? 8 : 0)];
      sum += codes[b * 16 + i];
    }
    sums[b] = sum;
  }
  return g;
}

struct Nvfp4Rows {
  const int8_t* codes;  // [M, kp] 2 * value, zero padded
  const int32_t* corr;  // [M, nb] -12 * block code sums (the weight offset, as for E8M0)
  const float* sa;      // [M, nb] E4M3 scale values (NaN for a NaN block)
  const float* ga;      // [M] global scales
  int64_t kp, nb;
};

// y[m0 .. m0+MT, 16 rows of tile t]; gw: [nt * 16] weight-row global scales.
template <int MT>
void nvfp4_tile(const WeightTiles& w, const float* gw, const Nvfp4Rows& a, int64_t t,
                int64_t m0, float* y, const float* bias) {
  const int64_t n0 = t * kTileN;
  const int64_t valid = std::min<int64_t>(kTileN, w.n - n0);
#ifdef MXPLUS_AVX512
  const __m512i lut = weight_lut();
  const int8_t* xr[MT];
  for (int m = 0; m < MT; ++m) xr[m] = a.codes + (m0 + m) * a.kp;
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const __m512i sb = _mm512_cvtepu8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(w.scales + (t * w.nb + b) * kTileN)));
    // E4M3 bits 0eeeemmm placed at fp32 bits 26..20 read 2^-120 of the value (normal and
    // subnormal alike); 0x7F / 0xFF are NaN.
    const __m512i mag = _mm512_and_si512(sb, _mm512_set1_epi32(0x7F));
    __m512 sw = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)),
                              _mm512_set1_ps(1.329227995784916e36f));  // 2^120, exact
    sw = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(sw), _mm512_slli_epi32(_mm512_srli_epi32(sb, 7), 31)));
    sw = _mm512_mask_mov_ps(sw, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                            _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    __m512i iacc[1][MT];
    for (int m = 0; m < MT; ++m) iacc[0][m] = _mm512_set1_epi32(a.corr[(m0 + m) * a.nb + b]);
    const uint8_t* wg[1] = {w.codes + (t * w.groups + b) * kGroupBytes};
    group_dots<MT, 1>(wg, xr, b * kGroupK, lut, iacc, kTilePrefetchAhead);  // one tile a time
    for (int m = 0; m < MT; ++m)  // I * (sa * sw): the product is exact, the FMA rounds once
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[0][m]),
                               _mm512_mul_ps(sw, _mm512_set1_ps(a.sa[(m0 + m) * a.nb + b])),
                               acc[m]);
  }
  const __mmask16 lm = static_cast<__mmask16>((1u << valid) - 1);
  const __m512 gv = _mm512_loadu_ps(gw + n0);
  const __m512 bv = bias ? _mm512_maskz_loadu_ps(lm, bias + n0) : _mm512_setzero_ps();
  for (int m = 0; m < MT; ++m) {
    const __m512 G = _mm512_mul_ps(_mm512_mul_ps(gv, _mm512_set1_ps(a.ga[m0 + m])),
                                   _mm512_set1_ps(0.25f));
    const __m512 v = _mm512_mul_ps(acc[m], G);
    _mm512_mask_storeu_ps(y + (m0 + m) * w.n + n0, lm, bias ? _mm512_add_ps(v, bv) : v);
  }
#elif defined(MXPLUS_AVX2) && defined(__FMA__)
  // Half a tile (8 rows, one lane each) at a time; the same operations in the same order as
  // the portable loop below, so the same bits.
  static_assert(MT <= kNvfp4TileM, "AVX2: at most 4 activation rows per register tile");
  for (int h = 0; 8 * h < valid; ++h) {
    const int8_t* xr[MT];
    __m256 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.nb; ++b) {
      const __m256i sb = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(w.scales + (t * w.nb + b) * kTileN + 8 * h)));
      // E4M3 bits 0eeeemmm at fp32 bits 26..20 read 2^-120 of the value (as for AVX-512)
      const __m256i mag = _mm256_and_si256(sb, _mm256_set1_epi32(0x7F));
      __m256 sw = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)),
                                _mm256_set1_ps(1.329227995784916e36f));  // 2^120, exact
      sw = _mm256_castsi256_ps(_mm256_or_si256(
          _mm256_castps_si256(sw), _mm256_slli_epi32(_mm256_srli_epi32(sb, 7), 31)));
      sw = _mm256_blendv_ps(
          sw, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
          _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F))));
      __m256i iacc[MT];
      for (int m = 0; m < MT; ++m) {
        iacc[m] = dot_begin(a.corr[(m0 + m) * a.nb + b]);
        xr[m] = a.codes + (m0 + m) * a.kp + b * kGroupK;
      }
      group_dots8<MT>(w.codes + (t * w.groups + b) * kGroupBytes + 32 * h, xr, iacc);
      for (int m = 0; m < MT; ++m)  // I * (sa * sw): the product is exact, the FMA rounds once
        acc[m] = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(dot_end(iacc[m], a.corr[(m0 + m) * a.nb + b])),
            _mm256_mul_ps(sw, _mm256_set1_ps(a.sa[(m0 + m) * a.nb + b])), acc[m]);
    }
    const int64_t nh = n0 + 8 * h;
    for (int m = 0; m < MT; ++m) {
      alignas(32) float v[8];
      _mm256_store_ps(v, acc[m]);
      for (int64_t i = 0; i < 8 && nh + i < w.n; ++i) {
        const float r = v[i] * ((gw[nh + i] * a.ga[m0 + m]) * 0.25f);
        y[(m0 + m) * w.n + nh + i] = bias ? r + bias[nh + i] : r;
      }
    }
  }
#else
  for (int64_t i = 0; i < valid; ++i) {
    for (int m = 0; m < MT; ++m) {
      float acc = 0.0f;
      for (int64_t b = 0; b < w.nb; ++b) {
        const uint8_t* p = w.codes + (t * w.groups + b) * kGroupBytes;
        int32_t dot = 0;
        for (int j = 0; j < 16; ++j) {  // byte layout: see pack_weight in mx_gemm_cpu.cpp
          const uint8_t byte = p[(j >> 3) * 64 + 4 * i + (j & 3)];
          dot += kE2M1x2[(j & 4) ? (byte >> 4) : (byte & 0xF)] *
                 a.codes[(m0 + m) * a.kp + b * kGroupK + j];
        }
        const float sw = e4m3_value(w.scales[(t * w.nb + b) * kTileN + i]);
        acc = std::fma(static_cast<float>(dot), sw * a.sa[(m0 + m) * a.nb + b], acc);
      }
      const float v = acc * ((gw[n0 + i] * a.ga[m0 + m]) * 0.25f);
      y[(m0 + m) * w.n + n0 + i] = bias ? v + bias[n0 + i] : v;
    }
  }
#endif
}

template <int MT>
void nvfp4_rows(const WeightTiles& w, const float* gw, const Nvfp4Rows& a, int64_t t,
                int64_t m0, int64_t mt, float* y, const float* bias) {
  if constexpr (MT > 1) {
    if (mt < MT) return nvfp4_rows<MT - 1>(w, gw, a, t, m0, mt, y, bias);
  }
  nvfp4_tile<MT>(w, gw, a, t, m0, y, bias);
}

void check_tiles(const at::Tensor& t, at::IntArrayRef shape, at::ScalarType dt, const char* what) {
  TORCH_CHECK(t.scalar_type() == dt && t.is_contiguous() && t.sizes() == shape &&
                  t.device().is_cpu(),
              "vllm_mxplus::cpu_nvfp4_linear: ", what, " must be contiguous CPU ", dt, " ",
              shape, " (cpu_pack_weight), got ", t.scalar_type(), " ", t.sizes());
}

// x [..., K] -> (codes int8 [M, K] = 2 * value, E4M3 scale bytes uint8 [M, nb], g fp32 [M]).
std::tuple<at::Tensor, at::Tensor, at::Tensor> nvfp4_act_quant(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) > 0,
              "vllm_mxplus::cpu_nvfp4_act_quant: x must be a CPU tensor with K > 0");
  const int64_t K = x.size(-1), nb = cdiv(K, 16);
  const at::Tensor xf = x.reshape({-1, K}).to(at::kFloat).contiguous();
  const int64_t M = xf.size(0);
  at::Tensor codes = at::empty({M, nb * 16}, xf.options().dtype(at::kChar));
  at::Tensor scales = at::empty({M, nb}, xf.options().dtype(at::kByte));
  at::Tensor g = at::empty({M}, xf.options());
  std::vector<int32_t> sums(nb);
  for (int64_t r = 0; r < M; ++r)
    g.data_ptr<float>()[r] = nvfp4_quant_row(xf.data_ptr<float>() + r * K, K, -1.0f,
                                             codes.data_ptr<int8_t>() + r * nb * 16,
                                             scales.data_ptr<uint8_t>() + r * nb, sums.data());
  return {codes.narrow(1, 0, K).contiguous(), scales, g};
}

at::Tensor nvfp4_linear(const at::Tensor& x, const at::Tensor& wcodes, const at::Tensor& wscales,
                        const at::Tensor& wglobal, int64_t n, int64_t k,
                        const c10::optional<at::Tensor>& act_global,
                        const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const int64_t nb = cdiv(k, 16), kp = nb * 16, nt = cdiv(n, kTileN);
  LinearCall call =
      linear_call(x, n, k, 16, bias, out_dtype, 1, "vllm_mxplus::cpu_nvfp4_linear");
  check_tiles(wcodes, {nt, nb * kGroupBytes}, at::kByte, "packed weight codes");
  check_tiles(wscales, {nt, nb * kTileN}, at::kByte, "packed weight scales");
  check_tiles(wglobal, {nt * kTileN}, at::kFloat, "weight global scales");
  const int64_t M = call.M;
  at::Tensor g_in;
  if (act_global.has_value() && act_global->defined()) {
    TORCH_CHECK(act_global->numel() == M, "vllm_mxplus::cpu_nvfp4_linear: act_global_scale has ",
                act_global->numel(), " elements, expected one per row (", M, ")");
    g_in = act_global->to(at::kFloat).contiguous();
  }
  if (M == 0) return call.result(out_dtype);
  float* const ga = call.extra;  // each row's global scale
  const float* const gin = g_in.defined() ? g_in.data_ptr<float>() : nullptr;
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> sc(nb);
    std::vector<float> xbuf(call.row_buf());
    for (int64_t r = r0; r < r1; ++r) {
      int32_t* sums = call.corr + r * nb;
      ga[r] = nvfp4_quant_row(call.row(r, xbuf.data()), k, gin ? gin[r] : -1.0f,
                              call.codes + r * kp, sc.data(), sums);
      for (int64_t b = 0; b < nb; ++b) {
        sums[b] *= -kOffset;
        call.scale[r * nb + b] = e4m3_value(sc[b]);
      }
    }
  });
  const WeightTiles w{wcodes.data_ptr<uint8_t>(), wscales.data_ptr<uint8_t>(), nullptr, nt, nb,
                      nb, 0, n};
  const Nvfp4Rows a{call.codes, call.corr, call.scale, ga, kp, nb};
  const float* bp = call.bias_ptr();
  const float* gw = wglobal.data_ptr<float>();
  float* yp = call.y;
  at::parallel_for(0, nt, tile_grain(M, kp), [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += kNvfp4TileM)
      for (int64_t t = t0; t < t1; ++t)
        nvfp4_rows<kNvfp4TileM>(w, gw, a, t, m0, std::min<int64_t>(kNvfp4TileM, M - m0), yp,
                                bp);
    call.store(0, M, t0 * kTileN, std::min(t1 * kTileN, n));
  });
  return call.result(out_dtype);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mxplus, m) {
  m.def("cpu_nvfp4_act_quant(Tensor x) -> (Tensor, Tensor, Tensor)",
        cpu_kernel(&nvfp4_act_quant));
  m.def("cpu_nvfp4_linear(Tensor x, Tensor wcodes, Tensor wscales, Tensor wglobal, int n, "
        "int k, Tensor? act_global_scale, Tensor? bias, ScalarType out_dtype) -> Tensor",
        cpu_kernel(&nvfp4_linear));
}

}  // namespace mxplus_cpu
