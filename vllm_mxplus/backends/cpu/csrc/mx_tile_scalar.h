// The portable tile kernel of the integer GEMM: the same operations as the vector kernels,
// one lane at a time (mx_gemm_cpu.cpp states what it computes).
#pragma once

#include "mx_tiles.h"

namespace mxplus_cpu {
namespace gemm_detail {

// ---- the portable kernel (same operations, one lane at a time) -------------------------
template <int MT, bool MBS, bool BM>
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
        if (BM) {  // MX+: + x[block max] * its 2 * value (0 when the block has none)
          const uint8_t* p = w.bm + (t * w.nb + b) * 2 * kTileN;
          const int wbm = static_cast<int8_t>(p[kTileN + i]);
          for (int m = 0; m < MT; ++m) iacc[m] += wbm * a.codes[(m0 + m) * a.kp + b * 32 + p[i]];
        }
        for (int m = 0; m < MT; ++m) {
          const float e = ew + a.ea[(m0 + m) * a.nb + b];
          const float term = std::isnan(e) ? e : std::ldexp(static_cast<float>(iacc[m]),
                                                            static_cast<int>(e));
          if (MBS) cacc[m] += term;
          else yacc[m] += term;
        }
      }
      if (MBS) {  // y = fma(S, t, y), t = fl(fl(1/Fa) * fl(1/Fw)) (mx_tile_avx512.h)
        const float rw = w.mbs ? 1.0f / mbs_factor(w.mbs[(t * w.nm + c) * kTileN + i]) : 1.0f;
        for (int m = 0; m < MT; ++m) {
          const float tm = a.fa ? (1.0f / a.fa[(m0 + m) * a.nm + c]) * rw : rw;
          yacc[m] = std::fma(cacc[m], tm, yacc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m)
      y[(m0 + m) * w.n + n0 + i] = bias ? yacc[m] + bias[n0 + i] : yacc[m];
  }
}

}  // namespace gemm_detail
}  // namespace mxplus_cpu
