// The CPU W4A4 linear of the E8M0 formats on integer dot products (docs/numerics.md,
// "Kernel numerics and error bounds"):
//
//   y[m, n] = sum over macro chunks c of  S_c * t[m,n,c]  (+ bias[n]),
//   t       = fl(fl(1 / Fa[m,c]) * fl(1 / Fw[n,c]))
//   S_c     = sum over blocks b in c of   I_b * 2^(ea[m,b] + ew[n,b] - 256)
//   I_b     = sum over k in b of          (2 va_k) * (2 vw_k)        (exact int32)
//
// with va, vw the E2M1 values of the activation and weight codes, ea, ew their E8M0 codes and
// F = 1 + m/256 the MBS factors (1 for a side without MBS; without MBS on either side the
// whole row is one chunk and there is no scaling). The activation rows are quantized once
// per call (quant_row, bit-exact with formats.quantize); the weight stays packed (0.5 byte
// per element + one E8M0 byte per block + one MBS byte per macro block), re-ordered at load
// by cpu_pack_weight into 16-row tiles. No fp32 copy of the weight exists at any time.
//
// What is computed, exactly: I_b is exact (|I_b| <= 32 * 144). I_b * 2^e is formed by
// vscalefps (scalar: ldexpf), exact unless it leaves the fp32 normal range (then correctly
// rounded, to a subnormal, 0 or Inf); S_c adds those terms in fp32 in block order; t is two
// IEEE reciprocals and their product (one of them 1 where a side has no MBS); y = fma(S_c, t,
// y) chunk by chunk in order (one rounding each), then the bias. The AMX tile paths scale a
// chunk by the same t and fma (mx_amx_int8_cpu.cpp, mx_amx_cpu.cpp), so a chunk whose sum is
// exact on both enters y with the same bits. A NaN scale code (255) on either side
// makes its terms NaN; so does a block holding an element whose spec value overflows fp32
// (E8M0 code 253 or 254 with a large code: the spec's x_hat or w_hat is +-Inf there, and
// every output it touches is +-Inf or NaN; here NaN).
//
// Error bound against the spec (u = 2^-24; x_hat, w_hat the spec's fp32 values, e.g.
// x_hat = fp32((va * Xa) / Fa); y64 = the float64 sum of x_hat * w_hat + b; n_b blocks and
// n_c chunks in K; no partial sum overflowing fp32):
//   |y - y64| <= (n_b + n_c + 7) * u * (sum_k |x_hat_k| |w_hat_k| + |b|)
//                + 2^-146 * (sum_k |x_hat_k| + sum_k |w_hat_k| + n_b)
// The first term: 2u from the two spec divisions by F (x_hat and w_hat are the quotients
// rounded once each; the integer path divides the exact sum once per chunk instead), at most
// n_b + n_c + 1 fp32 additions (block terms, chunk fmas, bias), each off by u of a partial
// sum bounded by the same magnitudes, 3u for t per chunk, and u more for the
// second-order terms while (n_b + n_c) u < 2^-10. Without MBS the spec's values are exact
// products and the 2u is not needed; the bound keeps it. The second (absolute) term covers
// roundings below the fp32 normal range (subnormal x_hat, w_hat, block terms or quotients),
// each at most 2^-150 per element, block or chunk.
// Compiled with -ffp-contract=off: no multiply-add is fused but the chunk's explicit fma.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstddef>
#include <optional>
#include <vector>

#include "mx_tile_avx2.h"
#include "mx_tile_avx512.h"
#include "mx_tile_avx512_panel.h"
#include "mx_tile_scalar.h"

namespace mxplus_cpu {
namespace {

using namespace gemm_detail;

#ifdef MXPLUS_AVX512
using FastArg = const TileRows*;  // the rows' FastRows for the fast block terms, or nullptr
#else
using FastArg = std::nullptr_t;  // the fast block terms are AVX-512's
#endif

#ifdef MXPLUS_AVX512
// Rows m0 .. m0+mt (mt <= MT) against NTP tiles from t; fast: try the fast block terms first
// (pr the rows' FastRows; never with BM), the general ones where `fast_block_terms` turns out
// not to hold for these rows and tiles (tile_avx512 tells).
template <int MT, int NTP, bool MBS, bool BM>
void tile_rows(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t, int64_t m0,
               int64_t mt, float* y, const float* bias, const TileRows* pr, bool fast) {
  if constexpr (MT > 1) {
    if (mt < MT) return tile_rows<MT - 1, NTP, MBS, BM>(w, a, s, t, m0, mt, y, bias, pr, fast);
  }
  if constexpr (BM) {
    tile_avx512<MT, NTP, 2, false, true>(w, a, s, t, m0, y, bias);
    return;
  }
  if (fast && (s.gpb == 1 ? tile_avx512<MT, NTP, 1, MBS, false, true>(w, a, s, t, m0, y, bias, pr)
                          : tile_avx512<MT, NTP, 2, MBS, false, true>(w, a, s, t, m0, y, bias, pr)))
    return;
  if (s.gpb == 1) {
    tile_avx512<MT, NTP, 1, MBS, false>(w, a, s, t, m0, y, bias);
  } else {
    tile_avx512<MT, NTP, 2, MBS, false>(w, a, s, t, m0, y, bias);
  }
}

// Pairs of weight tiles share each activation broadcast (half the loads per product); an odd
// last tile runs alone. Register tiles: 2 x 4 rows, or 1 x 8. With pr (the rows' FastRows; not
// for MX+) a row tile takes the fast block terms where they hold (tile_rows), tried wherever
// some weight codes could let them: not for a row with a NaN block, nor for rows whose
// exponents no one weight code brings into range together (fast_block_terms).
inline bool rows_may_be_fast(const TileRows& pr, int64_t m0, int64_t mt) {
  int lo = 0, hi = kE8m0Nan - 1;  // the weight codes that would suit every row
  for (int64_t m = m0; m < m0 + mt; ++m) {
    const RowExp& r = pr.range[m];
    if (!r.finite) return false;
    lo = std::max(lo, -126 - r.lo);
    hi = std::min(hi, kFastMaxExp - r.hi);
  }
  return lo <= hi;
}

template <bool MBS, bool BM>
void tiles_rows(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t, int64_t tend,
                int64_t m0, int64_t mt, float* y, const float* bias, FastArg pr) {
  for (int64_t mm = m0; mm < m0 + mt; mm += 4) {
    const int64_t rows = std::min<int64_t>(4, m0 + mt - mm);
    const bool fast = pr && rows_may_be_fast(*pr, mm, rows);
    int64_t tt = t;
    for (; tt + 2 <= tend; tt += 2)
      tile_rows<4, 2, MBS, BM>(w, a, s, tt, mm, rows, y, bias, pr, fast);
    if (tt < tend) tile_rows<4, 1, MBS, BM>(w, a, s, tt, mm, rows, y, bias, pr, fast);
  }
}
#elif defined(MXPLUS_AVX2)
template <int MT, bool MBS, bool BM>
void half_rows(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t, int h,
               int64_t m0, int64_t mt, float* y, const float* bias) {
  if constexpr (MT > 1) {
    if (mt < MT) return half_rows<MT - 1, MBS, BM>(w, a, s, t, h, m0, mt, y, bias);
  }
  if constexpr (BM) tile_avx2<MT, 2, false, true>(w, a, s, t, h, m0, y, bias);
  else if (s.gpb == 1) tile_avx2<MT, 1, MBS, false>(w, a, s, t, h, m0, y, bias);
  else tile_avx2<MT, 2, MBS, false>(w, a, s, t, h, m0, y, bias);
}

// A single activation row (decode) runs whole 16-row tiles (tile16_avx2); more rows run half
// tiles, 4 activation rows at a time.
template <bool MBS, bool BM>
void tiles_rows(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t, int64_t tend,
                int64_t m0, int64_t mt, float* y, const float* bias, FastArg) {
  if (!BM && mt == 1) {
    const RowExp re = row_exp_range(a.ea + m0 * a.nb, a.nb);
    for (int64_t tt = t; tt < tend; ++tt) {
      if (s.gpb == 1) tile16_avx2<1, MBS>(w, a, s, tt, m0, re, y, bias);
      else tile16_avx2<2, MBS>(w, a, s, tt, m0, re, y, bias);
    }
    return;
  }
  for (int64_t mm = m0; mm < m0 + mt; mm += 4)
    for (int64_t tt = t; tt < tend; ++tt)
      for (int h = 0; h < 2 && tt * kTileN + 8 * h < w.n; ++h)
        half_rows<4, MBS, BM>(w, a, s, tt, h, mm, std::min<int64_t>(4, m0 + mt - mm), y, bias);
}
#else
template <bool MBS, bool BM>
void tiles_rows(const WeightTiles& w, const ActRows& a, const Shape& s, int64_t t, int64_t tend,
                int64_t m0, int64_t mt, float* y, const float* bias, FastArg) {
  for (int64_t tt = t; tt < tend; ++tt) {
    switch (mt) {
#define MXPLUS_TILE(T) case T: tile_scalar<T, MBS, BM>(w, a, s, tt, m0, y, bias); break;
      MXPLUS_TILE(1) MXPLUS_TILE(2) MXPLUS_TILE(3) MXPLUS_TILE(4) MXPLUS_TILE(5)
      MXPLUS_TILE(6) MXPLUS_TILE(7)
#undef MXPLUS_TILE
      default: tile_scalar<kMaxTileM, MBS, BM>(w, a, s, tt, m0, y, bias); break;
    }
  }
}
#endif

// Threads over N (weight tiles); each thread walks its tiles kTilesPerPass at a time, and
// for each activation row tile runs those weight tiles, so the row tile is read from cache;
// then rounds the pass's outputs into the op's output dtype (LinearCall::store).
template <bool MBS, bool BM>
void gemm_tiles(const WeightTiles& w, const ActRows& a, const Shape& s, const LinearCall& c) {
  const int64_t M = c.M;
  float* const y = c.y;
  const float* const bias = c.bias_ptr();
#ifdef MXPLUS_AVX512
  // the fast block terms of the AVX-512 register tiles (not MX+'s)
  std::optional<FastRows> fr;
  if (!BM) fr.emplace(a, M, w.groups);
  const TileRows pr = fr ? fr->rows() : TileRows{};
  const FastArg fast_rows = fr ? &pr : nullptr;
#else
  const FastArg fast_rows = nullptr;
#endif
  at::parallel_for(0, w.nt, tile_grain(M, a.kp), [&](int64_t t0, int64_t t1) {
    for (int64_t tp = t0; tp < t1; tp += kTilesPerPass) {
      const int64_t tend = std::min(tp + kTilesPerPass, t1);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTileM)
        tiles_rows<MBS, BM>(w, a, s, tp, tend, m0, std::min<int64_t>(kMaxTileM, M - m0), y,
                            bias, fast_rows);
      c.store(0, M, tp * kTileN, std::min(tend * kTileN, w.n));
    }
  });
}

#ifdef MXPLUS_AVX512
// Several activation rows on AVX-512 (mx_tile_avx512_panel.h): threads over N; each thread
// takes the rows in chunks of about kPanelActBytes of codes, and for each chunk decodes its
// weight tiles kPanelTiles at a time into panels that all the chunk's rows then run against,
// the next panels' packed codes fetched into L2 meanwhile (PanelPrefetch), and rounds the
// chunk's outputs of its tiles into the op's output dtype (LinearCall::store).
template <bool MBS>
void gemm_panels(const WeightTiles& w, const ActRows& a, const Shape& s, const LinearCall& c) {
  const int64_t M = c.M;
  float* const y = c.y;
  const float* const bias = c.bias_ptr();
  const FoldRows fr(a, s, M);
  const int64_t mc = std::max<int64_t>(kPanelRows, kPanelActBytes / a.kp / kPanelRows * kPanelRows);
  at::parallel_for(0, w.nt, tile_grain(M, a.kp), [&](int64_t t0, int64_t t1) {
    // 64-byte aligned scratch (the CPU allocator's alignment) for kPanelTiles panels
    at::Tensor ops = at::empty({kPanelTiles * w.groups * kPanelGroupBytes}, at::kByte);
    at::Tensor eb = at::empty({kPanelTiles * w.nb * kTileN}, at::kInt);
    std::vector<uint8_t> folded(kPanelTiles * s.nc);
    for (int64_t r0 = 0; r0 < M; r0 += mc) {
      const int64_t r1 = std::min(M, r0 + mc);
      for (int64_t tp = t0; tp < t1; tp += kPanelTiles) {
        const int ntp = static_cast<int>(std::min<int64_t>(kPanelTiles, t1 - tp));
        Panel pn[kPanelTiles];
        for (int j = 0; j < ntp; ++j)
          pn[j] = decode_panel(w, s, tp + j,
                               ops.data_ptr<uint8_t>() + j * w.groups * kPanelGroupBytes,
                               eb.data_ptr<int32_t>() + j * w.nb * kTileN,
                               folded.data() + j * s.nc);
        const int64_t tn = std::min(tp + kPanelTiles, t1);
        PanelPrefetch pf{w.codes + tn * w.groups * kGroupBytes,
                         w.codes + std::min(tn + kPanelTiles, t1) * w.groups * kGroupBytes};
        for (int64_t m0 = r0; m0 < r1; m0 += kPanelRows) {
          const int64_t mt = std::min<int64_t>(kPanelRows, r1 - m0);
          if (ntp == kPanelTiles)
            panel_rows<kPanelRows, kPanelTiles, MBS>(pn, w, a, fr, s, tp, m0, mt, y, bias, &pf);
          else
            panel_rows<kPanelRows, 1, MBS>(pn, w, a, fr, s, tp, m0, mt, y, bias, &pf);
        }
      }
      c.store(r0, r1, t0 * kTileN, std::min(t1 * kTileN, w.n));
    }
  });
}
#endif

// MX+ (BM) and, off AVX-512 or with few rows, the register tiles; else the panels.
template <bool MBS, bool BM>
void gemm(const WeightTiles& w, const ActRows& a, const Shape& s, const LinearCall& c) {
#ifdef MXPLUS_AVX512
  if (!BM && c.M >= kPanelMinRows) return gemm_panels<MBS>(w, a, s, c);
#endif
  gemm_tiles<MBS, BM>(w, a, s, c);
}

}  // namespace

// ---- shared with mx_mxplus_cpu.cpp and mx_nvfp4_cpu.cpp (mx_tiles.h) ------------------

// Checkpoint layout (codes [N, ceil(K/2)], scales [N, nb], mbs [N, nm]) -> tiles. The scales
// are copied, except that a block whose dequantized values overflow fp32 gets code 255. Tile t,
// group g (elements 16g .. 16g+15 of rows 16t .. 16t+15), 128 bytes: byte 64q + 4i + j holds
// row 16t+i's element 16g + 8q + j in its low nibble and 16g + 8q + 4 + j in its high nibble,
// so the low / high nibbles of each 64-byte half are vpdpbusd operands (4 elements per row
// lane). Rows past N and elements past K are code 0.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gemm_detail::pack_tiles(const at::Tensor& codes,
                                                           const at::Tensor& scales,
                                                           const at::Tensor& mbs, int64_t k,
                                                           int64_t block, int64_t macro) {
  TORCH_CHECK(block == 16 || block == 32, "vllm_mxplus::cpu_pack_weight: block must be 16 or "
              "32, got ", block);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && k > 0 &&
                  codes.size(1) == (k + 1) / 2 && codes.device().is_cpu(),
              "vllm_mxplus::cpu_pack_weight: weight codes must be CPU uint8 [N, ceil(K/2)] for "
              "K=", k, ", got ", codes.sizes(), " ", codes.scalar_type());
  const int64_t N = codes.size(0), nb = cdiv(k, block), nt = cdiv(N, kTileN);
  const int64_t groups = nb * block / kGroupK;
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kByte && scales.size(0) == N &&
                  scales.size(1) == nb,
              "vllm_mxplus::cpu_pack_weight: weight scales must be uint8 [", N, ", ", nb,
              "], got ", scales.sizes(), " ", scales.scalar_type());
  const bool has_mbs = mbs.numel() > 0;
  const int64_t nm = has_mbs ? cdiv(k, macro) : 0;
  TORCH_CHECK(!has_mbs || (macro > 0 && macro % block == 0 && mbs.dim() == 2 &&
                           mbs.scalar_type() == at::kByte && mbs.size(0) == N &&
                           mbs.size(1) == nm),
              "vllm_mxplus::cpu_pack_weight: weight MBS bytes must be uint8 [", N, ", ",
              cdiv(k, std::max<int64_t>(macro, 1)), "] with a macro block multiple of ", block,
              ", got ", mbs.sizes(), " (macro ", macro, ")");
  const at::Tensor c = codes.contiguous(), s = scales.contiguous(), mb = mbs.contiguous();
  auto opts = codes.options();
  at::Tensor wc = zeros_tiles({nt, groups * kGroupBytes}, opts);  // huge pages where offered
  at::Tensor ws = zeros_tiles({nt, nb * kTileN}, opts);
  at::Tensor wm = zeros_tiles({has_mbs ? nt : 0, nm * kTileN}, opts);
  const uint8_t* cp = c.data_ptr<uint8_t>();
  const int64_t kc = c.size(1);
  auto code_at = [&](int64_t n, int64_t kk) -> int {
    if (n >= N || kk >= k) return 0;
    const uint8_t byte = cp[n * kc + (kk >> 1)];
    return (kk & 1) ? (byte >> 4) : (byte & 0xF);
  };
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      uint8_t* out = wc.data_ptr<uint8_t>() + t * groups * kGroupBytes;
      for (int64_t g = 0; g < groups; ++g)
        for (int q = 0; q < 2; ++q)
          for (int i = 0; i < kTileN; ++i)
            for (int j = 0; j < 4; ++j) {
              const int64_t n = t * kTileN + i, kk = g * kGroupK + 8 * q + j;
              out[g * kGroupBytes + 64 * q + 4 * i + j] =
                  static_cast<uint8_t>(code_at(n, kk) | (code_at(n, kk + 4) << 4));
            }
      for (int i = 0; i < kTileN && t * kTileN + i < N; ++i) {
        const int64_t n = t * kTileN + i;
        for (int64_t b = 0; b < nb; ++b) {
          int sc = s.data_ptr<uint8_t>()[n * nb + b];
          int big = 0;
          for (int64_t kk = b * block; sc >= 253 && kk < (b + 1) * block; ++kk)
            big = std::max(big, static_cast<int>(std::abs(kE2M1x2[code_at(n, kk)])));
          if (overflows(sc, big)) sc = kE8m0Nan;  // the spec's w_hat is +-Inf: NaN outputs
          ws.data_ptr<uint8_t>()[(t * nb + b) * kTileN + i] = static_cast<uint8_t>(sc);
        }
        for (int64_t cc = 0; cc < nm; ++cc)
          wm.data_ptr<uint8_t>()[(t * nm + cc) * kTileN + i] = mb.data_ptr<uint8_t>()[n * nm + cc];
      }
    }
  });
  return {wc, ws, wm};
}

gemm_detail::LinearCall gemm_detail::linear_call(const at::Tensor& x, int64_t n, int64_t k,
                                                 int64_t block,
                                                 const c10::optional<at::Tensor>& bias,
                                                 at::ScalarType out_dtype, int64_t extra,
                                                 const char* op) {
  TORCH_CHECK(x.device().is_cpu(), op, ": x must be on the CPU");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, op, ": x has last dim ", x.size(-1),
              " but the weight has K=", k);
  LinearCall c;
  c.out_shape.assign(x.sizes().begin(), x.sizes().end());
  c.out_shape.back() = n;
  c.M = x.numel() / k;
  c.k = k;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, op, ": bias has ", bias->numel(), " elements, expected N=",
                n);
    c.bias = bias->to(at::kFloat).contiguous();
  }
  c.x = rows_operand(x, k);
  const int64_t nb = cdiv(k, block), M = c.M;
  // the buffers' offsets in the scratch, each 64-byte aligned
  int64_t at_bytes = 0;
  auto carve = [&](int64_t bytes) {
    const int64_t off = at_bytes;
    at_bytes += (bytes + 63) / 64 * 64;
    return off;
  };
  const int64_t o_codes = carve(M * nb * block), o_corr = carve(M * nb * 4),
                o_scale = carve(M * nb * 4), o_extra = carve(M * extra * 4);
  const bool f32_out = out_dtype == at::kFloat;
  const int64_t o_y = f32_out ? 0 : carve(M * n * 4);
  // 64-byte aligned (the CPU allocator's alignment)
  c.scratch = at::empty({std::max<int64_t>(at_bytes, 1)}, x.options().dtype(at::kByte));
  uint8_t* base = c.scratch.data_ptr<uint8_t>();
  c.codes = reinterpret_cast<int8_t*>(base + o_codes);
  c.corr = reinterpret_cast<int32_t*>(base + o_corr);
  c.scale = reinterpret_cast<float*>(base + o_scale);
  c.extra = reinterpret_cast<float*>(base + o_extra);
  if (f32_out) {
    c.y32 = at::empty({M, n}, x.options().dtype(at::kFloat));
    c.y = c.y32.data_ptr<float>();
  } else {
    c.y = reinterpret_cast<float*>(base + o_y);
    if (out_dtype == at::kBFloat16 || out_dtype == at::kHalf)
      c.out = at::empty({M, n}, x.options().dtype(out_dtype));
  }
  return c;
}

at::Tensor gemm_detail::LinearCall::result(at::ScalarType out_dtype) const {
  if (y32.defined()) return y32.view(out_shape);
  if (out.defined()) return out.view(out_shape);
  const int64_t n = out_shape.back();
  const int64_t off = reinterpret_cast<const uint8_t*>(y) - scratch.data_ptr<uint8_t>();
  return scratch.narrow(0, off, M * n * 4).view(at::kFloat).view({M, n}).to(out_dtype).view(
      out_shape);
}

at::Tensor gemm_detail::tile_linear(const at::Tensor& x, int64_t block, int rule, bool act_mbs,
                                    int64_t macro, const WeightTiles& w, int64_t k,
                                    const c10::optional<at::Tensor>& bias,
                                    at::ScalarType out_dtype, const char* op) {
  const int64_t nm = cdiv(k, macro);
  LinearCall call = linear_call(x, w.n, k, block, bias, out_dtype, act_mbs ? nm : 0, op);
  const int64_t M = call.M, nb = cdiv(k, block), kp = nb * block;
  if (M == 0) return call.result(out_dtype);

  // Activation rows, quantized once per call.
  int8_t* const codes = call.codes;
  int32_t* const corr = call.corr;
  float* const scale = call.scale;
  float* const fap = act_mbs ? call.extra : nullptr;
  at::parallel_for(0, M, 8, [&](int64_t r0, int64_t r1) {
    std::vector<float> ybuf(act_mbs ? k : 0), xbuf(call.row_buf());
    std::vector<uint8_t> sc(nb), mb(nm);
    for (int64_t r = r0; r < r1; ++r) {
      int8_t* cr = codes + r * kp;
      int32_t* sums = corr + r * nb;
      quant_row(call.row(r, xbuf.data()), k, block, rule, act_mbs, macro, cr, sc.data(),
                mb.data(), sums, ybuf.data());
      for (int64_t b = 0; b < nb; ++b) {
        int big = 0;
        for (int64_t i = 0; sc[b] >= 253 && i < block; ++i)  // rare: see overflows()
          big = std::max(big, std::abs(static_cast<int>(cr[b * block + i])));
        sums[b] *= -kOffset;
        scale[r * nb + b] = sc[b] == kE8m0Nan || overflows(sc[b], big)
            ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(sc[b]) - 256.0f;
      }
      for (int64_t c = 0; act_mbs && c < nm; ++c) fap[r * nm + c] = mbs_factor(mb[c]);
    }
  });
  const bool any_mbs = act_mbs || w.mbs;
  TORCH_CHECK(!(any_mbs && w.bm), op, ": MX+ weights take no MBS");
  const ActRows a{codes, corr, scale, fap, kp, nb, nm};
  const Shape s{block / kGroupK, any_mbs ? macro / block : nb, any_mbs ? nm : 1, any_mbs};
  if (any_mbs) gemm<true, false>(w, a, s, call);
  else if (w.bm) gemm<false, true>(w, a, s, call);
  else gemm<false, false>(w, a, s, call);
  return call.result(out_dtype);
}

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_weight(const at::Tensor& codes,
                                                           const at::Tensor& scales,
                                                           const at::Tensor& mbs, int64_t k,
                                                           int64_t block, int64_t macro) {
  return pack_tiles(codes, scales, mbs, k, block, macro);
}

}  // namespace

WeightTiles gemm_detail::e8m0_weight_tiles(const char* op, const at::Tensor& codes,
                                           const at::Tensor& scales, const at::Tensor& mbs,
                                           int64_t n, int64_t k, int64_t block, int64_t macro) {
  const int64_t nb = cdiv(k, block), kp = nb * block, nt = cdiv(n, kTileN);
  const bool has_mbs = mbs.defined() && mbs.numel() > 0;
  const int64_t nm = cdiv(k, macro);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.sizes() == at::IntArrayRef({nt, kp / kGroupK * kGroupBytes}),
              op, ": packed weight codes must be contiguous uint8 [", nt, ", ",
              kp / kGroupK * kGroupBytes, "] (cpu_pack_weight), got ", codes.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kByte && scales.is_contiguous() &&
                  scales.sizes() == at::IntArrayRef({nt, nb * kTileN}),
              op, ": packed weight scales must be contiguous uint8 [", nt, ", ", nb * kTileN,
              "] (cpu_pack_weight), got ", scales.sizes());
  TORCH_CHECK(!has_mbs || (mbs.scalar_type() == at::kByte && mbs.is_contiguous() &&
                           mbs.sizes() == at::IntArrayRef({nt, nm * kTileN})),
              op, ": packed weight MBS bytes must be contiguous uint8 [", nt, ", ", nm * kTileN,
              "] (cpu_pack_weight), got ", mbs.sizes());
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu() &&
                  (!mbs.defined() || mbs.device().is_cpu()),
              op, ": weights must be on the CPU");
  return {codes.data_ptr<uint8_t>(), scales.data_ptr<uint8_t>(),
          has_mbs ? mbs.data_ptr<uint8_t>() : nullptr, nt, kp / kGroupK, nb, nm, n};
}

namespace {

at::Tensor mx_linear(const at::Tensor& x, int64_t act_block, int64_t act_rule, bool act_mbs,
                     int64_t macro, const at::Tensor& wcodes, const at::Tensor& wscales,
                     const at::Tensor& wmbs, int64_t n, int64_t k, int64_t w_block,
                     const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype) {
  check_rule(act_block, act_rule, act_mbs, macro);
  TORCH_CHECK(act_rule != kRuleMxplus, "vllm_mxplus::cpu_mx_linear: MX+ is cpu_mxplus_linear");
  TORCH_CHECK(w_block == act_block, "vllm_mxplus::cpu_mx_linear: weight block ", w_block,
              " differs from the activation block ", act_block);
  TORCH_CHECK(k > 0 && n > 0, "vllm_mxplus::cpu_mx_linear: N and K must be positive");
  const WeightTiles w = e8m0_weight_tiles("vllm_mxplus::cpu_mx_linear", wcodes, wscales, wmbs,
                                          n, k, act_block, macro);
  return tile_linear(x, act_block, static_cast<int>(act_rule), act_mbs, macro, w, k, bias,
                     out_dtype,
                     "vllm_mxplus::cpu_mx_linear");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mxplus, m) {
  m.def("cpu_pack_weight(Tensor codes, Tensor scales, Tensor mbs, int k, int block, int macro)"
        " -> (Tensor, Tensor, Tensor)",
        cpu_kernel(&pack_weight));
  m.def("cpu_mx_linear(Tensor x, int act_block, int act_rule, bool act_mbs, int macro, "
        "Tensor wcodes, Tensor wscales, Tensor wmbs, int n, int k, int w_block, Tensor? bias, "
        "ScalarType out_dtype) -> Tensor",
        cpu_kernel(&mx_linear));
}

}  // namespace mxplus_cpu
