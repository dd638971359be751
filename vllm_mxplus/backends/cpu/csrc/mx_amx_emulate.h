// The AMX tile instructions the plugin uses, in plain C++ (builds with MXPLUS_AMX_EMULATE only:
// VLLM_MXPLUS_CPU_AMX_EMULATE=1, for tests). With it the AMX kernels (mx_amx_cpu.cpp,
// mx_amx_int8_cpu.cpp) run, unchanged but for these instructions, on any CPU that has the
// AVX-512 subset their other code is compiled for (MXPLUS_AMX_TARGET): their tile layouts,
// folds, windows, refusals and epilogues are then tested on every such host, slowly. What
// this cannot test is the silicon: each instruction here follows the pseudo-code of the
// Intel SDM (ldtilecfg, tileloadd, tilestored, tilezero, tdpbssd, tdpbf16ps, tilerelease).
//
// The tile state is per thread, as the hardware's is: 8 tiles of at most 16 rows x 64
// bytes, shaped by the palette-1 configuration last loaded on the thread. Included by
// mx_amx_decode.h, which defines the intrinsics' names as these functions.
#pragma once

#include <cstdint>
#include <cstring>

namespace mxplus_cpu {
namespace amx_emulate {

constexpr int kTiles = 8, kMaxRows = 16, kMaxColsb = 64;

struct State {
  bool configured = false;
  uint8_t rows[kTiles] = {};
  uint16_t colsb[kTiles] = {};
  alignas(64) uint8_t t[kTiles][kMaxRows][kMaxColsb] = {};
};

inline State& state() {
  static thread_local State s;
  return s;
}

// The part of a palette-1 configuration these functions read (the TileConfig layout of
// mx_amx_decode.h): byte 0 the palette, bytes 16 + 2 t the bytes per row of tile t, byte
// 48 + t its rows. A shape past the tile's size fails loudly, as ldtilecfg would (#GP).
inline void loadconfig(const void* config) {
  const auto* c = static_cast<const uint8_t*>(config);
  State& s = state();
  if (c[0] != 1) __builtin_trap();
  for (int t = 0; t < kTiles; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * t, 2);
    const uint8_t rows = c[48 + t];
    if (rows > kMaxRows || colsb > kMaxColsb || colsb % 4) __builtin_trap();
    s.rows[t] = rows;
    s.colsb[t] = colsb;
  }
  s.configured = true;
  std::memset(s.t, 0, sizeof(s.t));
}

inline State& configured() {
  State& s = state();
  if (!s.configured) __builtin_trap();  // a tile instruction before ldtilecfg: #UD
  return s;
}

inline void release() {
  State& s = state();
  s.configured = false;
  std::memset(s.t, 0, sizeof(s.t));
}

// tileloadd: row r of tile t from base + r * stride; the bytes past colsb are zeroed.
inline void loadd(int t, const void* base, int64_t stride) {
  State& s = configured();
  std::memset(s.t[t], 0, sizeof(s.t[t]));
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(s.t[t][r], static_cast<const uint8_t*>(base) + r * stride, s.colsb[t]);
}

inline void stored(int t, void* base, int64_t stride) {
  State& s = configured();
  for (int r = 0; r < s.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.t[t][r], s.colsb[t]);
}

inline void zero(int t) { std::memset(configured().t[t], 0, sizeof(State::t[0])); }

// tdpbssd: dst.int32[m][n] += sum over k of the dot product of the 4 signed bytes of
// a.row[m].dword[k] and of b.row[k].dword[n], each product and sum in 32-bit wraparound.
inline void dpbssd(int dst, int a, int b) {
  State& s = configured();
  const int m_rows = s.rows[dst], n_words = s.colsb[dst] / 4, k_words = s.colsb[a] / 4;
  for (int m = 0; m < m_rows; ++m) {
    uint32_t acc[kMaxColsb / 4];
    std::memcpy(acc, s.t[dst][m], sizeof(acc));
    for (int k = 0; k < k_words; ++k) {
      const auto* av = reinterpret_cast<const int8_t*>(s.t[a][m] + 4 * k);
      for (int n = 0; n < n_words; ++n) {
        const auto* bv = reinterpret_cast<const int8_t*>(s.t[b][k] + 4 * n);
        uint32_t d = 0;
        for (int i = 0; i < 4; ++i)
          d += static_cast<uint32_t>(int32_t(av[i]) * int32_t(bv[i]));
        acc[n] += d;
      }
    }
    std::memset(s.t[dst][m], 0, kMaxColsb);
    std::memcpy(s.t[dst][m], acc, 4 * n_words);
  }
}

inline float bf16_daz(uint16_t h) {  // the bf16 as fp32, a subnormal read as a signed zero
  uint32_t bits = uint32_t(h) << 16;
  if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float ftz(float f) {  // a subnormal result flushed to a signed zero
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7F800000u) == 0) bits &= 0x80000000u;
  std::memcpy(&f, &bits, 4);
  return f;
}

// tdpbf16ps: dst.fp32[m][n] += a.bf16[m][2k] * b.bf16[k][2n], then += a.bf16[m][2k + 1] *
// b.bf16[k][2n + 1], for k in order: each product exact in fp32 (8-bit significands), each
// addition rounded to nearest even, subnormal inputs read as zero and results flushed to zero
// (the SDM's DAZ / FTZ for this instruction, whatever MXCSR says).
inline void dpbf16ps(int dst, int a, int b) {
  State& s = configured();
  const int m_rows = s.rows[dst], n_words = s.colsb[dst] / 4, k_words = s.colsb[a] / 4;
  for (int m = 0; m < m_rows; ++m) {
    float acc[kMaxColsb / 4];
    std::memcpy(acc, s.t[dst][m], sizeof(acc));
    for (int k = 0; k < k_words; ++k) {
      uint16_t av[2];
      std::memcpy(av, s.t[a][m] + 4 * k, 4);
      for (int n = 0; n < n_words; ++n) {
        uint16_t bv[2];
        std::memcpy(bv, s.t[b][k] + 4 * n, 4);
        for (int p = 0; p < 2; ++p)
          acc[n] = ftz(ftz(acc[n]) + ftz(bf16_daz(av[p]) * bf16_daz(bv[p])));
      }
    }
    std::memset(s.t[dst][m], 0, kMaxColsb);
    std::memcpy(s.t[dst][m], acc, 4 * n_words);
  }
}

}  // namespace amx_emulate
}  // namespace mxplus_cpu

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#undef _tile_dpbf16ps
#undef _tile_release
#define _tile_loadd(t, base, stride) ::mxplus_cpu::amx_emulate::loadd(t, base, stride)
#define _tile_stored(t, base, stride) ::mxplus_cpu::amx_emulate::stored(t, base, stride)
#define _tile_zero(t) ::mxplus_cpu::amx_emulate::zero(t)
#define _tile_dpbssd(d, a, b) ::mxplus_cpu::amx_emulate::dpbssd(d, a, b)
#define _tile_dpbf16ps(d, a, b) ::mxplus_cpu::amx_emulate::dpbf16ps(d, a, b)
#define _tile_release() ::mxplus_cpu::amx_emulate::release()
