// The integer GEMM's operand layout and its tile kernels (one file per instruction set);
// included by the GEMM translation units (mx_gemm_cpu.cpp, mx_nvfp4_cpu.cpp,
// mx_mxplus_cpu.cpp). The numerics are stated at the top of mx_gemm_cpu.cpp.
#pragma once

#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "mx_cpu_common.h"

namespace mxplus_cpu {
namespace gemm_detail {

constexpr int kTileN = 16;      // weight rows per tile: one 32-bit lane each
constexpr int kGroupK = 16;     // K elements per packed group (128 bytes per tile)
constexpr int kGroupBytes = kTileN * kGroupK / 2;
constexpr int kMaxTileM = 8;    // activation rows per register tile
constexpr int kTilesPerPass = 4;  // weight tiles sharing one pass over an activation row tile
constexpr int kOffset = 12;     // unsigned weight byte = 2 * value + 12 in [0, 24]

// A zeroed uint8 tensor for packed weight tiles, in 2 MiB-aligned memory advised to the
// kernel as transparent huge pages (Linux MADV_HUGEPAGE; a hint, so where THP is off or
// `never` it is plain memory). The kernels stream a model's tiles from memory once per call;
// on 4 KiB pages each page of a tile's code stream is a TLB miss and the hardware prefetchers
// stop at its end. The bytes are those of at::zeros; below 2 MiB, or off Linux, at::zeros.
inline at::Tensor zeros_tiles(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  int64_t bytes = 1;
  for (const int64_t s : sizes) bytes *= s;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr int64_t kHuge = int64_t{2} << 20;
  if (bytes >= kHuge) {
    const int64_t len = (bytes + kHuge - 1) / kHuge * kHuge;
    void* p = std::aligned_alloc(kHuge, static_cast<size_t>(len));
    if (p != nullptr) {
      madvise(p, static_cast<size_t>(len), MADV_HUGEPAGE);  // a hint: failure is harmless
      std::memset(p, 0, static_cast<size_t>(bytes));
      return at::from_blob(p, sizes, [](void* q) { std::free(q); },
                           opts.dtype(at::kByte).device(at::kCPU));
    }
  }
#endif
  return at::zeros(sizes, opts.dtype(at::kByte));
}

struct WeightTiles {
  const uint8_t* codes;   // [nt, groups, 128]: see pack_weight for the byte order
  const uint8_t* scales;  // [nt, nb, 16] E8M0 codes, one per tile row
  const uint8_t* mbs;     // [nt, nm, 16] MBS bytes, or nullptr
  int64_t nt, groups, nb, nm, n;
  // MX+ only (else nullptr), [nt, nb, 32]: per tile row i, byte i is the block max's index
  // in the block (0 when none) and byte 16 + i its 2 * value as int8 (+-(8 .. 15), 0 when
  // none); its nibble in `codes` is 0 (mx_mxplus_cpu.cpp).
  const uint8_t* bm = nullptr;
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

// The extremes of one activation row's block exponents (ea - 256 per block, NaN for code
// 255): computed once per row and call (or pass over the weight tiles), not once per tile.
struct RowExp {
  bool finite;  // no NaN exponent in the row
  int lo, hi;
};

inline RowExp row_exp_range(const float* ea, int64_t nb) {
  float elo = ea[0], ehi = ea[0];
  for (int64_t b = 0; b < nb; ++b) {
    if (std::isnan(ea[b])) return {false, 0, 0};
    elo = std::min(elo, ea[b]);
    ehi = std::max(ehi, ea[b]);
  }
  return {true, static_cast<int>(elo), static_cast<int>(ehi)};
}

// mx_gemm_cpu.cpp: checkpoint-layout codes / scales / MBS bytes -> (codes, scales, MBS) tiles.
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_tiles(const at::Tensor& codes,
                                                          const at::Tensor& scales,
                                                          const at::Tensor& mbs, int64_t k,
                                                          int64_t block, int64_t macro);

// An E8M0 weight [n, k] of this block size as cpu_pack_weight packed it (codes, scales, and the
// MBS bytes of this macro block, or an empty or undefined mbs), its layout checked: `op` names the caller in
// the errors. mx_gemm_cpu.cpp; cpu_mx_linear and the AMX path's cpu_amx_packed_gemm.
WeightTiles e8m0_weight_tiles(const char* op, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& mbs, int64_t n, int64_t k, int64_t block,
                              int64_t macro);

// The start every integer GEMM op shares (tile_linear; mx_nvfp4_cpu.cpp): x [..., k] checked
// (on the CPU, last dim k), its rows contiguous in x's own dtype (fp32, bf16 or fp16:
// rows_operand; the quantizer reads each as fp32 with row_f32, no fp32 copy of x), the bias
// as fp32, and in one allocation the activation operand's buffers, which the op's row
// quantizer fills, `extra` fp32 values per row for the op, and the fp32 output y (its own
// tensor, returned as is, when the op's output is fp32; else the bf16 or fp16 output `out`,
// which each GEMM task stores its outputs into). No fp32 copy of x is made (4 bytes per
// activation element at prefill); the call's time at decode sizes is about what it was with a
// tensor per buffer (measured on a Zen 4). `op` names the caller in errors.
// mx_gemm_cpu.cpp.
struct LinearCall {
  std::vector<int64_t> out_shape;  // x's shape with the last dim n
  int64_t M;                       // rows of x
  int64_t k;
  at::Tensor x;                    // [M, k] contiguous: fp32, bf16 or fp16 (rows_operand)
  at::Tensor bias;                 // fp32 [n], or undefined
  at::Tensor scratch;              // the buffers below but y, one allocation (and y unless fp32 out)
  at::Tensor y32;                  // y as the op's fp32 output tensor, else undefined
  at::Tensor out;                  // the op's bf16 or fp16 output [M, n] (store), else undefined
  int8_t* codes;                   // [M, kp]: 2 * value, zero padded
  int32_t* corr;                   // [M, nb]: the block code sums, then the correction
  float* scale;                    // [M, nb]: each block's scale term (the op's own)
  float* extra;                    // [M, extra] for the op (MBS factors, NVFP4 global scales)
  float* y;                        // [M, n]

  const float* bias_ptr() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
  // Row r of x as fp32 (row_f32): x's memory, or buf (k floats).
  const float* row(int64_t r, float* buf) const { return row_f32(x, r, k, buf); }
  // The floats a task's buf for row() needs: none where x is fp32 (its rows are read in place).
  int64_t row_buf() const { return x.scalar_type() == at::kFloat ? 0 : k; }
  // Rows [r0, r1) x columns [c0, c1) of y, final, rounded into `out` (nothing where the
  // output is y itself): each GEMM task's last step for the outputs it wrote, while they are
  // in its cache, with no pass of its own over y.
  void store(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    if (!out.defined() || r0 >= r1 || c0 >= c1) return;
    const int64_t n = out_shape.back();
    uint16_t* o = static_cast<uint16_t*>(out.data_ptr());
    const bool bf16 = out.scalar_type() == at::kBFloat16;
    for (int64_t r = r0; r < r1; ++r) round_outputs(y + r * n + c0, o + r * n + c0, c1 - c0, bf16);
  }
  // The op's output in out_dtype and x's leading shape (after every task's store).
  at::Tensor result(at::ScalarType out_dtype) const;
};
LinearCall linear_call(const at::Tensor& x, int64_t n, int64_t k, int64_t block,
                       const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                       int64_t extra, const char* op);

// mx_gemm_cpu.cpp: quantize x's rows once (quant_row with this block, rule, MBS) and run the
// integer GEMM against the checked weight tiles w; `op` names the caller in errors.
at::Tensor tile_linear(const at::Tensor& x, int64_t block, int rule, bool act_mbs, int64_t macro,
                       const WeightTiles& w, int64_t k, const c10::optional<at::Tensor>& bias,
                       at::ScalarType out_dtype, const char* op);

}  // namespace gemm_detail
}  // namespace mxplus_cpu
