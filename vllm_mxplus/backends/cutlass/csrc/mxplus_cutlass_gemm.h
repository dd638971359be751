// What the CUTLASS prefill GEMMs (sm90_fp8_chunk_scaled.cu, sm100_fp4_mbs.cu) set up alike:
// the packed strides and scale-factor layouts of their operands, and one launch with the
// workspace protocol of mxplus_launchers.h. Needs the CUTLASS headers: include it only where
// the file includes them (not in the MXPLUS_STUB build).
#pragma once

#include <cstddef>
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/util/packed_stride.hpp"
#include "mxplus_launchers.h"

namespace mxplus_cutlass {

// Strides and scale-factor layouts of one GEMM launch over A [m, k] and B [n, k] (K
// contiguous; `k` is the row pitch of both, which a chunked launch may exceed its problem K
// by) and C / D [m, n] (row-major); `sf_k` is the problem K the scale factors cover.
// ScaleConfig: the kernel's scale-factor config (tile_atom_to_shape_SFA / _SFB).
template <class Gemm, class ScaleConfig>
struct Operands {
  using Kernel = typename Gemm::GemmKernel;
  typename Kernel::StrideA a;
  typename Kernel::StrideB b;
  typename Kernel::StrideC c;
  typename Kernel::StrideD d;
  decltype(ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(0, 0, 0, 1))) sfa;
  decltype(ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(0, 0, 0, 1))) sfb;

  Operands(int m, int n, int k, int sf_k)
      : a(cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, cute::make_shape(m, k, 1))),
        b(cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, cute::make_shape(n, k, 1))),
        c(cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, cute::make_shape(m, n, 1))),
        d(cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, cute::make_shape(m, n, 1))),
        sfa(ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, n, sf_k, 1))),
        sfb(ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, n, sf_k, 1))) {}
};

// One launch of `args` on `stream`. *workspace_needed (if given) is raised to the workspace
// this launch needs; with a workspace missing or smaller than that it returns
// MXPLUS_ERR_WORKSPACE before running anything (the launchers' size query).
template <class Gemm>
int launch(typename Gemm::Arguments& args, void* workspace, size_t workspace_bytes,
           size_t* workspace_needed, cudaStream_t stream) {
  Gemm gemm;
  size_t need = Gemm::get_workspace_size(args);
  if (workspace_needed && need > *workspace_needed) *workspace_needed = need;
  if (need > 0 && (workspace == nullptr || need > workspace_bytes)) return MXPLUS_ERR_WORKSPACE;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return MXPLUS_ERR_CANNOT_IMPLEMENT;
  if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) return MXPLUS_ERR_INIT;
  if (gemm.run(stream) != cutlass::Status::kSuccess) return MXPLUS_ERR_RUN;
  return MXPLUS_OK;
}

// launch() for a launcher that makes one launch: *workspace_needed is set to what it needs.
template <class Gemm>
int launch_once(typename Gemm::Arguments& args, void* workspace, size_t workspace_bytes,
                size_t* workspace_needed, cudaStream_t stream) {
  size_t need = 0;
  const int rc = launch<Gemm>(args, workspace, workspace_bytes, &need, stream);
  if (workspace_needed) *workspace_needed = need;
  return rc;
}

}  // namespace mxplus_cutlass
