// The exact-bf16 path's GEMM on AMX-BF16 tiles (docs/cpu_kernels.md, "Large M on AMX hosts"):
// the operands are the path's bf16 values (exact: E2M1 * 2^e, MX+ block maxima, NVFP4's v * s),
// the products are accumulated in fp32 by `tdpbf16ps` over one macro chunk, and each chunk's
// partial sum P_c is scaled into an fp32 accumulator by the reciprocals of its MBS factors:
//
//   y[m, n] = sum over c of fl(P_c[m, n] * fl(ra[m, c] * rw[c, n]))   (one fused multiply-add
//                                                                       per chunk, in c order)
//
// with ra = fl(1 / Fa), rw = fl(1 / Fw) given by the caller (ones for a side without MBS).
// Without MBS the row is one chunk and P is the output (no scaling). Rounding count per product
// on its way into y (the bound of docs/cpu_kernels.md): L - 1 additions inside the tiles (any
// order: AMX sums pairs then accumulates), 3 for the factor (ra, rw, their product), and one
// per chunk for the fused multiply-add (its first into a zero accumulator rounds the product).
// AMX-BF16 reads bf16 denormals as zero and flushes denormal fp32 results (the bound's
// absolute term). NaN and Inf propagate through the tiles and the epilogue.
//
// Layouts. Activations: bf16 [Mp, Kp] row-major, Mp a multiple of 32 and Kp of the chunk (a
// multiple of 32), zero-padded. Weight: bf16 [Np / 16, Kp / 32, 16, 32] (`amx_pack`): for
// each 16 output columns and 32-K step, the B tile of `tdpbf16ps` (row r holds columns
// 0..15 as pairs (k = 2r, 2r + 1)), Np a multiple of 32 (cpu_amx_gemm); or, for E8M0
// weights, the integer kernels' packed codes and scales, decoded into the same B tiles per
// task (cpu_amx_packed_gemm: no bf16 copy of the weight). Reciprocals: ra fp32 [Mp, chunks],
// rw fp32 [chunks, Np] (a chunk's 16 columns contiguous). Output [M, N] of the layer's dtype:
// y times fl(ga * gw) (NVFP4's global scales), plus the bias, rounded once to the dtype,
// the same operations in the same order as the torch path (exact_bf16.linear).
//
// AMX needs the process's tile permission (platform_amx asks Linux for it) and a CPU with
// amx_tile and amx_bf16: the caller checks both (exact_bf16.host_choice); this file compiles
// on any x86-64 GCC >= 11 / Clang >= 12 through function target attributes (MXPLUS_AMX_TARGET,
// mx_amx_decode.h), and elsewhere reports that it has no AMX code (cpu_amx_available() == 0,
// as on a CPU without AMX-BF16).
// Compiled with -ffp-contract=off: the one fused multiply-add is the intrinsic's.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "mx_amx_decode.h"
#include "mx_cpu_common.h"

namespace mxplus_cpu {
namespace {

constexpr int64_t kAmxBlock = 32;  // output rows / columns per 2 x 2 tile block
constexpr int64_t kTaskRowBlocks = 8;  // row blocks per task (256 rows)
constexpr int64_t kTaskColBlocks = 4;  // column blocks per task (128 columns)
constexpr int64_t kSpanK = 512;        // K per pass over a task's blocks

// K per pass: kSpanK, or with factors the whole chunks that fit it (at least one).
inline int64_t span_k(int64_t chunk, bool scaled) {
  return scaled ? std::max(chunk, kSpanK / chunk * chunk) : kSpanK;
}


// 1 where this build has AMX code and this process may run it (cpuid and the permission),
// else 0: what exact_bf16.amx_tiles asks before it lays a weight out for cpu_amx_gemm.
int64_t amx_available() {
#ifdef MXPLUS_AMX
  return amx_bf16_usable() ? 1 : 0;
#else
  return 0;
#endif
}

#ifdef MXPLUS_AMX
// Tiles (configure_tiles, mx_amx_decode.h): 0-3 the 2 x 2 fp32 accumulators, 4-5 the A rows
// (16 each), 6-7 the B columns.

// The tile products of one 32 x 32 block over K [k0, k0 + 32 steps) into tiles 0-3 (zeroed
// first); w0 / w1 point at the two column tiles' B tiles of step k0 / 32, one step every
// kAmxRows * kAmxStepK elements (both weight layouts).
MXPLUS_AMX_TARGET void products(const uint16_t* a, int64_t kp, const uint16_t* w0,
                                const uint16_t* w1, int64_t k0, int64_t steps) {
  const int64_t lda = kp * 2;
  const uint16_t* a0 = a + k0;
  const uint16_t* a1 = a0 + kAmxRows * kp;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a0 + s * kAmxStepK, lda);
    _tile_loadd(5, a1 + s * kAmxStepK, lda);
    _tile_loadd(6, w0 + s * kAmxRows * kAmxStepK, 64);
    _tile_loadd(7, w1 + s * kAmxRows * kAmxStepK, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

MXPLUS_AMX_TARGET void store_tiles(float* b) {  // tiles 0-3 -> 32 x 32 fp32, row-major
  _tile_stored(0, b, kAmxBlock * 4);
  _tile_stored(1, b + kAmxRows, kAmxBlock * 4);
  _tile_stored(2, b + kAmxRows * kAmxBlock, kAmxBlock * 4);
  _tile_stored(3, b + kAmxRows * kAmxBlock + kAmxRows, kAmxBlock * 4);
}

// acc += P * fl(ra[i] * rw) (one fused multiply-add; ra of the block's rows for this chunk,
// stride `chunks`; rw the chunk's 32 column reciprocals), or acc += P where ra is null.
MXPLUS_AMX_TARGET void accumulate(const float* p, float* acc, const float* ra, int64_t chunks,
                                  const float* rw) {
  if (ra == nullptr) {
    for (int64_t e = 0; e < kAmxBlock * kAmxBlock; e += kAmxRows) {
      _mm512_storeu_ps(acc + e, _mm512_add_ps(_mm512_loadu_ps(p + e), _mm512_loadu_ps(acc + e)));
    }
    return;
  }
  const __m512 rw0 = _mm512_loadu_ps(rw), rw1 = _mm512_loadu_ps(rw + kAmxRows);
  for (int64_t i = 0; i < kAmxBlock; ++i) {
    const __m512 r = _mm512_set1_ps(ra[i * chunks]);
    float* row = acc + i * kAmxBlock;
    const float* q = p + i * kAmxBlock;
    _mm512_storeu_ps(row, _mm512_fmadd_ps(_mm512_loadu_ps(q), _mm512_mul_ps(r, rw0),
                                          _mm512_loadu_ps(row)));
    _mm512_storeu_ps(row + kAmxRows,
                     _mm512_fmadd_ps(_mm512_loadu_ps(q + kAmxRows), _mm512_mul_ps(r, rw1),
                                     _mm512_loadu_ps(row + kAmxRows)));
  }
}

// What follows the GEMM, in the torch path's order and roundings: y = fl(y * fl(ga * gw))
// (NVFP4), then fl(y + b), then the output dtype (round to nearest even; NaN stays NaN).
struct Finish {
  const float* ga;    // [M] or null
  const float* gw;    // [N] or null
  const float* bias;  // [N] or null
  void* out;          // [M, N] of dtype
  at::ScalarType dtype;
  int64_t m, n;
};

MXPLUS_AMX_TARGET void finish(const Finish& f, const float* acc, int64_t m0, int64_t n0) {
  const int64_t rows = std::min(kAmxBlock, f.m - m0);
  for (int64_t h = 0; h < kAmxBlock; h += kAmxRows) {
    const int64_t cols = std::min(kAmxRows, f.n - n0 - h);
    if (cols <= 0) break;
    const __mmask16 live = cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const int64_t c0 = n0 + h;
    const __m512 gw = f.gw ? _mm512_maskz_loadu_ps(live, f.gw + c0) : _mm512_setzero_ps();
    const __m512 b = f.bias ? _mm512_maskz_loadu_ps(live, f.bias + c0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
      __m512 y = _mm512_loadu_ps(acc + i * kAmxBlock + h);
      if (f.ga) y = _mm512_mul_ps(y, _mm512_mul_ps(_mm512_set1_ps(f.ga[m0 + i]), gw));
      if (f.bias) y = _mm512_add_ps(y, b);
      store_outputs(y, f.dtype, f.out, (m0 + i) * f.n + c0, live);
    }
  }
}

#endif

// ---- the weight's B tiles: held in bf16 (amx_pack), or decoded per task from the integer
// kernels' packed FP4 tiles (E8M0 formats; mx_amx_decode.h), so that no bf16 copy of the
// weight exists.
// The bf16 B tiles of amx_pack: [Np / 16, Kp / 32, 16, 32].
struct HeldTiles {
  const uint16_t* w;
  int64_t steps;  // Kp / 32
  void prepare(int64_t, int64_t, int64_t) {}
  const uint16_t* tile(int64_t t, int64_t s) const { return w + (t * steps + s) * kTileElems; }
};

#ifdef MXPLUS_AMX
// The B tiles of one column block (tiles 2 j, 2 j + 1) over a task's pass over K [k0, k1),
// decoded once into a buffer of the thread (at most 2 x 16 tiles, 32 KiB: it stays in L1) and
// read by every row block of the task.
struct DecodedTiles {
  PackedCodes pc;
  uint16_t* buf;
  int64_t t0 = 0, s0 = 0, steps = 0;
  void prepare(int64_t k0, int64_t k1, int64_t j) {
    t0 = 2 * j;
    s0 = k0 / kAmxStepK;
    steps = (k1 - k0) / kAmxStepK;
    for (int64_t t = t0; t < t0 + 2; ++t)
      for (int64_t s = 0; s < steps; ++s)
        decode_tile(pc, t, s0 + s, buf + ((t - t0) * steps + s) * kTileElems);
  }
  const uint16_t* tile(int64_t t, int64_t s) const {
    return buf + ((t - t0) * steps + (s - s0)) * kTileElems;
  }
};

// One task: row blocks [i0, i1) x column blocks [j0, j1) (at most 8 x 4: 256 x 128 outputs,
// their fp32 accumulators 128 KiB), K in spans of kSpanK so that the span's activation rows
// and weight columns stay in L2 while every block of the task passes: per span, column block
// after column block (its B tiles, 32 KiB, in L1 for all the row blocks; a packed weight's
// decoded once there). Each item (a block and one chunk, or without factors one span) issues
// its tile products, then the previous item's sums are accumulated from the other buffer (the
// vector work overlapping the tile unit's), then its own are stored. Without factors the
// spans' sums are added in fp32: another order of the same additions (at most K - 1 on a
// product's way).
template <class Src>
MXPLUS_AMX_TARGET void task(const uint16_t* a, Src& w, const float* ra, const float* rw,
                            const Finish& f, int64_t np, int64_t kp, int64_t chunk, bool scaled,
                            int64_t i0, int64_t i1, int64_t j0, int64_t j1, float* acc,
                            float* buf) {
  const int64_t chunks = kp / chunk, nj = j1 - j0, span = span_k(chunk, scaled);
  std::memset(acc, 0, (i1 - i0) * nj * kAmxBlock * kAmxBlock * sizeof(float));
  struct Item {
    float* acc;
    const float* ra;
    const float* rw;
  } prev{nullptr, nullptr, nullptr};
  int parity = 0;
  for (int64_t k0 = 0; k0 < kp; k0 += span) {
    const int64_t k1 = std::min(kp, k0 + span), piece = scaled ? chunk : k1 - k0;
    for (int64_t j = j0; j < j1; ++j) {
      w.prepare(k0, k1, j);  // the block's B tiles of the span, read by every row block
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t c0 = k0; c0 < k1; c0 += piece) {
          const int64_t s = c0 / kAmxStepK;
          products(a + i * kAmxBlock * kp, kp, w.tile(2 * j, s), w.tile(2 * j + 1, s), c0,
                   piece / kAmxStepK);
          if (prev.acc) accumulate(buf + (parity ^ 1) * kAmxBlock * kAmxBlock, prev.acc,
                                   prev.ra, chunks, prev.rw);
          store_tiles(buf + parity * kAmxBlock * kAmxBlock);
          parity ^= 1;
          const int64_t c = c0 / chunk;
          prev = {acc + ((i - i0) * nj + (j - j0)) * kAmxBlock * kAmxBlock,
                  scaled ? ra + i * kAmxBlock * chunks + c : nullptr,
                  scaled ? rw + c * np + j * kAmxBlock : nullptr};
        }
      }
    }
  }
  if (prev.acc) accumulate(buf + (parity ^ 1) * kAmxBlock * kAmxBlock, prev.acc, prev.ra, chunks,
                           prev.rw);
  for (int64_t i = i0; i < i1; ++i) {
    for (int64_t j = j0; j < j1; ++j) {
      finish(f, acc + ((i - i0) * nj + (j - j0)) * kAmxBlock * kAmxBlock, i * kAmxBlock,
             j * kAmxBlock);
    }
  }
}

// Tasks [t0, t1) on this thread: the tile configuration, the tasks, the release. (A function
// of its own with the AMX target: a lambda does not inherit its enclosing function's.)
// pc: decode the weight from packed codes (null: w holds the bf16 B tiles).
MXPLUS_AMX_TARGET void run_tasks(const uint16_t* a, const uint16_t* w, const PackedCodes* pc,
                                 const float* ra, const float* rw, const Finish& f, int64_t np,
                                 int64_t kp, int64_t chunk, bool scaled, int64_t t0, int64_t t1) {
  const int64_t mb = cdiv(f.m, kAmxBlock), nbk = cdiv(f.n, kAmxBlock);  // live blocks only
  const int64_t cpanels = cdiv(nbk, kTaskColBlocks);
  configure_tiles();
  // scratch without value-initialization (task() zeroes the accumulators it uses; every
  // other byte is written before it is read): 256 KiB of memset per call otherwise
  const std::unique_ptr<float[]> acc(new float[kTaskRowBlocks * kTaskColBlocks * kAmxBlock *
                                               kAmxBlock]);
  const std::unique_ptr<float[]> buf(new float[2 * kAmxBlock * kAmxBlock]);
  const std::unique_ptr<uint16_t[]> wbuf(
      pc ? new uint16_t[2 * span_k(chunk, scaled) / kAmxStepK * kTileElems]
         : nullptr);
  HeldTiles held{w, kp / kAmxStepK};
  DecodedTiles decoded{pc ? *pc : PackedCodes{}, wbuf.get()};
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t rp = t / cpanels, cp = t % cpanels;
    const int64_t i0 = rp * kTaskRowBlocks, i1 = std::min(mb, (rp + 1) * kTaskRowBlocks);
    const int64_t j0 = cp * kTaskColBlocks, j1 = std::min(nbk, (cp + 1) * kTaskColBlocks);
    if (pc) {
      task(a, decoded, ra, rw, f, np, kp, chunk, scaled, i0, i1, j0, j1, acc.get(), buf.get());
    } else {
      task(a, held, ra, rw, f, np, kp, chunk, scaled, i0, i1, j0, j1, acc.get(), buf.get());
    }
  }
  _tile_release();
}

void gemm(const uint16_t* a, const uint16_t* w, const PackedCodes* pc, const float* ra,
          const float* rw, const Finish& f, int64_t np, int64_t kp, int64_t chunk, bool scaled) {
  const int64_t tasks = cdiv(cdiv(f.m, kAmxBlock), kTaskRowBlocks) *
                        cdiv(cdiv(f.n, kAmxBlock), kTaskColBlocks);
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    run_tasks(a, w, pc, ra, rw, f, np, kp, chunk, scaled, t0, t1);
  });
}
#endif

// The checks and the call both GEMM ops share: activations a, the weight's padded columns np
// (held B tiles w, or packed codes pc), the reciprocals, the global scales, the bias.
at::Tensor run_gemm(const char* op, const at::Tensor& a, const uint16_t* w, const PackedCodes* pc,
                    int64_t np, const at::Tensor& ra, const at::Tensor& rw, int64_t chunk,
                    int64_t m, int64_t n, const c10::optional<at::Tensor>& ga,
                    const c10::optional<at::Tensor>& gw, const c10::optional<at::Tensor>& bias,
                    at::ScalarType out_dtype) {
  const int64_t mp = a.size(0), kp = a.size(1), chunks = kp / chunk;
  TORCH_CHECK(m >= 0 && m <= mp && n >= 0 && n <= np, op, ": the output [", m, ", ", n,
              "] must fit the padded [", mp, ", ", np, "]");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              op, ": out_dtype must be float32, bfloat16 or float16, got ", out_dtype);
  const bool scaled = ra.numel() > 0;
  if (scaled) {
    TORCH_CHECK(ra.scalar_type() == at::kFloat && ra.is_contiguous() &&
                    ra.sizes() == at::IntArrayRef({mp, chunks}),
                op, ": ra must be contiguous fp32 [", mp, ", ", chunks, "], got ", ra.sizes());
    TORCH_CHECK(rw.scalar_type() == at::kFloat && rw.is_contiguous() &&
                    rw.sizes() == at::IntArrayRef({chunks, np}),
                op, ": rw must be contiguous fp32 [", chunks, ", ", np, "], got ", rw.sizes());
  } else {
    TORCH_CHECK(chunks == 1 && rw.numel() == 0, op,
                ": without factors the row must be one chunk (chunk = Kp) and rw empty");
  }
  auto vec = [&](const c10::optional<at::Tensor>& t, int64_t len, const char* what) {
    if (!t.has_value()) return static_cast<const float*>(nullptr);
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == len, op,
                ": ", what, " must be contiguous fp32 with ", len, " elements, got ",
                t->sizes(), " ", t->scalar_type());
    return static_cast<const float*>(t->data_ptr<float>());
  };
  TORCH_CHECK(ga.has_value() == gw.has_value(), op, ": ga and gw go together (NVFP4)");
  at::Tensor out = at::empty({m, n}, a.options().dtype(out_dtype));
  Finish f{vec(ga, m, "ga"), vec(gw, n, "gw"), vec(bias, n, "bias"), out.data_ptr(), out_dtype,
           m, n};
  if (m == 0 || n == 0) return out;
#ifdef MXPLUS_AMX
  TORCH_CHECK(amx_bf16_usable(), op, ": this CPU has no AMX-BF16 or Linux refused the AMX tile "
              "permission (exact_bf16.amx_tiles says so before a call)");
  gemm(reinterpret_cast<const uint16_t*>(a.data_ptr()), w, pc,
       scaled ? ra.data_ptr<float>() : nullptr, scaled ? rw.data_ptr<float>() : nullptr, f, np,
       kp, chunk, scaled);
  return out;
#else
  (void)f;
  (void)w;
  (void)pc;
  TORCH_CHECK(false, op, ": this build has no AMX code (needs x86-64 and GCC >= 11 / Clang "
              ">= 12); cpu_amx_available() says so before a call");
  return out;
#endif
}

void check_activations(const char* op, const at::Tensor& a, int64_t chunk) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kBFloat16 && a.is_contiguous() &&
                  a.device().is_cpu(),
              op, ": activations must be contiguous CPU bf16 [Mp, Kp], got ", a.sizes(), " ",
              a.scalar_type());
  const int64_t mp = a.size(0), kp = a.size(1);
  TORCH_CHECK(chunk > 0 && chunk % kAmxStepK == 0 && kp % chunk == 0 && mp % kAmxBlock == 0,
              op, ": Mp must be a multiple of 32 and Kp of the chunk (a multiple of 32), got Mp=",
              mp, " Kp=", kp, " chunk=", chunk);
}

at::Tensor amx_gemm(const at::Tensor& a, const at::Tensor& w, const at::Tensor& ra,
                    const at::Tensor& rw, int64_t chunk, int64_t m, int64_t n,
                    const c10::optional<at::Tensor>& ga, const c10::optional<at::Tensor>& gw,
                    const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const char* op = "vllm_mxplus::cpu_amx_gemm";
  check_activations(op, a, chunk);
  const int64_t kp = a.size(1);
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
                  w.device().is_cpu() && w.size(0) % 2 == 0 && w.size(1) == kp / kAmxStepK &&
                  w.size(2) == kAmxRows && w.size(3) == kAmxStepK,
              op, ": the weight must be contiguous CPU bf16 [Np/16, Kp/32, 16, 32] (amx_pack) "
              "with Np a multiple of 32 and Kp=", kp, ", got ", w.sizes(), " ", w.scalar_type());
  return run_gemm(op, a, reinterpret_cast<const uint16_t*>(w.data_ptr()), nullptr,
                  w.size(0) * kAmxRows, ra, rw, chunk, m, n, ga, gw, bias, out_dtype);
}

// The packed tiles of an E8M0 weight [n, k] of this block size (cpu_pack_weight's codes and
// scales), checked as the integer kernels check them.
PackedCodes packed_codes(const char* op, const at::Tensor& codes, const at::Tensor& scales,
                         int64_t n, int64_t k, int64_t block) {
  TORCH_CHECK((block == 16 || block == 32) && n > 0 && k > 0, op,
              ": block must be 16 or 32 and N, K positive, got block=", block, " N=", n, " K=", k);
  return gemm_detail::e8m0_weight_tiles(op, codes, scales, at::Tensor(), n, k, block, block);
}

// cpu_amx_gemm with the weight decoded per task from its packed FP4 tiles (E8M0 formats):
// the same B tiles, the same result bit for bit, no bf16 copy of the weight.
at::Tensor amx_packed_gemm(const at::Tensor& a, const at::Tensor& codes, const at::Tensor& scales,
                           int64_t block, int64_t k, const at::Tensor& ra, const at::Tensor& rw,
                           int64_t chunk, int64_t m, int64_t n,
                           const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  const char* op = "vllm_mxplus::cpu_amx_packed_gemm";
  check_activations(op, a, chunk);
  const PackedCodes pc = packed_codes(op, codes, scales, n, k, block);
  TORCH_CHECK(a.size(1) >= pc.groups * 16, op, ": Kp=", a.size(1), " is shorter than the weight's ",
              pc.groups * 16, " packed elements");
  return run_gemm(op, a, nullptr, &pc, cdiv(n, kAmxBlock) * kAmxBlock, ra, rw, chunk, m, n,
                  c10::nullopt, c10::nullopt, bias, out_dtype);
}

// The B tiles the packed GEMM decodes, bf16 [Np / 16, Kp / 32, 16, 32] (amx_pack's layout,
// Np = n rounded up to 32): by the vector decoder the GEMM uses (AMX hosts only) or, scalar,
// by the reference decoder (every host). For the tests: both must equal amx_pack of the
// path's bf16 operand.
at::Tensor amx_unpack(const at::Tensor& codes, const at::Tensor& scales, int64_t block, int64_t k,
                      int64_t n, int64_t kp, bool scalar) {
  const char* op = "vllm_mxplus::cpu_amx_unpack";
  const PackedCodes pc = packed_codes(op, codes, scales, n, k, block);
  TORCH_CHECK(kp % kAmxStepK == 0 && kp >= pc.groups * 16, op, ": Kp=", kp,
              " must be a multiple of 32 covering ", pc.groups * 16, " elements");
  const int64_t tiles = cdiv(n, kAmxBlock) * 2, steps = kp / kAmxStepK;
  at::Tensor out =
      at::empty({tiles, steps, kAmxRows, kAmxStepK}, codes.options().dtype(at::kBFloat16));
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
#ifdef MXPLUS_AMX
  TORCH_CHECK(scalar || amx_bf16_usable(), op, ": the vector decoder needs an AMX host");
#else
  TORCH_CHECK(scalar, op, ": this build has no vector decoder");
#endif
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t s = 0; s < steps; ++s) {
      uint16_t* dst = o + (t * steps + s) * kTileElems;
#ifdef MXPLUS_AMX
      if (!scalar) {
        decode_tile(pc, t, s, dst);
        continue;
      }
#endif
      decode_tile_scalar(pc, t, s, dst);
    }
  }
  return out;
}

// out[i] = bf16(codes[i] * h) for len elements of one block (h half its scale): the fp32
// product is exact, so its top 16 bits are its bf16 value; a NaN keeps a quiet NaN.
inline void expand_block(const int8_t* codes, float h, int64_t len, uint16_t* out) {
  int64_t i = 0;
#ifdef MXPLUS_AVX512
  for (; i + 16 <= len; i += 16) {
    const __m512 v = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(codes + i)))),
        _mm512_set1_ps(h));
    __m512i bits = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                 _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i*)(out + i), _mm512_cvtepi32_epi16(bits));
  }
#endif
  for (; i < len; ++i) {
    const float v = static_cast<float>(codes[i]) * h;
    out[i] = v != v ? uint16_t(0x7FC0) : uint16_t(f2u(v) >> 16);
  }
}

// The activation operand of the path in bf16: a[m, k] = code[m, k] * half[m, k / block]
// (codes are 2 * value, half the block scale / 2: an exact bf16 product), zero-padded to
// [Mp, Kp]. The fp32 product is exact, so its top 16 bits are its bf16 value; a NaN keeps a
// quiet NaN.
at::Tensor amx_act_operand(const at::Tensor& codes, const at::Tensor& half, int64_t block,
                           int64_t mp, int64_t kp) {
  const char* op = "vllm_mxplus::cpu_amx_act_operand";
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.device().is_cpu(),
              op, ": codes must be contiguous CPU int8 [M, K], got ", codes.sizes(), " ",
              codes.scalar_type());
  const int64_t m = codes.size(0), k = codes.size(1);
  TORCH_CHECK(block > 0 && mp >= m && kp >= k, op, ": bad block / padding for codes ",
              codes.sizes(), ": block=", block, " Mp=", mp, " Kp=", kp);
  const int64_t nb = cdiv(k, block);
  TORCH_CHECK(half.scalar_type() == at::kFloat && half.is_contiguous() && half.dim() == 2 &&
                  half.size(0) == m && half.size(1) >= nb,
              op, ": half scales must be contiguous fp32 [", m, ", >= ", nb, "], got ",
              half.sizes());
  at::Tensor out = at::zeros({mp, kp}, codes.options().dtype(at::kBFloat16));
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* h = half.data_ptr<float>();
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t hs = half.size(1);
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* cr = c + r * k;
      const float* hr = h + r * hs;
      uint16_t* orow = o + r * kp;
      for (int64_t k0 = 0; k0 < k; k0 += block) {
        expand_block(cr + k0, hr[k0 / block], std::min(block, k - k0), orow + k0);
      }
    }
  });
  return out;
}

// The E8M0 / MX+ activation operand straight from the rows x [M, K] (any float dtype): each
// row quantized by quant_row (the codes, scales and MBS bytes of cpu_act_quant, bit-exact with
// formats) and expanded at once to bf16 [Mp, Kp] (a = code * 2^(e - 128), zero-padded, NaN in
// a NaN block), with ra fp32 [Mp, chunks] = fl(1 / F) of the row's MBS bytes (1 without them;
// 0 in padding rows). One pass over x instead of cpu_act_quant + a gather + the expansion.
std::tuple<at::Tensor, at::Tensor> amx_act_quant(const at::Tensor& x, int64_t block, int64_t rule,
                                                 bool mbs, int64_t macro, int64_t mp, int64_t kp,
                                                 int64_t chunks) {
  const char* op = "vllm_mxplus::cpu_amx_act_quant";
  check_rule(block, rule, mbs, macro);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) > 0, op,
              ": x must be a CPU [M, K] tensor, got ", x.sizes());
  const int64_t m = x.size(0), k = x.size(1), nb = cdiv(k, block);
  TORCH_CHECK(mp >= m && mp % kAmxBlock == 0 && kp >= nb * block && kp % kAmxStepK == 0 &&
                  chunks >= 0,
              op, ": Mp=", mp, " Kp=", kp, " do not pad [", m, ", ", k, "] to tiles");
  TORCH_CHECK(!mbs || (chunks == cdiv(k, macro) && macro % kAmxStepK == 0), op,
              ": with MBS the chunks are the macro blocks (", cdiv(k, macro), "), got ", chunks);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor a = at::empty({mp, kp}, x.options().dtype(at::kBFloat16));
  at::Tensor ra = at::empty({mp, chunks}, x.options().dtype(at::kFloat));
  static const auto half_scale = [] {  // 2^(e - 128): half the block scale (codes are 2 * v)
    std::array<float, 256> t{};
    for (int e = 0; e < 255; ++e) t[e] = pow2f(e - 128);
    t[255] = std::numeric_limits<float>::quiet_NaN();
    return t;
  }();
  const float* xp = xf.data_ptr<float>();
  uint16_t* ap = reinterpret_cast<uint16_t*>(a.data_ptr());
  float* rp = ra.data_ptr<float>();
  at::parallel_for(0, mp, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> ybuf(mbs ? k : 0);
    std::vector<int8_t> codes(nb * block);
    std::vector<uint8_t> scales(nb), mbytes(mbs ? cdiv(k, macro) : 0);
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* orow = ap + r * kp;
      if (r >= m) {  // padding rows
        std::memset(orow, 0, kp * 2);
        for (int64_t c = 0; c < chunks; ++c) rp[r * chunks + c] = 0.0f;
        continue;
      }
      quant_row(xp + r * k, k, block, static_cast<int>(rule), mbs, macro, codes.data(),
                scales.data(), mbytes.data(), nullptr, ybuf.data());
      for (int64_t c = 0; c < chunks; ++c) {
        rp[r * chunks + c] = mbs ? 1.0f / mbs_factor(mbytes[c]) : 1.0f;
      }
      for (int64_t b = 0; b < nb; ++b) {
        expand_block(codes.data() + b * block, half_scale[scales[b]], block, orow + b * block);
      }
      if (kp > nb * block) std::memset(orow + nb * block, 0, (kp - nb * block) * 2);
    }
  });
  return {a, ra};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mxplus, m) {
  m.def("cpu_amx_available() -> int", &amx_available);
  m.def("cpu_amx_gemm(Tensor a, Tensor w, Tensor ra, Tensor rw, int chunk, int m, int n, "
        "Tensor? ga, Tensor? gw, Tensor? bias, ScalarType out_dtype) -> Tensor",
        cpu_kernel(&amx_gemm));
  m.def("cpu_amx_packed_gemm(Tensor a, Tensor codes, Tensor scales, int block, int k, Tensor ra, "
        "Tensor rw, int chunk, int m, int n, Tensor? bias, ScalarType out_dtype) -> Tensor",
        cpu_kernel(&amx_packed_gemm));
  m.def("cpu_amx_unpack(Tensor codes, Tensor scales, int block, int k, int n, int kp, "
        "bool scalar) -> Tensor",
        cpu_kernel(&amx_unpack));
  m.def("cpu_amx_act_operand(Tensor codes, Tensor half, int block, int mp, int kp) -> Tensor",
        cpu_kernel(&amx_act_operand));
  m.def("cpu_amx_act_quant(Tensor x, int block, int rule, bool mbs, int macro, int mp, int kp, "
        "int chunks) -> (Tensor, Tensor)",
        cpu_kernel(&amx_act_quant));
}

}  // namespace mxplus_cpu
