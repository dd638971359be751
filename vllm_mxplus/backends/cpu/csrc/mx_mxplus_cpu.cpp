// MX+ on the CPU integer path (docs/numerics.md, "MX+" and "Kernel numerics and error
// bounds"): block 32, `ocp` E8M0 scales X, and per block one block-max element whose value
// is +-(4 + j/2) * X (j = 0..7) instead of an E2M1 value. In the integer GEMM's units every
// element is 2 * value, an exact integer: E2M1 elements 0, +-1, +-2, +-3, +-4, +-6, +-8,
// +-12, block maxima +-(8 + j) in +-8 .. +-15. So MX+ runs the E8M0 GEMM (mx_gemm_cpu.cpp,
// block 32, no MBS) with
//
//   I_b = sum over k in b, k != iw_b of (2 va_k) * (2 vw_k)  +  (2 va[iw_b]) * (2 vw[iw_b])
//
// where iw_b is the weight row's block-max index: the weight tiles hold that element as code
// 0 (it adds nothing to the packed dot product) and keep its index and 2 * value apart
// (WeightTiles::bm); the kernel adds the second term to the block's int32 sum (exact). The
// activation's block max is just a larger int8 code (quant_row with kRuleMxplus). Both
// sums are exact int32 (|I_b| <= 32 * 15 * 15).
//
// Error bound against y64 = the float64 sum of the spec's fp32 x_hat * w_hat + b (both exact:
// a <= 4-bit significand times a power of two; n_b blocks; u = 2^-24; no partial sum
// overflowing fp32):
//   |y - y64| <= (n_b + 2) * u * (sum_k |x_hat_k| |w_hat_k| + |b|) + 2^-150 * n_b
// Each block term I_b * 2^(ea + ew - 256) is exact unless it falls below fp32's normal range
// (then rounded once, by at most 2^-150); the n_b - 1 additions of block terms and the bias
// addition each err by at most u of a partial sum bounded by sum |x_hat||w_hat| + |b| (an
// addition with a subnormal result is exact); u more covers the second-order terms while
// n_b u < 2^-10. This is the E8M0 bound without its MBS terms (n_c = 0 divisions, no spec
// rounding of x_hat or w_hat). A NaN block (scale 255) on either side gives NaN outputs, as
// does a block whose values overflow fp32 (E8M0 codes 253 / 254, never produced from finite
// fp32 inputs by the `ocp` rule).
// Compiled with -ffp-contract=off: no multiply-add is fused.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "mx_tiles.h"

namespace mxplus_cpu {
namespace {

using namespace gemm_detail;

constexpr int64_t kBlock = 32;      // MX_BLOCK
constexpr int kNoBlockMax = 255;    // NO_BLOCK_MAX

// Checkpoint layout (codes [N, ceil(K/2)], E8M0 scales [N, nb], block_max_index [N, nb]) ->
// (codes tiles with each block max as code 0, scale tiles, block-max tiles [nt, nb * 32]:
// see WeightTiles::bm). A block whose values overflow fp32 gets scale code 255 (NaN).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mxplus_pack_weight(const at::Tensor& codes,
                                                                  const at::Tensor& scales,
                                                                  const at::Tensor& bm_index,
                                                                  int64_t k) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && k > 0 &&
                  codes.size(1) == (k + 1) / 2 && codes.device().is_cpu(),
              "vllm_mxplus::cpu_mxplus_pack_weight: weight codes must be CPU uint8 [N, "
              "ceil(K/2)] for K=", k, ", got ", codes.sizes(), " ", codes.scalar_type());
  const int64_t N = codes.size(0), nb = cdiv(k, kBlock), nt = cdiv(N, kTileN);
  TORCH_CHECK(bm_index.dim() == 2 && bm_index.scalar_type() == at::kByte &&
                  bm_index.size(0) == N && bm_index.size(1) == nb && bm_index.device().is_cpu(),
              "vllm_mxplus::cpu_mxplus_pack_weight: block_max_index must be CPU uint8 [", N,
              ", ", nb, "], got ", bm_index.sizes(), " ", bm_index.scalar_type());
  const at::Tensor bmi = bm_index.contiguous();
  const uint8_t* ip = bmi.data_ptr<uint8_t>();
  for (int64_t i = 0; i < N * nb; ++i)
    TORCH_CHECK(ip[i] < kBlock || ip[i] == kNoBlockMax, "vllm_mxplus::cpu_mxplus_pack_weight: "
                "block_max_index ", static_cast<int>(ip[i]), " at row ", i / nb, ", block ",
                i % nb, " is neither < 32 nor 255 (none)");
  // The codes with every block max zeroed, and the block maxima apart.
  at::Tensor c = codes.contiguous().clone();
  uint8_t* cp = c.data_ptr<uint8_t>();
  const int64_t kc = c.size(1);
  at::Tensor wbm = zeros_tiles({nt, nb * 2 * kTileN}, codes.options());
  uint8_t* bp = wbm.data_ptr<uint8_t>();
  std::vector<uint8_t> twice(N * nb, 0);  // 2 * |value| of each block max (0: none)
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t kk = b * kBlock + ip[n * nb + b];
        if (ip[n * nb + b] == kNoBlockMax || kk >= k) continue;  // past K: a padding zero
        uint8_t& byte = cp[n * kc + (kk >> 1)];
        const int code = (kk & 1) ? (byte >> 4) : (byte & 0xF);
        byte = static_cast<uint8_t>((kk & 1) ? (byte & 0x0F) : (byte & 0xF0));
        const int v = 8 + (code & 7);
        uint8_t* p = bp + ((n / kTileN) * nb + b) * 2 * kTileN + n % kTileN;
        p[0] = ip[n * nb + b];
        p[kTileN] = static_cast<uint8_t>(static_cast<int8_t>((code & 8) ? -v : v));
        twice[n * nb + b] = static_cast<uint8_t>(v);
      }
  });
  auto tiles = pack_tiles(c, scales, at::empty({0, 0}, codes.options()), k, kBlock, kBlock);
  at::Tensor wc = std::get<0>(tiles), ws = std::get<1>(tiles);
  uint8_t* sp = ws.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t& sc = sp[((n / kTileN) * nb + b) * kTileN + n % kTileN];
      if (overflows(sc, twice[n * nb + b])) sc = kE8m0Nan;  // the spec's w_hat is +-Inf
    }
  return {wc, ws, wbm};
}

at::Tensor mxplus_linear(const at::Tensor& x, const at::Tensor& wcodes, const at::Tensor& wscales,
                         const at::Tensor& wbm, int64_t n, int64_t k,
                         const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  TORCH_CHECK(k > 0 && n > 0, "vllm_mxplus::cpu_mxplus_linear: N and K must be positive");
  const int64_t nb = cdiv(k, kBlock), nt = cdiv(n, kTileN), groups = nb * kBlock / kGroupK;
  auto check = [&](const at::Tensor& t, int64_t cols, const char* what) {
    TORCH_CHECK(t.scalar_type() == at::kByte && t.is_contiguous() && t.device().is_cpu() &&
                    t.sizes() == at::IntArrayRef({nt, cols}),
                "vllm_mxplus::cpu_mxplus_linear: ", what, " must be contiguous CPU uint8 [", nt,
                ", ", cols, "] (cpu_mxplus_pack_weight), got ", t.sizes());
  };
  check(wcodes, groups * kGroupBytes, "packed weight codes");
  check(wscales, nb * kTileN, "packed weight scales");
  check(wbm, nb * 2 * kTileN, "packed block maxima");
  WeightTiles w{wcodes.data_ptr<uint8_t>(), wscales.data_ptr<uint8_t>(), nullptr, nt, groups,
                nb, 0, n};
  w.bm = wbm.data_ptr<uint8_t>();
  return tile_linear(x, kBlock, kRuleMxplus, false, kBlock, w, k, bias, out_dtype,
                     "vllm_mxplus::cpu_mxplus_linear");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mxplus, m) {
  m.def("cpu_mxplus_pack_weight(Tensor codes, Tensor scales, Tensor bm_index, int k) -> "
        "(Tensor, Tensor, Tensor)",
        cpu_kernel(&mxplus_pack_weight));
  m.def("cpu_mxplus_linear(Tensor x, Tensor wcodes, Tensor wscales, Tensor wbm, int n, int k, "
        "Tensor? bias, ScalarType out_dtype) -> Tensor",
        cpu_kernel(&mxplus_linear));
}

}  // namespace mxplus_cpu
