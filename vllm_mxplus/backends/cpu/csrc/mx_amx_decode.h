// The decoder of the AMX path's packed weights (mx_amx_cpu.cpp, cpu_amx_packed_gemm): the
// integer kernels' packed FP4 tiles of an E8M0 weight (cpu_pack_weight: 0.5 byte per code and
// one E8M0 byte per block and row) into the bf16 B tiles of `tdpbf16ps`, exactly the values the
// held layout (exact_bf16.amx_pack) has: v * 2^(e - 127), E2M1 v. A scalar decoder (every
// host; the reference) and a vector one (AMX hosts: bit operations on 32 values at a time).
// Also where the AMX code's target and tile layout are defined, for both files.
#pragma once

#include <cstdint>
#include <cstring>

#include "mx_cpu_common.h"
#include "mx_tiles.h"

#if defined(__x86_64__) && ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) || \
                            (defined(__clang__) && __clang_major__ >= 12))
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MXPLUS_AMX 1
#ifdef MXPLUS_AMX_EMULATE  // the tile instructions in C++ (mx_amx_emulate.h), for tests
#include "mx_amx_emulate.h"
#define MXPLUS_AMX_TILE_TARGET __attribute__((target("avx512f")))
#define MXPLUS_AMX_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,f16c")))
#define MXPLUS_AMX_INT8_TARGET MXPLUS_AMX_TARGET
#else
#define MXPLUS_AMX_TILE_TARGET __attribute__((target("amx-tile")))
#define MXPLUS_AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,f16c")))
#define MXPLUS_AMX_INT8_TARGET \
  __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,f16c")))
#endif
#define MXPLUS_AMX_STORE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
#endif

namespace mxplus_cpu {

#ifdef MXPLUS_AMX
// The tile configuration `ldtilecfg` reads (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Whether this thread may run AMX tile instructions of one kind: cpuid leaf 7 lists amx-tile
// (EDX bit 24) and the kind's bit (amx-bf16 22, amx-int8 25), and Linux grants the tile data
// permission (arch_prctl ARCH_REQ_XCOMP_PERM, the same request platform_amx makes;
// idempotent). Without both a tile instruction is SIGILL.
inline bool amx_permitted(unsigned kind_bit) {
#ifdef MXPLUS_AMX_EMULATE
  // Emulated tiles: the AVX-512 subset of MXPLUS_AMX_TARGET is what must run.
  (void)kind_bit;
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("f16c");
#endif
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 24) & 1u) || !((edx >> kind_bit) & 1u)) return false;
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// The live lanes of 16 fp32 outputs y into out[at ..] of dtype (fp32, bf16 or fp16; round to
// nearest even, a NaN stays NaN): both AMX GEMMs' last step.
MXPLUS_AMX_STORE_TARGET inline void store_outputs(__m512 y, at::ScalarType dtype, void* out,
                                                  int64_t at, __mmask16 live) {
  if (dtype == at::kFloat) {
    _mm512_mask_storeu_ps(static_cast<float*>(out) + at, live, y);
  } else if (dtype == at::kBFloat16) {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + at, live,
                             _mm512_cvtepi32_epi16(bf16_bits16(y)));
  } else {  // kHalf
    const __m256i r = _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + at, live, r);
  }
}

// The tile configuration both AMX GEMMs use: 8 tiles of 16 rows x 64 bytes. The barrier
// matters: ldtilecfg reads all 64 bytes, but GCC's intrinsic declares a pointer's worth, so
// the other stores to the configuration can be dropped as dead (seen: colsb left zero, and
// ldtilecfg faulting).
MXPLUS_AMX_TILE_TARGET inline void configure_tiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&cfg) : "memory");
#ifdef MXPLUS_AMX_EMULATE
  amx_emulate::loadconfig(&cfg);
#else
  _tile_loadconfig(&cfg);
#endif
}

inline bool amx_bf16_usable() {  // mx_amx_cpu.cpp
  static const bool usable = amx_permitted(22);
  return usable;
}

inline bool amx_int8_usable() {  // mx_amx_int8_cpu.cpp
  static const bool usable = amx_permitted(25);
  return usable;
}
#endif

constexpr int64_t kAmxRows = 16;   // rows of a tile
constexpr int64_t kAmxStepK = 32;  // bf16 K per tile row (64 bytes)
constexpr int64_t kTileElems = kAmxRows * kAmxStepK;  // one B tile: 16 rows x 32 bf16

// The packed tiles it reads are the integer kernels' (mx_tiles.h WeightTiles of an E8M0
// weight): codes [nt, groups, 128] (group g, byte 64 q + 4 i + j of tile row i: code
// k = 16 g + 8 q + j in the low nibble, k + 4 in the high one), scales [nt, nb, 16]; code 255
// a NaN block (the packer's mark of a NaN scale or an overflowing block).
using PackedCodes = gemm_detail::WeightTiles;

// bf16 bits of the E2M1 values of codes 0..15, twice (vpermw reads five index bits).
alignas(64) constexpr uint16_t kE2M1Bf16[32] = {
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,
    0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
    0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};

// The E8M0 codes for which v * 2^(e - 127) of every nonzero E2M1 v (0.5 .. 6: bf16 exponent
// fields 126 .. 129) is the normal bf16 whose exponent field is v's plus e - 127: one integer
// add of exponent bits. Other codes (subnormal or overflowing results, NaN) take the scalar
// decoder.
constexpr int kFastScaleLo = 2, kFastScaleHi = 252;

// Rows 8 h .. 8 h + 7 of a B tile (h: which 16-K half of the step) from one packed group of
// one tile: out[r][2 c + p] = bf16(v(code(c, 2 r + p)) * 2^(e_c - 127)), the exact value.
// The scalar form, for any codes (NaN for code 255, subnormal and infinite values exact).
inline void decode_group_scalar(const uint8_t* g, const uint8_t* e, uint16_t* out) {
  for (int r = 0; r < 8; ++r) {
    for (int c = 0; c < kAmxRows; ++c) {
      for (int p = 0; p < 2; ++p) {
        const int kk = 2 * r + p, q = kk / 4, j = kk % 4;
        const uint8_t byte = g[64 * (q / 2) + 4 * c + j];
        const int code = (q % 2) ? (byte >> 4) : (byte & 0xF);
        const float v = kE2M1[code] * e8m0_value(e[c]);
        out[r * kAmxStepK + 2 * c + p] = v != v ? uint16_t(0x7FC0) : uint16_t(f2u(v) >> 16);
      }
    }
  }
}

// A whole B tile (step s of column tile t) by a group decoder `group(g, e, rows)` per 16-K
// half; zeros past the packed tiles or groups.
template <class Group>
inline void decode_tile_by(const PackedCodes& pc, int64_t t, int64_t s, uint16_t* out,
                           Group group) {
  for (int h = 0; h < 2; ++h) {
    const int64_t grp = 2 * s + h;
    uint16_t* rows = out + h * 8 * kAmxStepK;
    if (t >= pc.nt || grp >= pc.groups) {
      std::memset(rows, 0, 8 * kAmxStepK * sizeof(uint16_t));
      continue;
    }
    group(pc.codes + (t * pc.groups + grp) * gemm_detail::kGroupBytes,
          pc.scales + (t * pc.nb + grp / (pc.groups / pc.nb)) * kAmxRows, rows);
  }
}

// The scalar decoder of a whole B tile: what the vector decoder must equal, bit for bit
// (cpu_amx_unpack).
inline void decode_tile_scalar(const PackedCodes& pc, int64_t t, int64_t s, uint16_t* out) {
  decode_tile_by(pc, t, s, out, decode_group_scalar);
}

#ifdef MXPLUS_AMX
// The byte permutations of decode_group_fast, per half h: output byte o (word o / 2 of B row
// 2 q + h: column o / 4, code (o / 2) % 2 of its pair) reads packed byte 4 (o / 4) + 2 h +
// (o / 2) % 2 (odd output bytes are zeroed by the mask). Plain data: a lambda would not
// inherit the AMX target (it breaks every build without AVX-512).
struct DecodeOrder {
  alignas(64) uint8_t idx[2][64];
  constexpr DecodeOrder() : idx() {
    for (int h = 0; h < 2; ++h)
      for (int o = 0; o < 64; ++o)
        idx[h][o] = static_cast<uint8_t>(4 * (o / 4) + 2 * h + (o / 2) % 2);
  }
};
constexpr DecodeOrder kDecodeOrder{};

// The same rows where every e_c is in [kFastScaleLo, kFastScaleHi]. Per 64 packed bytes and
// half h of a code quarter, one zero-masked byte permutation makes the 32 words of B row
// 2 q + h (q the quarter in the low nibbles) with the packed byte in each word's low byte:
// its low 5 bits index the bf16 table (the low nibble; the table repeats every 16), the word
// shifted right by 4 indexes row 2 (q + 1) + h (the high nibble). Each nonzero value is then
// scaled by adding (e_c - 127) << 7 to its bits.
MXPLUS_AMX_TARGET inline void decode_group_fast(const uint8_t* g, __m512i shift, uint16_t* out) {
  const __m512i order[2] = {_mm512_load_si512(kDecodeOrder.idx[0]),
                            _mm512_load_si512(kDecodeOrder.idx[1])};
  constexpr __mmask64 kLowBytes = 0x5555555555555555ULL;
  const __m512i lut = _mm512_load_si512(kE2M1Bf16);
  const __m512i lo3 = _mm512_set1_epi16(0x0007), hi3 = _mm512_set1_epi16(0x0070);
  for (int half = 0; half < 2; ++half) {  // codes 0..7 (low nibbles k, high k + 4), 8..15
    const __m512i p = _mm512_loadu_si512(g + 64 * half);
    for (int h = 0; h < 2; ++h) {
      const __m512i w = _mm512_maskz_permutexvar_epi8(kLowBytes, order[h], p);
      __m512i lo = _mm512_permutexvar_epi16(w, lut);
      __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), lut);
      lo = _mm512_mask_add_epi16(lo, _mm512_test_epi16_mask(w, lo3), lo, shift);
      hi = _mm512_mask_add_epi16(hi, _mm512_test_epi16_mask(w, hi3), hi, shift);
      const int q = 2 * half;  // the low nibbles' quarter
      _mm512_storeu_si512(out + (2 * q + h) * kAmxStepK, lo);
      _mm512_storeu_si512(out + (2 * (q + 1) + h) * kAmxStepK, hi);
    }
  }
}

// One group by decode_group_fast where its scales allow it, else by the scalar decoder.
MXPLUS_AMX_TARGET inline void decode_group(const uint8_t* g, const uint8_t* e, uint16_t* rows) {
  const __m128i eb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(e));
  if (_mm_cmplt_epu8_mask(eb, _mm_set1_epi8(kFastScaleLo)) != 0 ||
      _mm_cmpgt_epu8_mask(eb, _mm_set1_epi8(char(kFastScaleHi))) != 0) {
    decode_group_scalar(g, e, rows);
    return;
  }
  const __m512i d = _mm512_and_si512(
      _mm512_slli_epi32(_mm512_sub_epi32(_mm512_cvtepu8_epi32(eb), _mm512_set1_epi32(kE8m0Bias)),
                        7),
      _mm512_set1_epi32(0xFFFF));
  decode_group_fast(g, _mm512_or_si512(d, _mm512_slli_epi32(d, 16)), rows);
}

// decode_tile_scalar's tile, by the vector decoder.
MXPLUS_AMX_TARGET inline void decode_tile(const PackedCodes& pc, int64_t t, int64_t s,
                                          uint16_t* out) {
  decode_tile_by(pc, t, s, out, decode_group);
}

#endif

}  // namespace mxplus_cpu
