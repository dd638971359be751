// The integer GEMM's operand layout and its tile kernels (one file per instruction set);
// included by mx_gemm_cpu.cpp only. The numerics are stated at the top of mx_gemm_cpu.cpp.
#pragma once

#include "mx_cpu_common.h"

namespace mxplus_cpu {
namespace gemm_detail {

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

// Weight tiles per thread chunk: enough that each thread gets >= kMinParallelMacs products
// (~40 us of work),
// so a small GEMM (decode on a small model) runs on one thread. On a busy machine every
// parallel region waits for its slowest thread: measured, 2-thread regions of a few
// microseconds of work each stalled for milliseconds at a time (bench_serve_cpu.py).
constexpr int64_t kMinParallelMacs = int64_t{1} << 23;
inline int64_t tile_grain(int64_t M, int64_t K) {
  return std::max<int64_t>(1, kMinParallelMacs / std::max<int64_t>(1, kTileN * K * M));
}

}  // namespace gemm_detail
}  // namespace mxplus_cpu
