// The activation operand of the E8M0 linear on AMX-INT8 tiles (mx_amx_int8_cpu.cpp states
// what it computes): x's rows quantized by quant_row (bit-exact with formats) and laid out as
// int8 codes with each step's block scales folded into them where exact, the folds' exponent
// bits, the rows' MBS reciprocals, and whether the call can be taken at all.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "mx_amx_decode.h"
#include "mx_cpu_common.h"

namespace mxplus_cpu {
namespace int8_detail {

#ifdef MXPLUS_AMX
constexpr int64_t kStepK = 64;       // K per tdpbssd
constexpr int kMaxSpread = 3;        // 12 * 2^3 = 96 <= 127
constexpr int kDummyExp = 129;       // the exponent of an all-zero block: its scale bits are 0
constexpr int kPerBlock = 3;         // Rows::levels of a tile that runs one product per block

// (EA - 129) << 23: added to EW << 23 it gives the fp32 bits of 2^(EA + EW - 256)
inline int32_t exp_bits(int e) {
  return static_cast<int32_t>(static_cast<uint32_t>(e - kDummyExp) << 23);
}

// The least base exponent of a unit that folds (and of a weight column's, kMinUnitWeightExp):
// A = fl(1 / Fa) * 2^(EA - 127) and W = fl(1 / Fw) * 2^(EW - 129) are then normal fp32
// values, so fl(A * W) = fl(fl(1 / Fa) * fl(1 / Fw)) * 2^(EA + EW - 256) exactly (the product
// is normal in the window). A unit below it runs step by step.
constexpr int kMinUnitExp = 2;
constexpr int kMinUnitWeightExp = 4;

// A of a unit's row: fl(1 / Fa) in (0.5, 1] times 2^(EA - 127), by its exponent bits (exact:
// EA >= kMinUnitExp or the dummy exponent of an all-zero unit, at most 254).
inline float unit_row_scale(float ra, int32_t ubits) {
  return u2f(f2u(ra) + static_cast<uint32_t>(ubits) + (2u << 23));
}

// max |code| of one block (2 * value: at most 12)
inline int block_max(const int8_t* c, int64_t len) {
  int big = 0;
  for (int64_t i = 0; i < len; ++i) big = std::max(big, std::abs(static_cast<int>(c[i])));
  return big;
}

// out = c * 2^shift for one block of 16 or 32 codes (|c| <= 12, shift <= 3: exact in int8),
// 16 at a time: a 16-bit shift, each byte's bits from its neighbour masked off.
inline void shift_codes(const int8_t* c, int64_t len, int shift, int8_t* out) {
  const __m128i keep = _mm_set1_epi8(static_cast<char>((0xFF << shift) & 0xFF));
  for (int64_t i = 0; i < len; i += 16) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_and_si128(_mm_sll_epi16(v, _mm_cvtsi32_si128(shift)), keep));
  }
}

// The activation operand of one call. Per row and step, the exponents e of its nonzero blocks
// (lo .. hi) give its levels: one where hi - lo <= 3 (every block shifted by e - lo), two where
// hi - lo <= 7 (blocks with e >= hi - 3 shifted by e - (hi - 3) in `a`, the others by e - lo
// in `a1`), else none (codes unshifted, each block on its own). A 16-row tile runs a step as
// its rows' largest count says: one product, two (the second with `a1`), or one per block.
// Over a unit of two steps the same rule runs on the unit's exponents (a row's levels then
// hold for both steps), so a tile whose rows all take at most two folds over the unit runs
// the unit as one product per fold (`unit_fold`), each summed over both steps.
struct Rows {
  int64_t m, mp, kp, steps, nb, bps;  // bps: blocks per step
  std::vector<int8_t> a, a1;          // [mp, kp] codes: the first level (or all), the second
  std::vector<int32_t> bits0, bits1;  // [mp, steps] exp_bits of each level's base
  std::vector<int32_t> block_bits;    // [mp, steps * bps] exp_bits of each block's level base
  std::vector<uint8_t> levels;        // [mp / 16, steps] 1, 2, or 3: one product per block
  // [mp / 16, units] the folds of the tile over the unit: 1 or 2 (its rows' largest count),
  // 0 where a row takes none (the unit runs step by step)
  std::vector<uint8_t> unit_fold;
  // [mp, units] exp_bits of the unit's fold bases where the row folds: the first (codes in
  // `a`), the second (codes in `a1`; the first's where the row has one fold: zero codes)
  std::vector<int32_t> ubits, ubits1;
  int64_t units;
  std::vector<float> ra;              // [mp, chunks] fl(1 / Fa), 1 without activation MBS
  // [mp, units] with factors: A = fl(1 / Fa) * 2^(EA - 127) of the unit's chunk and each
  // fold's base EA (unit_row_scale), where the unit folds, and D = 2^(EA - EA1) (ud), the
  // first fold's base over the second's (1 where the row has one fold)
  std::vector<float> ua, ua1, ud;
  int lo = 255, hi = 0;               // the nonzero blocks' exponents
  bool exact_only = false;            // a block the fold cannot take: the integer kernels run
};
// Row `row` of the operand from its codes and E8M0 codes (quant_row's): its steps' and units'
// folds, levels and exponent bits, the shifted codes; the extremes it met into *tlo / *thi,
// *bad where a block cannot be folded exactly. The Rows fields are read into locals first:
// the int8 stores would otherwise make the compiler reload them after each one.
inline void lay_row(Rows& r, int64_t row, int64_t block, int64_t macro, int64_t chunks,
                    int64_t unit, const int8_t* codes, const uint8_t* sc, int* slo, int* shi,
                    int* tlo, int* thi, bool* bad) {
  const int64_t steps = r.steps, bps = r.bps, nb = r.nb, kp = r.kp, units = r.units;
  int8_t* const a = r.a.data() + row * kp;
  int8_t* const a1 = r.a1.data() + row * kp;
  int32_t* const bits0 = r.bits0.data() + row * steps;
  int32_t* const bits1 = r.bits1.data() + row * steps;
  int32_t* const block_bits = r.block_bits.data() + row * steps * bps;
  uint8_t* const levels = r.levels.data() + row / kAmxRows * steps;
  uint8_t* const unit_fold_of = r.unit_fold.data() + row / kAmxRows * units;
  int32_t* const ubits = r.ubits.data() + row * units;
  int32_t* const ubits1 = r.ubits1.data() + row * units;
  float* const ua = chunks ? r.ua.data() + row * units : nullptr;
  float* const ua1 = chunks ? r.ua1.data() + row * units : nullptr;
  float* const ud = chunks ? r.ud.data() + row * units : nullptr;
  const float* const ra = chunks ? r.ra.data() + row * chunks : nullptr;
  int lo_seen = *tlo, hi_seen = *thi;
  bool bad_seen = *bad;
  for (int64_t s = 0; s < steps; ++s) {  // each step's nonzero exponents
    const int64_t b0 = s * bps, b1 = std::min(nb, b0 + bps);
    int lo = 255, hi = 0;
    for (int64_t b = b0; b < b1; ++b) {
      const int e = sc[b];
      const int8_t* cb = codes + b * block;
      if (e == kE8m0Nan || (e >= 253 && overflows(e, block_max(cb, block))) ||
          (e == 0 && block_max(cb, block) != 0))
        bad_seen = true;
      if (e == 0) continue;  // an all-zero block: any shift
      lo = std::min(lo, e);
      hi = std::max(hi, e);
    }
    slo[s] = lo;
    shi[s] = hi;
  }
  for (int64_t u = 0; u < units; ++u) {
    const int64_t u0 = u * unit, u1 = std::min(steps, u0 + unit);
    int ulo = 255, uhi = 0;
    for (int64_t s = u0; s < u1; ++s) {
      ulo = std::min(ulo, slo[s]);
      uhi = std::max(uhi, shi[s]);
    }
    // the row's folds over the unit: 1 (all zero, or a spread <= 3), 2 (<= 7), 0 (further
    // apart, or a base below kMinUnitExp); the tile takes its rows' largest, 0 over all
    const int folds = ulo > uhi                                  ? 1
                      : ulo < kMinUnitExp                        ? 0
                      : uhi - ulo <= kMaxSpread                  ? 1
                      : uhi - ulo <= 2 * kMaxSpread + 1          ? 2
                                                                 : 0;
    if (folds == 0 || (unit_fold_of[u] != 0 && folds > unit_fold_of[u]))
      unit_fold_of[u] = static_cast<uint8_t>(folds);
    // the step rule's bases below: ulo for one fold; uhi - 3 for `a` and ulo for `a1` for two
    if (folds == 1 && ulo <= uhi) ubits[u] = exp_bits(ulo);
    if (folds == 2) ubits[u] = exp_bits(uhi - kMaxSpread);
    ubits1[u] = folds == 2 ? exp_bits(ulo) : ubits[u];
    if (chunks) {
      ua[u] = unit_row_scale(ra[u0 * kStepK / macro], ubits[u]);
      ua1[u] = unit_row_scale(ra[u0 * kStepK / macro], ubits1[u]);
      ud[u] = u2f(static_cast<uint32_t>(ubits[u] - ubits1[u]) + (127u << 23));  // 2^0 .. 2^4
    }
    for (int64_t s = u0; s < u1; ++s) {
      const int elo = folds ? ulo : slo[s], ehi = folds ? uhi : shi[s];
      if (slo[s] > shi[s]) continue;  // all zero: zero codes, dummy exponents
      lo_seen = std::min(lo_seen, elo);
      hi_seen = std::max(hi_seen, ehi);
      const int spread = ehi - elo;
      const int lv = spread <= kMaxSpread ? 1 : spread <= 2 * kMaxSpread + 1 ? 2 : kPerBlock;
      const int base0 = lv == 1 ? elo : lv == 2 ? ehi - kMaxSpread : 0;
      bits0[s] = exp_bits(lv == kPerBlock ? kDummyExp : base0);
      if (lv == 2) bits1[s] = exp_bits(elo);
      levels[s] = std::max<uint8_t>(levels[s], static_cast<uint8_t>(lv));
      int32_t* bits = block_bits + s * bps;
      for (int64_t b = s * bps; b < std::min(nb, (s + 1) * bps); ++b) {
        const int e = sc[b] == 0 ? (lv == kPerBlock ? elo : base0) : sc[b];
        const bool low = lv == 2 && e < base0;  // the second level
        const int base = lv == kPerBlock ? e : low ? elo : base0;
        bits[b - s * bps] = exp_bits(base);
        shift_codes(codes + b * block, block, e - base, (low ? a1 : a) + b * block);
      }
    }
  }
  *tlo = lo_seen;
  *thi = hi_seen;
  *bad = bad_seen;
}

// Quantize x's rows (quant_row; x contiguous [M, k] fp32, bf16 or fp16) and lay the operand
// out. `chunks` 0: no factors.
inline Rows act_rows(const at::Tensor& x, int64_t k, int64_t block, int rule, bool mbs, int64_t macro,
              int64_t chunks, int64_t unit) {
  Rows r;
  r.m = x.size(0);
  r.mp = cdiv(r.m, kAmxRows) * kAmxRows;
  r.nb = cdiv(k, block);
  r.steps = cdiv(r.nb * block, kStepK);
  r.kp = r.steps * kStepK;
  r.bps = kStepK / block;
  r.a.assign(r.mp * r.kp, 0);
  r.a1.assign(r.mp * r.kp, 0);
  r.bits0.assign(r.mp * r.steps, exp_bits(kDummyExp));
  r.bits1.assign(r.mp * r.steps, exp_bits(kDummyExp));
  r.block_bits.assign(r.mp * r.steps * r.bps, exp_bits(kDummyExp));
  r.levels.assign(r.mp / kAmxRows * r.steps, 1);
  r.units = cdiv(r.steps, unit);
  r.unit_fold.assign(r.mp / kAmxRows * r.units, unit > 1 ? 1 : 0);
  r.ubits.assign(r.mp * r.units, exp_bits(kDummyExp));
  r.ubits1.assign(r.mp * r.units, exp_bits(kDummyExp));
  r.ra.assign(r.mp * chunks, 1.0f);
  r.ua.assign(chunks ? r.mp * r.units : 0, 1.0f);
  r.ua1.assign(chunks ? r.mp * r.units : 0, 1.0f);
  r.ud.assign(chunks ? r.mp * r.units : 0, 1.0f);
  const int64_t nm = mbs ? cdiv(k, macro) : 0;
  std::atomic<int> lo{255}, hi{0};
  std::atomic<bool> exact_only{false};
  // threads over whole 16-row tiles: a tile's `levels` and `unit_fold` are its rows' maximum /
  // conjunction, written by one thread (rows of one tile on two threads raced on them)
  at::parallel_for(0, r.mp / kAmxRows, 1, [&](int64_t t0, int64_t t1) {
    const int64_t r0 = t0 * kAmxRows, r1 = std::min(r.m, t1 * kAmxRows);
    std::vector<float> ybuf(mbs ? k : 0), xbuf(k);
    std::vector<int8_t> codes(r.nb * block);
    std::vector<uint8_t> sc(r.nb), mb(std::max<int64_t>(nm, 1));
    std::vector<int> slo(r.steps), shi(r.steps);
    int tlo = 255, thi = 0;
    bool bad = false;
    for (int64_t row = r0; row < r1; ++row) {
      quant_row(row_f32(x, row, k, xbuf.data()), k, block, rule, mbs, macro, codes.data(),
                sc.data(), mb.data(), nullptr, ybuf.data());
      for (int64_t c = 0; mbs && c < chunks; ++c) r.ra[row * chunks + c] = 1.0f / mbs_factor(mb[c]);
      lay_row(r, row, block, macro, chunks, unit, codes.data(), sc.data(), slo.data(), shi.data(),
              &tlo, &thi, &bad);
    }
    // the call's extremes (rare contention: once per thread)
    for (int v = lo.load(); tlo < v && !lo.compare_exchange_weak(v, tlo);) {}
    for (int v = hi.load(); thi > v && !hi.compare_exchange_weak(v, thi);) {}
    if (bad) exact_only = true;
  });
  r.lo = lo;
  r.hi = hi;
  r.exact_only = exact_only;
  return r;
}
#endif

}  // namespace int8_detail
}  // namespace mxplus_cpu
