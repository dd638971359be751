// The E8M0 linear on AMX-INT8 tiles (docs/cpu_kernels.md, "E8M0 on AMX-INT8 tiles"): the
// integer kernels' sum (mx_gemm_cpu.cpp) with a 64-element step of K on one `tdpbssd` (16 x 16
// outputs, 16,384 int8 products) instead of one 16-element block per `vpdpbusd` group.
//
// The products of one step span 64 / block blocks with different scales, so the step folds
// the scales into the int8 operands where that is exact: per activation row (and per weight
// column) and step, with e_lo .. e_hi the E8M0 codes of the step's nonzero blocks, a spread
// e_hi - e_lo <= 3 lets each block's codes be multiplied by 2^(e_b - e_lo): 2 * |value| <= 12
// times at most 8 is <= 96, still an int8. Then
//
//   J = sum over the step's k of  (2 va_k 2^(ea_b - EA)) * (2 vw_k 2^(ew_b - EW))   (exact int32)
//   T = J * 2^(EA + EW - 256)      = the sum of the step's block terms I_b 2^(ea_b + ew_b - 256)
//
// exactly (|J| <= 64 * 96 * 96 < 2^20, and the power of two is a normal fp32 where the call
// is taken: below). An activation row whose spread is 4..7 takes two folds (blocks with
// e >= e_hi - 3 on that base, the others on e_lo: a second product against a second operand,
// zero in the other rows). Where rows and columns fold over two steps (a unit: 128 elements,
// one MBS chunk; a row's one or two folds then taken on the unit's e_lo .. e_hi; the step that
// ends K alone is a unit of one) the tiles accumulate a fold over both steps before one store
// (|J| < 2^21), the second fold in a second product of the unit (a row with one fold has zero
// codes there); a larger spread, or a weight
// column past one fold, runs its 16 x 16 tile once per block, the other blocks' activation
// codes masked to zero: the same T, per block. The T of a macro chunk are added in fp32 in
// order (fused multiply-adds of exact products: one rounding each), and with MBS the chunk's
// sum S_c is scaled into the output as on the bf16 tiles (mx_amx_cpu.cpp): y += S_c *
// fl(fl(1/Fa) * fl(1/Fw)), one fused multiply-add per chunk (a unit that is the chunk: y += J *
// (2^(EA + EW - 256) * t), the product exact, the same one rounding; two folds: y +=
// fl(J 2^(EA - EA1) + J1) * (2^(EA1 + EW - 256) * t), one rounding more, as S would take);
// without MBS the row is one chunk and y = S. Then the bias (one addition) and the output
// dtype. Rounding count per product: at most L / 16 additions in the chunk (one per block;
// L - 1 on bf16 tiles), 3 for the factor and n_c for the chunks: within the exact-bf16 path's
// bound on AMX tiles (exact_bf16.py, `roundings`).
//
// Where the fold cannot be exact the whole call runs on the integer kernels instead
// (tile_linear, the same result as cpu_mx_linear): a NaN block or one whose values overflow
// (E8M0 255, or 253 / 254 with a large code) on either side, a nonzero block with scale code 0
// (values below 2^-125), or exponents whose power of two 2^(EA + EW - 256) would leave
// [2^-124, 2^107] (normal also times t > 1/4; |T| < 2^127: finite). A block of scale code 0
// whose codes are zero (an all-zero block) takes any shift: it adds nothing.
//
// Layouts. The weight is the integer kernels' packed tiles (cpu_pack_weight: mx_tiles.h
// WeightTiles), decoded into `tdpbssd` B tiles (per call, or once by cpu_amx_int8_hold and
// passed as held_tiles / held_meta: the same decode_step): per 16 columns and step, B row r
// holds the 16 columns' codes k = 4 r .. 4 r + 3 (the packed group's nibbles are already in
// that order); a 64-entry byte table maps (shift << 4 | nibble) to 2 value * 2^shift. The
// activation operand is int8 [Mp, Kp] (rows padded to 16, K to 64), quantized here by
// quant_row (bit-exact with formats). Reciprocals: rw fp32 [chunks, Np >= N rounded up to 16]
// as on the bf16 tiles (exact_bf16.ExactBf16Weight.rw), ra fp32 = 1 / Fa from the MBS bytes.
// Compiled with -ffp-contract=off: every fused multiply-add is an intrinsic's.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "mx_amx_decode.h"
#include "mx_amx_int8_decode.h"
#include "mx_amx_int8_rows.h"
#include "mx_cpu_common.h"

namespace mxplus_cpu {
namespace {

using gemm_detail::WeightTiles;

#ifdef MXPLUS_AMX
using namespace int8_detail;

constexpr int kColTiles = 4;         // 16-column tiles per column block (64 outputs)
constexpr int64_t kSpanSteps = 8;    // steps whose B tiles are decoded at once (32 KiB)
// row tiles per task (256 rows: their fp32 accumulators 64 KiB, or 128 with MBS, stay in L2;
// a task decodes its column block's B tiles once for them)
constexpr int64_t kTaskRowTiles = 16;
// MACs per thread's share before a call is split over threads (a few microseconds of tile
// work on the AMX Xeon of docs/cpu_kernels.md; there, at 16 rows on two threads, 2^20 ran
// SmolLM2's layer faster than 2^18 or 2^22, in one run): below it one thread runs the call
constexpr int64_t kInt8ParallelMacs = int64_t{1} << 20;

// S[r][0..15] += J[r] * 2^(EA_r + EW - 256) for the 16 rows of a tile: J int32 [16][16],
// row bits (exp_bits of EA) with stride `stride`, ew the columns' EW << 23.
MXPLUS_AMX_INT8_TARGET inline void add_terms(const int32_t* j, const int32_t* row_bits,
                                             int64_t stride, __m512i ew, float* s,
                                             int64_t s_stride) {
  for (int r = 0; r < kAmxRows; ++r) {
    const __m512 scale =
        _mm512_castsi512_ps(_mm512_add_epi32(_mm512_set1_epi32(row_bits[r * stride]), ew));
    const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(j + r * 16));
    float* o = s + r * s_stride;
    _mm512_storeu_ps(o, _mm512_fmadd_ps(v, scale, _mm512_loadu_ps(o)));
  }
}

// Y[r][0..15] += J[r] * fl(A_r * W) for the 16 rows of a tile: a chunk's one fold (its sum
// exact) scaled into y, one rounding, as y += P_c * t on the bf16 tiles. A_r = fl(1/Fa) *
// 2^(EA_r - 127) and W = fl(1/Fw) * 2^(EW - 129) are exact (unit_row_scale), so fl(A_r * W)
// is t = fl(fl(1/Fa) * fl(1/Fw)) times the power of two 2^(EA + EW - 256), exactly.
MXPLUS_AMX_INT8_TARGET inline void add_scaled_terms(const int32_t* j, const float* a,
                                                    int64_t a_stride, __m512 w, float* y,
                                                    int64_t y_stride) {
  for (int r = 0; r < kAmxRows; ++r) {
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(a[r * a_stride]), w);
    const __m512 v = _mm512_cvtepi32_ps(_mm512_load_si512(j + r * 16));
    float* o = y + r * y_stride;
    _mm512_storeu_ps(o, _mm512_fmadd_ps(v, t, _mm512_loadu_ps(o)));
  }
}

// Y[r][0..15] += fl(J[r] * D_r + J1[r]) * fl(A1_r * W) for the 16 rows of a tile: a chunk's
// two folds (J on base EA, J1 on EA1), D_r = 2^(EA - EA1) (d), A1_r the second base's A. J *
// D_r is exact, so their sum rounds once (not at all below 2^24), and y once, as for one fold.
MXPLUS_AMX_INT8_TARGET inline void add_two_fold_terms(const int32_t* j, const int32_t* j1,
                                                      const float* d, const float* a1,
                                                      int64_t a_stride, __m512 w, float* y,
                                                      int64_t y_stride) {
  for (int r = 0; r < kAmxRows; ++r) {
    const __m512 t = _mm512_mul_ps(_mm512_set1_ps(a1[r * a_stride]), w);
    const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(j + r * 16)),
                                     _mm512_set1_ps(d[r * a_stride]),
                                     _mm512_cvtepi32_ps(_mm512_load_si512(j1 + r * 16)));
    float* o = y + r * y_stride;
    _mm512_storeu_ps(o, _mm512_fmadd_ps(v, t, _mm512_loadu_ps(o)));
  }
}

// W of 16 columns: fl(1/Fw) (rw) times 2^(EW - 129), from the columns' EW << 23 (ew).
MXPLUS_AMX_INT8_TARGET inline __m512 unit_column_scale(const float* rw, __m512i ew) {
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(_mm512_loadu_ps(rw)),
                                              _mm512_sub_epi32(ew, _mm512_set1_epi32(129 << 23))));
}

struct Call {
  const Rows* rows;
  const WeightTiles* w;
  int64_t block, n, chunk_steps, chunks;  // chunk_steps: steps per chunk (all: no factors)
  int64_t unit;                           // steps per unit: 2, or 1 (no units)
  const float* rw;                        // [chunks, rw_stride] or null
  int64_t rw_stride;
  const float* bias;                      // [n] or null
  void* out;                              // [m, n] of dtype
  at::ScalarType dtype;
  std::atomic<bool>* refused;
  // the weight's B tiles and their StepMeta decoded at load (cpu_amx_int8_hold), or null:
  // decoded per call
  const int8_t* held_b;
  const StepMeta* held_m;
  const WeightSeen* held_seen;
};

// One step's (or unit's) pending epilogue: the 4 tiles' J (stored) of row tile rt, from
// step s.
struct Pending {
  int64_t rt = -1, s = 0;
  const int32_t* j = nullptr;
  bool unit = false;            // J of the unit's steps, per fold
  const int32_t* j1 = nullptr;  // a unit's second fold's J, or null: one fold
};

// Tiles (configure_tiles, mx_amx_decode.h): 0-3 the 4 column tiles' J, 4 the activation rows,
// 5-6 the B tiles, 7 the J of a step's second level or of one block.

// J of one B tile against 16 activation rows of 64 bytes (stride lda) into j (tiles 4, 5, 7).
MXPLUS_AMX_INT8_TARGET inline void product(const int8_t* a, int64_t lda, const int8_t* b,
                                           int32_t* j) {
  _tile_loadd(4, a, lda);
  _tile_loadd(5, b, 64);
  _tile_zero(7);
  _tile_dpbssd(7, 4, 5);
  _tile_stored(7, j, 64);
}

// One thread's run over column blocks (a struct, not lambdas: a lambda does not inherit the
// AMX target of its enclosing function, and the portable builds fail).
struct Worker {
  const Call& c;
  const Rows& r;
  const WeightTiles& w;
  int64_t rt0 = 0, rt1 = 0;  // the task's row tiles
  int64_t bps, cols, span, span_alloc;
  bool scaled;
  std::unique_ptr<int8_t[]> bbuf;      // [kColTiles, span_alloc, 1024] the span's B tiles
  std::unique_ptr<StepMeta[]> meta;    // [kColTiles, span_alloc]
  std::vector<float> sacc, yacc;       // [mp, cols] S (per chunk) and y (with factors)
  float* S;
  float* Y;
  WeightSeen seen;
  alignas(64) int32_t jbuf[2][kColTiles][256];
  alignas(64) int32_t jbuf1[2][kColTiles][256];  // a unit's second fold
  alignas(64) int32_t jone[256];
  alignas(64) int8_t abuf[1024];
  Pending prev;
  int parity = 0;
  int64_t s0 = 0, tile0 = 0;  // the span's first step, the column block's first tile

  explicit Worker(const Call& call)
      : c(call), r(*call.rows), w(*call.w), bps(r.bps),
        cols(kColTiles * 16),
        span(std::max<int64_t>(1, kSpanSteps / call.chunk_steps) * call.chunk_steps),
        span_alloc(std::min(span, r.steps)), scaled(call.rw != nullptr),
        bbuf(new int8_t[kColTiles * span_alloc * 1024]),
        meta(new StepMeta[kColTiles * span_alloc]), sacc(std::min(r.mp, kTaskRowTiles * kAmxRows) * cols),
        yacc(scaled ? sacc.size() : 0), S(sacc.data()), Y(scaled ? yacc.data() : S) {}

  // the B tile and StepMeta of column tile j, step s0 + g: the span's decode, or the held ones
  const int8_t* B(int j, int64_t g) {
    if (c.held_b) return c.held_b + ((tile0 + j) * r.steps + s0 + g) * 1024;
    return bbuf.get() + (j * span_alloc + g) * 1024;
  }
  const StepMeta& M(int j, int64_t g) {
    if (c.held_m) return c.held_m[(tile0 + j) * r.steps + s0 + g];
    return meta[j * span_alloc + g];
  }
  // a row's accumulators: S (and Y) hold the task's rows only
  float* srow(int64_t row0) { return S + (row0 - rt0 * kAmxRows) * cols; }
  float* yrow(int64_t row0) { return Y + (row0 - rt0 * kAmxRows) * cols; }

  // The epilogue of one step or unit (row tile rt, from step s; g its index in the span):
  // a unit's J, every row and column folded with the unit's exponents, into y directly where
  // the unit is the chunk (or S); a step's first level's J (stored) by add_terms, and the
  // second level's products where the rows need it; a tile whose rows or columns do not fold
  // runs once per block, the other blocks' activation codes masked out. Tiles 4, 5 and 7
  // only: the next step's products are issued. Then, at a chunk's end, y += S * fl(fl(1/Fa)
  // * fl(1/Fw)).
  MXPLUS_AMX_INT8_TARGET void epilogue(const Pending& p) {
    const int64_t g = p.s - s0, row0 = p.rt * kAmxRows;
    const int8_t* const a0 = r.a.data();
    const int8_t* const a1 = r.a1.data();
    if (p.unit) {
      const int64_t ch = p.s / c.chunk_steps;
      const bool direct = scaled && c.chunk_steps == c.unit;  // the unit is the chunk
      const int64_t at = row0 * r.units + p.s / c.unit;  // the tile's rows' unit fields
      for (int j = 0; j < kColTiles; ++j) {
        const __m512i ew = _mm512_load_si512(M(j, g).ew_bits);
        if (direct) {
          const int64_t n0 = std::min((tile0 + j) * 16, c.rw_stride - 16);  // padding: any t
          const __m512 wsc = unit_column_scale(c.rw + ch * c.rw_stride + n0, ew);
          if (p.j1)
            add_two_fold_terms(p.j + j * 256, p.j1 + j * 256, r.ud.data() + at,
                               r.ua1.data() + at, r.units, wsc, yrow(row0) + j * 16, cols);
          else
            add_scaled_terms(p.j + j * 256, r.ua.data() + at, r.units, wsc,
                             yrow(row0) + j * 16, cols);
        } else {
          add_terms(p.j + j * 256, r.ubits.data() + at, r.units, ew, srow(row0) + j * 16, cols);
          if (p.j1)
            add_terms(p.j1 + j * 256, r.ubits1.data() + at, r.units, ew, srow(row0) + j * 16,
                      cols);
        }
      }
      if (direct) return;
    } else {
      const int lv = r.levels[p.rt * r.steps + p.s];
      for (int j = 0; j < kColTiles; ++j) {
        const StepMeta& m = M(j, g);
        const __m512i ew = _mm512_load_si512(m.ew_bits);
        if (lv != kPerBlock && m.folded) {
          add_terms(p.j + j * 256, r.bits0.data() + row0 * r.steps + p.s, r.steps, ew,
                    srow(row0) + j * 16, cols);
          if (lv == 2) {
            product(a1 + row0 * r.kp + p.s * kStepK, r.kp, B(j, g), jone);
            add_terms(jone, r.bits1.data() + row0 * r.steps + p.s, r.steps, ew,
                      srow(row0) + j * 16, cols);
          }
          continue;
        }
        for (int64_t bb = 0; bb < bps && p.s * bps + bb < r.nb; ++bb) {
          const __mmask64 keep = (c.block == 16 ? 0xFFFFULL : 0xFFFFFFFFULL) << (bb * c.block);
          const int64_t at = row0 * r.kp + p.s * kStepK;
          for (int i = 0; i < kAmxRows; ++i)  // each block is in one level: the other has 0
            _mm512_store_si512(
                abuf + i * 64,
                _mm512_or_si512(_mm512_maskz_loadu_epi8(keep, a0 + at + i * r.kp),
                                _mm512_maskz_loadu_epi8(keep, a1 + at + i * r.kp)));
          product(abuf, 64, B(j, g), jone);
          add_terms(jone, r.block_bits.data() + (row0 * r.steps + p.s) * bps + bb,
                    r.steps * bps, block_ew_bits(w, tile0 + j, p.s * bps + bb, m),
                    srow(row0) + j * 16, cols);
        }
      }
    }
    const int64_t last = p.unit ? std::min(r.steps, p.s + c.unit) - 1 : p.s;
    const bool chunk_end = (last + 1) % c.chunk_steps == 0 || last + 1 == r.steps;
    if (!scaled || !chunk_end) return;
    const int64_t ch = last / c.chunk_steps, ncols = cols, nch = c.chunks;
    const float* const ra = r.ra.data() + row0 * nch + ch;  // locals: the stores alias all
    for (int j = 0; j < kColTiles; ++j) {
      const int64_t n0 = (tile0 + j) * 16;
      if (n0 >= c.n) break;
      const __m512 rw = _mm512_loadu_ps(c.rw + ch * c.rw_stride + n0);
      float* so = srow(row0) + j * 16;
      float* yo = yrow(row0) + j * 16;
      for (int i = 0; i < kAmxRows; ++i, so += ncols, yo += ncols) {
        const __m512 t = _mm512_mul_ps(_mm512_set1_ps(ra[i * nch]), rw);
        _mm512_storeu_ps(yo, _mm512_fmadd_ps(_mm512_loadu_ps(so), t, _mm512_loadu_ps(yo)));
        _mm512_storeu_ps(so, _mm512_setzero_ps());
      }
    }
  }

  // The products of one step into tiles 0-3 (accumulated: zeroed by the caller), on the
  // operand's codes a (Rows::a, or a1 for a unit's second fold).
  MXPLUS_AMX_INT8_TARGET void step_products(const int8_t* a, int64_t rt, int64_t s) {
    _tile_loadd(4, a + rt * kAmxRows * r.kp + s * kStepK, r.kp);
    _tile_loadd(5, B(0, s - s0), 64);
    _tile_dpbssd(0, 4, 5);
    _tile_loadd(6, B(1, s - s0), 64);
    _tile_dpbssd(1, 4, 6);
    _tile_loadd(5, B(2, s - s0), 64);
    _tile_dpbssd(2, 4, 5);
    _tile_loadd(6, B(3, s - s0), 64);
    _tile_dpbssd(3, 4, 6);
  }

  // Tiles 0-3 into j: the J of one step or one fold of a unit.
  MXPLUS_AMX_INT8_TARGET static void store_tiles(int32_t* j) {
    _tile_stored(0, j, 64);
    _tile_stored(1, j + 256, 64);
    _tile_stored(2, j + 512, 64);
    _tile_stored(3, j + 768, 64);
  }

  // The products of row tile rt's step s (or unit from s, over steps [s, s1): every fold, each
  // summed over the unit's steps), stored in this item's buffers; then the previous item's
  // epilogue from the other ones.
  MXPLUS_AMX_INT8_TARGET void run_item(int64_t rt, int64_t s, int64_t s1, bool unit, int folds) {
    int32_t* const jb = jbuf[parity][0];
    int32_t* const j1 = folds == 2 ? jbuf1[parity][0] : nullptr;
    zero_tiles();
    for (int64_t t = s; t < s1; ++t) step_products(r.a.data(), rt, t);
    store_tiles(jb);
    if (j1) {
      zero_tiles();
      for (int64_t t = s; t < s1; ++t) step_products(r.a1.data(), rt, t);
      store_tiles(j1);
    }
    if (prev.rt >= 0) epilogue(prev);
    prev = {rt, s, jb, unit, j1};
    parity ^= 1;
  }

  MXPLUS_AMX_INT8_TARGET static void zero_tiles() {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }

  // The span's B tiles of the column block, each unit's folding columns on the unit's base.
  MXPLUS_AMX_INT8_TARGET void decode_span(int64_t s1) {
    if (c.held_b) return;
    for (int j = 0; j < kColTiles; ++j)
      for (int64_t u0 = s0; u0 < s1; u0 += c.unit)
        decode_unit(w, c.block, c.unit, s1, tile0 + j, u0,
                    bbuf.get() + (j * span_alloc + (u0 - s0)) * 1024,
                    &meta[j * span_alloc + (u0 - s0)], &seen);
  }

  // One task, a column block and row tiles [first, end): per span, its B tiles, then every
  // row tile unit by unit (one product
  // per step into the same tiles where the rows and columns fold over the unit, else step by
  // step); last the outputs, plus the bias, in the output dtype.
  MXPLUS_AMX_INT8_TARGET void column_block(int64_t cb, int64_t first, int64_t end) {
    tile0 = cb * kColTiles;
    rt0 = first;
    rt1 = end;
    // the task's accumulators: y zeroed; with factors S is zero already (zero when made, and
    // every chunk's end stores zeros over it; the columns past N sum zero tiles)
    const int64_t live = (rt1 - rt0) * kAmxRows * cols;
    std::fill(Y, Y + live, 0.0f);
    for (s0 = 0; s0 < r.steps; s0 += span) {
      const int64_t s1 = std::min(r.steps, s0 + span);
      decode_span(s1);
      prev = Pending{};
      for (int64_t rt = rt0; rt < rt1; ++rt) {
        for (int64_t u0 = s0; u0 < s1; u0 += c.unit) {
          const int64_t u1 = std::min(s1, u0 + c.unit);
          // a unit of two steps, or the step that ends K alone where units are on (with MBS
          // it is its whole chunk: its fold goes to y directly, as a unit's)
          const bool whole = u1 - u0 > 1 || (c.unit > 1 && u1 == r.steps);
          const int folds = whole ? r.unit_fold[rt * r.units + u0 / c.unit] : 0;
          bool unit = folds != 0;
          for (int j = 0; unit && j < kColTiles; ++j)
            unit = M(j, u0 - s0).unit_folded;
          if (unit) {
            run_item(rt, u0, u1, true, folds);
            continue;
          }
          for (int64_t s = u0; s < u1; ++s) run_item(rt, s, s + 1, false, 1);
        }
      }
      if (prev.rt >= 0) epilogue(prev);
    }
    for (int64_t row = rt0 * kAmxRows; row < std::min(r.m, rt1 * kAmxRows); ++row) {
      for (int j = 0; j < kColTiles; ++j) {
        const int64_t n0 = (tile0 + j) * 16;
        if (n0 >= c.n) break;
        const int64_t live = std::min<int64_t>(16, c.n - n0);
        const __mmask16 mask = live == 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
        __m512 v = _mm512_loadu_ps(yrow(row) + j * 16);
        if (c.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, c.bias + n0));
        store_outputs(v, c.dtype, c.out, row * c.n + n0, mask);
      }
    }
  }
};

// Tasks [t0, t1) of the call on this thread (task t: row group t / column blocks, of
// kTaskRowTiles row tiles, and column block t % column blocks: a row group's activation codes
// stay in L2 while the column blocks' B tiles stream past them, where the other order read
// the whole activation once per column block), the tile configuration, the tasks, the release,
// and the check of what the decodes met (`fits`).
MXPLUS_AMX_INT8_TARGET void run_blocks(const Call& c, int64_t t0, int64_t t1) {
  configure_tiles();
  Worker wk(c);
  wk.seen = c.held_seen ? *c.held_seen : WeightSeen{_mm_set1_epi8(char(255)), _mm_setzero_si128()};
  const int64_t mt = c.rows->mp / kAmxRows, ncb = cdiv(c.w->nt, kColTiles);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t g = t / ncb;
    wk.column_block(t % ncb, g * kTaskRowTiles, std::min(mt, (g + 1) * kTaskRowTiles));
  }
  _tile_release();
  if (!fits(wk.seen, c.rows->lo, c.rows->hi)) c.refused->store(true);
}

// Column tiles [t0, t1) of cpu_amx_int8_hold, unit by unit as Worker::decode_span decodes them;
// what they met merged into *all.
MXPLUS_AMX_INT8_TARGET void hold_tiles(const WeightTiles& w, int64_t block, int64_t unit,
                                       int64_t steps, int64_t t0, int64_t t1, int8_t* tb,
                                       StepMeta* mb, std::mutex* mu, WeightSeen* all) {
  WeightSeen seen{_mm_set1_epi8(char(255)), _mm_setzero_si128()};
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t u0 = 0; u0 < steps; u0 += unit)
      decode_unit(w, block, unit, steps, t, u0, tb + (t * steps + u0) * 1024, mb + t * steps + u0,
                  &seen);
  std::lock_guard<std::mutex> lock(*mu);
  all->lo = _mm_min_epu8(all->lo, seen.lo);
  all->hi = _mm_max_epu8(all->hi, seen.hi);
  all->tiny = all->tiny || seen.tiny;
}

// Steps per unit of the call: 2 where they stay inside a chunk (without MBS the row is one
// chunk), else 1.
inline int64_t unit_steps(bool chunked, int64_t macro) {
  return !chunked || (macro / kStepK) % 2 == 0 ? 2 : 1;
}
#endif

// The held form's layout: `meta` holds the WeightSeen of every decode at byte 0 and the
// StepMeta of column tile t, step s at kHeldMetaOffset + (t * steps + s) * sizeof(StepMeta);
// `tiles` the B tile of (t, s) at (t * steps + s) * 1024, column tiles padded to whole blocks.
constexpr int64_t kHeldMetaOffset = 64;

#ifdef MXPLUS_AMX
// The held form's sizes for a weight of w.nt column tiles and K = k: steps per column tile,
// column tiles padded to whole blocks, int8 tile bytes and meta bytes.
struct HeldSizes {
  int64_t steps, ntp, tile_bytes, meta_bytes;
};
inline HeldSizes held_sizes(const WeightTiles& w, int64_t k, int64_t block) {
  const int64_t steps = cdiv(cdiv(k, block) * block, kStepK);
  const int64_t ntp = cdiv(w.nt, kColTiles) * kColTiles;
  return {steps, ntp, ntp * steps * 1024, kHeldMetaOffset + ntp * steps * int64_t(sizeof(StepMeta))};
}
#endif

#ifdef MXPLUS_AMX
// cpu_amx_int8_hold: the B tiles and StepMeta that cpu_amx_int8_linear decodes per call,
// decoded once (the same decode_step, so the same bytes), for a layer that keeps them.
std::vector<at::Tensor> amx_int8_hold(const at::Tensor& wcodes, const at::Tensor& wscales,
                                      const at::Tensor& wmbs, int64_t n, int64_t k, int64_t block,
                                      int64_t macro, bool act_mbs) {
  const char* op = "vllm_mxplus::cpu_amx_int8_hold";
  TORCH_CHECK(amx_int8_usable(), op, ": this CPU has no AMX-INT8 or Linux refused the AMX tile "
              "permission");
  TORCH_CHECK(k > 0 && n > 0, op, ": N and K must be positive");
  const WeightTiles w =
      gemm_detail::e8m0_weight_tiles(op, wcodes, wscales, wmbs, n, k, block, macro);
  const bool chunked = act_mbs || w.mbs != nullptr;
  const int64_t unit = unit_steps(chunked, macro);
  const HeldSizes hs = held_sizes(w, k, block);
  const int64_t steps = hs.steps, ntp = hs.ntp;
  at::Tensor tiles = at::empty({hs.tile_bytes}, wcodes.options().dtype(at::kChar));
  at::Tensor meta = at::empty({hs.meta_bytes}, wcodes.options().dtype(at::kByte));
  int8_t* tb = tiles.data_ptr<int8_t>();
  StepMeta* mb = reinterpret_cast<StepMeta*>(meta.data_ptr<uint8_t>() + kHeldMetaOffset);
  std::mutex mu;
  WeightSeen all{_mm_set1_epi8(char(255)), _mm_setzero_si128()};
  at::parallel_for(0, ntp, 1, [&](int64_t t0, int64_t t1) { hold_tiles(w, block, unit, steps, t0, t1, tb, mb, &mu, &all); });
  std::memcpy(meta.data_ptr<uint8_t>(), &all, sizeof(WeightSeen));
  return {tiles, meta};
}
#endif

int64_t amx_int8_available() {
#ifdef MXPLUS_AMX
  return amx_int8_usable() ? 1 : 0;
#else
  return 0;
#endif
}

at::Tensor amx_int8_linear(const at::Tensor& x, int64_t block, int64_t rule, bool act_mbs,
                           int64_t macro, const at::Tensor& wcodes, const at::Tensor& wscales,
                           const at::Tensor& wmbs, const at::Tensor& rw, int64_t n, int64_t k,
                           const c10::optional<at::Tensor>& bias, at::ScalarType out_dtype,
                           const c10::optional<at::Tensor>& held_tiles,
                           const c10::optional<at::Tensor>& held_meta) {
  const char* op = "vllm_mxplus::cpu_amx_int8_linear";
  check_rule(block, rule, act_mbs, macro);
  TORCH_CHECK(rule != kRuleMxplus, op, ": MX+ is not an E8M0 pair for this path");
  TORCH_CHECK(k > 0 && n > 0, op, ": N and K must be positive");
  const WeightTiles w =
      gemm_detail::e8m0_weight_tiles(op, wcodes, wscales, wmbs, n, k, block, macro);
  const bool chunked = act_mbs || w.mbs != nullptr;
  const int64_t chunks = chunked ? cdiv(k, macro) : 0;
  TORCH_CHECK(!chunked || macro % 64 == 0, op, ": with MBS the macro block must be a "
              "multiple of 64 (one tile step), got ", macro);
  if (chunked) {
    TORCH_CHECK(rw.scalar_type() == at::kFloat && rw.is_contiguous() && rw.dim() == 2 &&
                    rw.size(0) == chunks && rw.size(1) >= w.nt * 16,
                op, ": rw must be contiguous fp32 [", chunks, ", >= ", w.nt * 16,
                "] (1 / Fw per chunk and column), got ", rw.sizes(), " ", rw.scalar_type());
  } else {
    TORCH_CHECK(rw.numel() == 0, op, ": rw must be empty without MBS");
  }
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16 || out_dtype == at::kHalf,
              op, ": out_dtype must be float32, bfloat16 or float16, got ", out_dtype);
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) == k, op,
              ": x must be a CPU tensor with last dim K=", k, ", got ", x.sizes());
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  at::Tensor out = at::empty(shape, x.options().dtype(out_dtype));
  if (x.numel() == 0) return out;
#ifdef MXPLUS_AMX
  TORCH_CHECK(amx_int8_usable(), op, ": this CPU has no AMX-INT8 or Linux refused the AMX tile "
              "permission (cpu_amx_int8_available() says so before a call)");
  const at::Tensor x2 = rows_operand(x, k);
  std::vector<float> b32;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, op, ": bias has ", bias->numel(), " elements, expected N=",
                n);
    const at::Tensor bf = bias->to(at::kFloat).contiguous();
    b32.assign(bf.data_ptr<float>(), bf.data_ptr<float>() + n);
  }
  // units of two steps where they stay inside a chunk (without MBS the row is one chunk)
  const int64_t unit = unit_steps(chunked, macro);
  const bool held = held_tiles.has_value() && held_tiles->defined();
  TORCH_CHECK(held == (held_meta.has_value() && held_meta->defined()), op,
              ": held_tiles and held_meta come together (cpu_amx_int8_hold)");
  if (held) {
    const HeldSizes hs = held_sizes(w, k, block);
    TORCH_CHECK(held_tiles->scalar_type() == at::kChar && held_tiles->is_contiguous() &&
                    held_tiles->numel() == hs.tile_bytes,
                op, ": held_tiles must be cpu_amx_int8_hold's int8 [", hs.tile_bytes,
                "] for this weight, got ", held_tiles->sizes(), " ", held_tiles->scalar_type());
    TORCH_CHECK(held_meta->scalar_type() == at::kByte && held_meta->is_contiguous() &&
                    held_meta->numel() == hs.meta_bytes,
                op, ": held_meta must be cpu_amx_int8_hold's uint8 meta for this weight, got ",
                held_meta->sizes());
  }
  const Rows rows = act_rows(x2, k, block, static_cast<int>(rule), act_mbs, macro, chunks, unit);
  std::atomic<bool> refused{rows.exact_only};
  if (!refused) {
    const int64_t chunk_steps = chunked ? macro / kStepK : rows.steps;
    const uint8_t* hm = held ? held_meta->data_ptr<uint8_t>() : nullptr;
    const Call c{&rows,
                 &w,
                 block,
                 n,
                 chunk_steps,
                 chunks,
                 unit,
                 chunked ? rw.data_ptr<float>() : nullptr,
                 chunked ? rw.size(1) : 0,
                 b32.empty() ? nullptr : b32.data(),
                 out.data_ptr(),
                 out_dtype,
                 &refused,
                 held ? held_tiles->data_ptr<int8_t>() : nullptr,
                 held ? reinterpret_cast<const StepMeta*>(hm + kHeldMetaOffset) : nullptr,
                 held ? reinterpret_cast<const WeightSeen*>(hm) : nullptr};
    const int64_t ncb = cdiv(w.nt, kColTiles);
    const int64_t rows_per_task = std::min(rows.mp, kTaskRowTiles * kAmxRows);
    const int64_t tasks = ncb * cdiv(rows.mp / kAmxRows, kTaskRowTiles);
    const int64_t grain = std::max<int64_t>(
        1, kInt8ParallelMacs / std::max<int64_t>(1, kColTiles * 16 * rows.kp * rows_per_task));
    at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) { run_blocks(c, t0, t1); });
  }
  if (!refused) return out;
#endif
  // what the fold cannot take exactly (or no AMX code): the integer kernels
  return gemm_detail::tile_linear(x, block, static_cast<int>(rule), act_mbs, macro, w, k, bias,
                                  out_dtype, op);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_mxplus, m) {
  m.def("cpu_amx_int8_available() -> int", &amx_int8_available);
  m.def("cpu_amx_int8_linear(Tensor x, int block, int rule, bool act_mbs, int macro, "
        "Tensor wcodes, Tensor wscales, Tensor wmbs, Tensor rw, int n, int k, Tensor? bias, "
        "ScalarType out_dtype, Tensor? held_tiles=None, Tensor? held_meta=None) -> Tensor",
        cpu_kernel(&amx_int8_linear));
#ifdef MXPLUS_AMX
  m.def("cpu_amx_int8_hold(Tensor wcodes, Tensor wscales, Tensor wmbs, int n, int k, int block, "
        "int macro, bool act_mbs) -> Tensor[]",
        cpu_kernel(&amx_int8_hold));
#endif
}

}  // namespace mxplus_cpu
