// C-ABI launchers of the CUTLASS prefill GEMMs (torch-free, so the .cu files compile alone).
#pragma once

#include <cstddef>
#include <cuda_runtime.h>

#define MXPLUS_OK 0
#define MXPLUS_ERR_SHAPE 1            // a shape the kernel does not take (the wrapper pads)
#define MXPLUS_ERR_WORKSPACE 2        // workspace missing or too small: see *workspace_needed
#define MXPLUS_ERR_CANNOT_IMPLEMENT 3 // CUTLASS can_implement failed (alignment)
#define MXPLUS_ERR_INIT 4
#define MXPLUS_ERR_RUN 5
#define MXPLUS_ERR_NOT_COMPILED 6     // this translation unit was built without its arch

#ifdef __cplusplus
extern "C" {
#endif

// sm_90a. a_fp8 [m, k] and b_fp8 [n, k] E4M3, K contiguous; a_scale [k/128, m] and
// b_scale [k/128, n] fp32 (chunk-major); bias_f32 [n] or NULL; out [m, n] bf16 (out_fp32 0)
// or fp32 (out_fp32 1), so fp16 / fp32 models get one rounding of the fp32 result.
// k % 128 == 0, n % 8 == 0. With too small a workspace (e.g. NULL) it sets
// *workspace_needed and returns MXPLUS_ERR_WORKSPACE without running; when no workspace is
// needed it runs at once (see mxplus_run_with_workspace).
int mxplus_sm90_fp8_chunk_gemm(const void* a_fp8, const float* a_scale, const void* b_fp8,
                               const float* b_scale, const float* bias_f32, void* out,
                               int out_fp32, int m, int n, int k, void* workspace,
                               size_t workspace_bytes, size_t* workspace_needed,
                               cudaStream_t stream);

// sm_100a. Bytes of the scale factors of one (rows x chunk_k) operand in CUTLASS's
// interleaved SF layout (rows padded to 128, chunk_k/16 scales a row padded to 4).
size_t mxplus_sm100_sf_bytes(int rows, int chunk_k);

// sm_100a. Scatter row-major E8M0 scales [rows, k/16] into per-chunk interleaved layouts
// (chunk c at byte c * mxplus_sm100_sf_bytes(rows, chunk_k)); chunk_k = 128 for the MBS
// GEMM, chunk_k = k for the no-MBS baseline. `out` must be zeroed first.
int mxplus_sm100_pack_scales(const unsigned char* scales, unsigned char* out, int rows, int k,
                             int chunk_k, cudaStream_t stream);

// sm_100a. Block-scaled FP4 (E2M1, UE8M0 scales at block 16) GEMM with MBS applied to the
// partial accumulator of every 128-K chunk:
//   acc[m, n] = sum_c sigma_a[c, m] * sigma_b[c, n] * (A_c B_c^T)[m, n]   (fp32, [m, n])
// a_fp4 [m, k/2] and b_fp4 [n, k/2] packed (element 2i in the low nibble); a_sf / b_sf packed
// by mxplus_sm100_pack_scales; sigma_a [k/128, ceil4(m)], sigma_b [k/128, ceil4(n)] fp32
// (= 1/F; rows padded to a multiple of 4 so every chunk's row is 16-byte aligned);
// acc0 / acc1 fp32 [m, n] ping-pong buffers, acc0 zeroed; *result is set to the buffer that
// holds the sum (0 or 1). With use_mbs == 0 it runs one full-K launch with no MBS (the
// MXFP4-16 baseline of the overhead benchmark) into acc0.
int mxplus_sm100_fp4_mbs_gemm(const void* a_fp4, const unsigned char* a_sf, const void* b_fp4,
                              const unsigned char* b_sf, const float* sigma_a,
                              const float* sigma_b, float* acc0, float* acc1, int m, int n,
                              int k, int use_mbs, int* result, void* workspace,
                              size_t workspace_bytes, size_t* workspace_needed,
                              cudaStream_t stream);

#ifdef __cplusplus
}

// Call a launcher once without a workspace; only when it asks for one (MXPLUS_ERR_WORKSPACE),
// allocate what it needs and call again. `launch(ws, bytes, &need)` returns an MXPLUS code;
// `alloc(bytes)` returns a device pointer. A kernel that needs no workspace therefore runs
// exactly once (running it as a "size query" first would run the whole GEMM twice).
template <class Launch, class Alloc>
int mxplus_run_with_workspace(Launch&& launch, Alloc&& alloc) {
  size_t need = 0;
  int rc = launch(static_cast<void*>(nullptr), size_t(0), &need);
  if (rc != MXPLUS_ERR_WORKSPACE) return rc;
  return launch(alloc(need), need, &need);
}
#endif
