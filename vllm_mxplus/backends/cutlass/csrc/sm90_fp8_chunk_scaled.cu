// Hopper (sm_90a) prefill GEMM for MXFP4-MBS re-encoded as FP8, per-(row, 128-K chunk) scales.
//
//   D[m, n] = sum_c sA[c, m] * sB[c, n] * sum_{k in chunk c} A8[m, k] * B8[n, k]  (+ bias[n])
//
// A8 / B8 are FP8 E4M3 codes of the FP4 elements relative to a per-(row, chunk) reference
// exponent, sA / sB fold 2^(ref-127) * sigma (sigma = 1/F, the MBS factor) into one fp32 per
// (row, chunk); see vllm_mxplus/backends/cutlass/fp8_chunks.py for the (exact) re-encoding. The
// mainloop is CUTLASS's FP8 blockwise-scaled WGMMA kernel (example 67 / DeepGEMM pattern):
// per 128-wide K tile the tensor-core partial sum is promoted to fp32 and multiplied by
// sA * sB, which is exactly the MBS accumulation of paper §4.3.2 (docs/numerics.md, "Kernel numerics and error bounds").
//
// Scale granularity: M = 1 (per token), N = 1 (per output channel), K = 128 (one MBS macro
// block). Both scale tensors are MN-major: [K/128][M] and [K/128][N] fp32, contiguous.
//
// The file is torch-free: it exports one C-ABI launcher; kernels/torch_bindings.cpp wraps it.

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
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "mxplus_cutlass_gemm.h"

#endif

#if defined(CUTLASS_ARCH_MMA_SM90_SUPPORTED) && !defined(MXPLUS_STUB)

using namespace cute;

namespace mxplus_sm90 {

using ElementA = cutlass::float_e4m3_t;
using LayoutA = cutlass::layout::RowMajor;       // activations [M, K], K contiguous
constexpr int AlignmentA = 16;                   // 16 bytes for TMA
using ElementB = cutlass::float_e4m3_t;
using LayoutB = cutlass::layout::ColumnMajor;    // weights [N, K], K contiguous
constexpr int AlignmentB = 16;
using LayoutD = cutlass::layout::RowMajor;       // out [M, N]
using ElementBias = float;                       // fp32 bias: never rounded to bf16
using ElementAccumulator = float;
using ElementCompute = float;

using TileShape = Shape<_128, _128, _128>;       // T_K = 128 = the MBS macro block (paper §4.3.2)
using ClusterShape = Shape<_1, _2, _1>;

constexpr int ScaleGranularityM = 1;
constexpr int ScaleGranularityN = 1;
constexpr int ScaleGranularityK = 128;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<
    ScaleGranularityM, ScaleGranularityN, ScaleGranularityK,
    cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

using KernelSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;

// One GEMM per output type: bf16 (bf16 models) and fp32 (fp16 / fp32 models: one rounding of
// the fp32 result later, as on the decode path).
template <class ElementD>
struct Sm90Gemm {
  static constexpr int AlignmentD = 16 / sizeof(ElementD);  // 16 bytes

  // D = acc + bias[n] (alpha = 1, no source C); a null bias pointer reads as zeros.
  using FusionOp = cutlass::epilogue::fusion::LinCombPerColBias<
      ElementD, ElementCompute, ElementBias, void, ElementCompute>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      TileShape, ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementCompute,
      void, LayoutD, AlignmentD,
      ElementD, LayoutD, AlignmentD,
      EpilogueSchedule, FusionOp>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      ElementA, cute::tuple<LayoutA, LayoutSFA>, AlignmentA,
      ElementB, cute::tuple<LayoutB, LayoutSFB>, AlignmentB,
      ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      Shape<int, int, int, int>, CollectiveMainloop, CollectiveEpilogue,
      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
};

template <class ElementD>
int run(const void* a, const float* sfa, const void* b, const float* sfb, const float* bias,
        void* d, int m, int n, int k, void* workspace, size_t workspace_bytes,
        size_t* workspace_needed, cudaStream_t stream) {
  using Gemm = typename Sm90Gemm<ElementD>::Gemm;
  const mxplus_cutlass::Operands<Gemm, ScaleConfig> ops(m, n, k, k);

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, n, k, 1},
      {static_cast<const ElementA*>(a), ops.a, static_cast<const ElementB*>(b), ops.b,
       sfa, ops.sfa, sfb, ops.sfb},
      {{}, nullptr, ops.d, static_cast<ElementD*>(d), ops.d}};
  auto& fusion = args.epilogue.thread;
  fusion.alpha = 1.0f;
  fusion.beta = 0.0f;
  fusion.bias_ptr = bias;
  // A query (workspace too small, e.g. NULL) returns before running anything.
  return mxplus_cutlass::launch_once<Gemm>(args, workspace, workspace_bytes, workspace_needed,
                                           stream);
}

}  // namespace mxplus_sm90

extern "C" int mxplus_sm90_fp8_chunk_gemm(
    const void* a_fp8, const float* a_scale, const void* b_fp8, const float* b_scale,
    const float* bias_f32, void* out, int out_fp32, int m, int n, int k, void* workspace,
    size_t workspace_bytes, size_t* workspace_needed, cudaStream_t stream) {
  if (k % 128 != 0 || n % 8 != 0) return MXPLUS_ERR_SHAPE;
  if (out_fp32)
    return mxplus_sm90::run<float>(a_fp8, a_scale, b_fp8, b_scale, bias_f32, out, m, n, k,
                                   workspace, workspace_bytes, workspace_needed, stream);
  return mxplus_sm90::run<cutlass::bfloat16_t>(a_fp8, a_scale, b_fp8, b_scale, bias_f32, out,
                                               m, n, k, workspace, workspace_bytes,
                                               workspace_needed, stream);
}

#else

extern "C" int mxplus_sm90_fp8_chunk_gemm(
    const void*, const float*, const void*, const float*, const float*, void*, int, int, int,
    int, void*, size_t, size_t*, cudaStream_t) {
  return MXPLUS_ERR_NOT_COMPILED;  // built without sm_90a (MXPLUS_STUB)
}

#endif  // CUTLASS_ARCH_MMA_SM90_SUPPORTED && !MXPLUS_STUB
