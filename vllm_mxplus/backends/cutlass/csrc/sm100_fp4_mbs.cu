// Blackwell (sm_100a) prefill GEMM for MXFP4-MBS: native block-scaled FP4 MMA
// (tcgen05.mma kind::mxf4nvf4, E2M1 data, UE8M0 scales at block 16 -- CUTLASS accepts
// the element pair tuple<float_e2m1_t, float_ue8m0_t> with the Nvf4 (vector 16) schedule),
// with Macro Block Scaling applied to the partial accumulator of every 128-K chunk:
//
// acc[m,n] = sum_c sigma_a[c,m] * sigma_b[c,n] * sum_{k in c} (v_a 2^(s_a-127)) (v_b 2^(s_b-127))
//
// (paper §4.3.2; docs/numerics.md, "Kernel numerics and error bounds"). THIS IS THE CORRECT-BUT-SLOW FORM: one CUTLASS launch per
// 128-K chunk (problem M x N x 128, A/B addressed in place through their row stride K/2), the
// MBS factors applied in an EVT epilogue  D = sigma_a[m] * (sigma_b[n] * acc) + C  with C / D
// fp32 ping-pong buffers. The fast form (paper Appendix E: one launch, MMA warp alternating two
// TMEM accumulators per 128-K sub-tile while the idle epilogue warps scale and fold them into
// registers) needs a custom sm100 mainloop dispatch policy; see kernels/README.md "Remaining work".
//
// Without MBS (use_mbs = 0) one full-K launch of the same collective with a plain epilogue is
// the MXFP4-16 baseline for the overhead benchmark (paper Table 4).
//
// Torch-free: C-ABI launchers (mxplus_launchers.h), wrapped by kernels/torch_bindings.cpp.

#include <cstdint>
#include <cuda_runtime.h>

#include "mxplus_launchers.h"

#if !defined(MXPLUS_STUB)  // the stub build skips CUTLASS entirely (fast)
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/numeric_types.h"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/detail/sm100_blockscaled_layout.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "mxplus_cutlass_gemm.h"

using namespace cute;

namespace mxplus_sm100 {

constexpr int kChunk = 128;  // MBS macro block = K extent of one partial GEMM
constexpr int kVec = 16;     // block size of the E8M0 scales
using SfConfig = cutlass::detail::Sm1xxBlockScaledConfig<kVec>;

// The SF layout of one (rows x 128) operand chunk, or of the whole (rows x k) operand.
inline auto sf_layout(int rows, int k) {
  return SfConfig::tile_atom_to_shape_SFA(make_shape(rows, 1, k, 1));
}

}  // namespace mxplus_sm100

extern "C" size_t mxplus_sm100_sf_bytes(int rows, int chunk_k) {
  return size_t(cute::cosize(mxplus_sm100::sf_layout(rows, chunk_k)));
}

namespace mxplus_sm100 {

// One thread per (row, 16-block): out[c * chunk_bytes + L(row, kk * 16)] = scales[row, kb].
template <class Layout>
__global__ void pack_scales_kernel(const uint8_t* __restrict__ scales, uint8_t* __restrict__ out,
                                   int rows, int nkb, int chunk_blocks, size_t chunk_bytes,
                                   Layout layout) {
  int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= int64_t(rows) * nkb) return;
  int row = int(i / nkb), kb = int(i % nkb);
  int c = kb / chunk_blocks, kk = kb % chunk_blocks;
  out[c * chunk_bytes + layout(row, kk * kVec, 0)] = scales[i];
}

}  // namespace mxplus_sm100

extern "C" int mxplus_sm100_pack_scales(const unsigned char* scales, unsigned char* out,
                                        int rows, int k, int chunk_k, cudaStream_t stream) {
  using namespace mxplus_sm100;
  if (k % kChunk != 0 || chunk_k % kChunk != 0 || k % chunk_k != 0) return MXPLUS_ERR_SHAPE;
  int nkb = k / kVec;
  int64_t total = int64_t(rows) * nkb;
  int threads = 256;
  int blocks = int((total + threads - 1) / threads);
  if (blocks == 0) return MXPLUS_OK;
  pack_scales_kernel<<<blocks, threads, 0, stream>>>(scales, out, rows, nkb, chunk_k / kVec,
                                                     mxplus_sm100_sf_bytes(rows, chunk_k),
                                                     sf_layout(rows, chunk_k));
  return cudaGetLastError() == cudaSuccess ? MXPLUS_OK : MXPLUS_ERR_RUN;
}

#endif  // !MXPLUS_STUB

#if defined(CUTLASS_ARCH_MMA_SM100_SUPPORTED) && !defined(MXPLUS_STUB)

namespace mxplus_sm100 {

// UE8M0 scales; the vector size (16) comes from the Nvf4 schedule below.
using ElementPair = cute::tuple<cutlass::float_e2m1_t, cutlass::float_ue8m0_t>;
using LayoutA = cutlass::layout::RowMajor;     // [M, K] K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // [N, K] K contiguous
constexpr int AlignmentAB = 32;                // 16 bytes of FP4
using ElementAcc = float;
using LayoutC = cutlass::layout::RowMajor;
constexpr int AlignmentC = 4;                  // 16 bytes of fp32
using MmaTileShape = Shape<_128, _128, _256>;  // the 4-bit UMMA tile wants K = 256 (128 bytes)
using ClusterShape = Shape<_1, _1, _1>;
using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecialized1SmNvf4Sm100;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized1Sm;
using RoundStyle = cutlass::FloatRoundStyle;

// EVT: D = sigma_a[m] * (sigma_b[n] * acc) + C.
using namespace cutlass::epilogue::fusion;
using SigmaA = Sm90ColBroadcast<0, MmaTileShape, float, float, Stride<_1, _0, int64_t>>;
using SigmaB = Sm90RowBroadcast<0, MmaTileShape, float, float, Stride<_0, _1, int64_t>>;
using ScaleB = Sm90EVT<Sm90Compute<cutlass::multiplies, float, float, RoundStyle::round_to_nearest>,
                       SigmaB, Sm90AccFetch>;
using MbsEVT = Sm90EVT<Sm90Compute<cutlass::homogeneous_multiply_add, float, float,
                                   RoundStyle::round_to_nearest>,
                       SigmaA, ScaleB, Sm90SrcFetch<float>>;
using PlainOp = LinearCombination<float, float, void, float>;  // D = acc

template <class Fusion, class ElementC>
struct Kernel {
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassTensorOp, MmaTileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float,
      ElementC, LayoutC, AlignmentC, float, LayoutC, AlignmentC,
      EpilogueSchedule, Fusion>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm100, cutlass::arch::OpClassBlockScaledTensorOp,
      ElementPair, LayoutA, AlignmentAB, ElementPair, LayoutB, AlignmentAB, ElementAcc,
      MmaTileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue, void>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

using MbsGemm = Kernel<MbsEVT, float>::Gemm;
using PlainGemm = Kernel<PlainOp, void>::Gemm;

static_assert(cute::is_same_v<typename MbsGemm::GemmKernel::CollectiveMainloop::ElementSF,
                              cutlass::float_ue8m0_t>, "scales must be UE8M0");
static_assert(MbsGemm::GemmKernel::CollectiveMainloop::SFVecSize == kVec, "block 16");

template <class Gemm>
using Operands = mxplus_cutlass::Operands<Gemm, SfConfig>;  // strides and UE8M0 SF layouts

// The mainloop arguments of one launch: FP4 operands from a / b (their row pitch in ops),
// their UE8M0 scale factors from a_sf / b_sf (packed by mxplus_sm100_pack_scales).
template <class Gemm>
typename Gemm::GemmKernel::MainloopArguments fp4_operands(const uint8_t* a, const uint8_t* a_sf,
                                                          const uint8_t* b, const uint8_t* b_sf,
                                                          const Operands<Gemm>& ops) {
  using Mainloop = typename Gemm::GemmKernel::CollectiveMainloop;
  using SF = cutlass::float_ue8m0_t;
  return {reinterpret_cast<const typename Mainloop::ElementA*>(a), ops.a,
          reinterpret_cast<const typename Mainloop::ElementB*>(b), ops.b,
          reinterpret_cast<const SF*>(a_sf), ops.sfa, reinterpret_cast<const SF*>(b_sf), ops.sfb};
}

// Operand pointers of chunk c: FP4 rows keep their full-K stride (k/2 bytes), the chunk starts
// c * 64 bytes in; scale factors live in the per-chunk packed buffer.
int run_mbs(const uint8_t* a, const uint8_t* a_sf, const uint8_t* b, const uint8_t* b_sf,
            const float* sigma_a, const float* sigma_b, float* acc0, float* acc1, int m, int n,
            int k, int* result, void* workspace, size_t workspace_bytes,
            size_t* workspace_needed, cudaStream_t stream) {
  using Gemm = MbsGemm;
  // Strides of the full-K operands (row pitch k elements); the problem's K is one chunk.
  const Operands<Gemm> ops(m, n, k, kChunk);
  size_t sfa_bytes = mxplus_sm100_sf_bytes(m, kChunk), sfb_bytes = mxplus_sm100_sf_bytes(n, kChunk);

  // The broadcast loads are 16-byte vectors: each chunk's sigma row starts 16-byte aligned.
  size_t ld_sigma_a = size_t(m + 3) / 4 * 4, ld_sigma_b = size_t(n + 3) / 4 * 4;
  float* bufs[2] = {acc0, acc1};
  int nc = k / kChunk;
  size_t need = 0;
  for (int c = 0; c < nc; ++c) {
    const float* src = bufs[c % 2];
    float* dst = bufs[(c + 1) % 2];
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, kChunk, 1},
        fp4_operands<Gemm>(a + size_t(c) * kChunk / 2, a_sf + c * sfa_bytes,
                           b + size_t(c) * kChunk / 2, b_sf + c * sfb_bytes, ops),
        {{}, src, ops.c, dst, ops.c}};
    // Fusion args mirror the EVT tree: {sigma_a, {sigma_b, acc, op}, src, op}.
    args.epilogue.thread = {
        {sigma_a + size_t(c) * ld_sigma_a},
        {{sigma_b + size_t(c) * ld_sigma_b}, {}, {}},
        {},
        {}};
    int rc = mxplus_cutlass::launch<Gemm>(args, workspace, workspace_bytes, &need, stream);
    if (workspace_needed) *workspace_needed = need;
    if (rc != MXPLUS_OK) return rc;
  }
  *result = nc % 2;
  return MXPLUS_OK;
}

int run_plain(const uint8_t* a, const uint8_t* a_sf, const uint8_t* b, const uint8_t* b_sf,
              float* out, int m, int n, int k, void* workspace, size_t workspace_bytes,
              size_t* workspace_needed, cudaStream_t stream) {
  using Gemm = PlainGemm;
  const Operands<Gemm> ops(m, n, k, k);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {m, n, k, 1},
                                fp4_operands<Gemm>(a, a_sf, b, b_sf, ops),
                                {{}, nullptr, ops.d, out, ops.d}};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return mxplus_cutlass::launch_once<Gemm>(args, workspace, workspace_bytes, workspace_needed,
                                           stream);
}

}  // namespace mxplus_sm100

extern "C" int mxplus_sm100_fp4_mbs_gemm(
    const void* a_fp4, const unsigned char* a_sf, const void* b_fp4, const unsigned char* b_sf,
    const float* sigma_a, const float* sigma_b, float* acc0, float* acc1, int m, int n, int k,
    int use_mbs, int* result, void* workspace, size_t workspace_bytes, size_t* workspace_needed,
    cudaStream_t stream) {
  using namespace mxplus_sm100;
  if (k % kChunk != 0 || n % AlignmentC != 0) return MXPLUS_ERR_SHAPE;
  auto a = static_cast<const uint8_t*>(a_fp4);
  auto b = static_cast<const uint8_t*>(b_fp4);
  if (!use_mbs) {
    // Baseline: the scales are then packed for the full K (pack_scales with chunk_k = k).
    *result = 0;
    return run_plain(a, a_sf, b, b_sf, acc0, m, n, k, workspace, workspace_bytes,
                     workspace_needed, stream);
  }
  return run_mbs(a, a_sf, b, b_sf, sigma_a, sigma_b, acc0, acc1, m, n, k, result, workspace,
                 workspace_bytes, workspace_needed, stream);
}

#else

#if defined(MXPLUS_STUB)
extern "C" size_t mxplus_sm100_sf_bytes(int, int) { return 0; }

extern "C" int mxplus_sm100_pack_scales(const unsigned char*, unsigned char*, int, int, int,
                                        cudaStream_t) {
  return MXPLUS_ERR_NOT_COMPILED;
}
#endif

extern "C" int mxplus_sm100_fp4_mbs_gemm(const void*, const unsigned char*, const void*,
                                         const unsigned char*, const float*, const float*,
                                         float*, float*, int, int, int, int, int*, void*,
                                         size_t, size_t*, cudaStream_t) {
  return MXPLUS_ERR_NOT_COMPILED;  // built without sm_100a (MXPLUS_STUB)
}

#endif  // CUTLASS_ARCH_MMA_SM100_SUPPORTED && !MXPLUS_STUB
