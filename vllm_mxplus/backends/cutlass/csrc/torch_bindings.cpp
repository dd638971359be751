// pybind11 module `mxplus_cutlass`: torch wrappers of the C-ABI launchers (mxplus_launchers.h).
// The torch custom ops (with fake impls) are registered in vllm_mxplus/backends/cutlass/ops.py.
// Nothing here syncs the host or touches CPU memory: workspaces and outputs come from the
// current stream's caching allocator, so the calls can be captured in a CUDA graph.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <string>
#include <vector>

#include "mxplus_launchers.h"

namespace {

void check(int rc, const char* what) {
  static const char* names[] = {"ok", "unsupported shape", "workspace", "cannot implement",
                                "initialize failed", "run failed", "arch not compiled"};
  TORCH_CHECK(rc == MXPLUS_OK, what, ": ", (rc >= 0 && rc <= 6) ? names[rc] : "error ", rc);
}

void check_cuda(const torch::Tensor& t, const char* name, torch::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
}

// A device workspace that lives until the end of the call (the allocator recycles it after the
// stream's work, which is what CUTLASS needs).
struct Workspace {
  torch::Tensor like;
  torch::Tensor buf;
  void* operator()(size_t bytes) {
    buf = torch::empty({static_cast<int64_t>(bytes > 0 ? bytes : 1)},
                       like.options().dtype(torch::kUInt8));
    return buf.data_ptr();
  }
};

void sm90_fp8_chunk_gemm(torch::Tensor a, torch::Tensor a_scale, torch::Tensor b,
                         torch::Tensor b_scale, c10::optional<torch::Tensor> bias,
                         torch::Tensor out) {
  check_cuda(a, "a_fp8", torch::kFloat8_e4m3fn);
  check_cuda(b, "b_fp8", torch::kFloat8_e4m3fn);
  check_cuda(a_scale, "a_scale", torch::kFloat32);
  check_cuda(b_scale, "b_scale", torch::kFloat32);
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() &&
              (out.scalar_type() == torch::kBFloat16 || out.scalar_type() == torch::kFloat32),
              "out must be a contiguous CUDA bf16 or fp32 tensor, got ", out.scalar_type());
  int m = a.size(0), k = a.size(1), n = b.size(0);
  TORCH_CHECK(b.size(1) == k && a_scale.size(0) == k / 128 && a_scale.size(1) == m &&
              b_scale.size(0) == k / 128 && b_scale.size(1) == n && out.size(0) == m &&
              out.size(1) == n, "operand shapes disagree");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    check_cuda(*bias, "bias", torch::kFloat32);
    TORCH_CHECK(bias->numel() == n, "bias must have N elements");
    bias_ptr = bias->data_ptr<float>();
  }
  if (m == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  int out_fp32 = out.scalar_type() == torch::kFloat32;
  Workspace ws{a, {}};
  check(mxplus_run_with_workspace(
            [&](void* w, size_t bytes, size_t* need) {
              return mxplus_sm90_fp8_chunk_gemm(a.data_ptr(), a_scale.data_ptr<float>(),
                                                b.data_ptr(), b_scale.data_ptr<float>(),
                                                bias_ptr, out.data_ptr(), out_fp32, m, n, k, w,
                                                bytes, need, stream);
            },
            ws),
        "sm90_fp8_chunk_gemm");
}

torch::Tensor sm100_pack_scales(torch::Tensor scales, int64_t k, int64_t chunk_k) {
  check_cuda(scales, "scales", torch::kUInt8);
  int rows = scales.size(0);
  TORCH_CHECK(scales.size(1) == k / 16, "scales must be [rows, k/16]");
  size_t per_chunk = mxplus_sm100_sf_bytes(rows, chunk_k);
  auto out = torch::zeros({static_cast<int64_t>(per_chunk * (k / chunk_k))}, scales.options());
  const c10::cuda::OptionalCUDAGuard guard(scales.device());
  check(mxplus_sm100_pack_scales(scales.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), rows, k,
                                 chunk_k, c10::cuda::getCurrentCUDAStream().stream()),
        "sm100_pack_scales");
  return out;
}

torch::Tensor sm100_fp4_mbs_gemm(torch::Tensor a, torch::Tensor a_sf, torch::Tensor b,
                                 torch::Tensor b_sf, torch::Tensor sigma_a,
                                 torch::Tensor sigma_b, bool use_mbs) {
  check_cuda(a, "a_codes", torch::kUInt8);
  check_cuda(b, "b_codes", torch::kUInt8);
  check_cuda(a_sf, "a_sf", torch::kUInt8);
  check_cuda(b_sf, "b_sf", torch::kUInt8);
  check_cuda(sigma_a, "sigma_a", torch::kFloat32);
  check_cuda(sigma_b, "sigma_b", torch::kFloat32);
  int m = a.size(0), k = a.size(1) * 2, n = b.size(0);
  TORCH_CHECK(b.size(1) * 2 == k, "A and B disagree on K");
  // sigma is read only with MBS (the no-MBS launch takes any fp32 tensor, e.g. an empty one)
  TORCH_CHECK(!use_mbs || (sigma_a.dim() == 2 && sigma_b.dim() == 2 &&
                           sigma_a.size(0) == k / 128 && sigma_a.size(1) == (m + 3) / 4 * 4 &&
                           sigma_b.size(0) == k / 128 && sigma_b.size(1) == (n + 3) / 4 * 4),
              "sigma_a / sigma_b must be [k/128, rows rounded up to 4]");
  auto opts = a.options().dtype(torch::kFloat32);
  auto acc0 = torch::zeros({m, n}, opts);
  auto acc1 = use_mbs ? torch::empty({m, n}, opts) : acc0;
  if (m == 0) return acc0;
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  int which = 0;
  // Every chunk launch needs the same workspace; the first asks for it before running.
  Workspace ws{a, {}};
  check(mxplus_run_with_workspace(
            [&](void* w, size_t bytes, size_t* need) {
              return mxplus_sm100_fp4_mbs_gemm(
                  a.data_ptr(), a_sf.data_ptr<uint8_t>(), b.data_ptr(), b_sf.data_ptr<uint8_t>(),
                  sigma_a.data_ptr<float>(), sigma_b.data_ptr<float>(), acc0.data_ptr<float>(),
                  acc1.data_ptr<float>(), m, n, k, use_mbs, &which, w, bytes, need, stream);
            },
            ws),
        "sm100_fp4_mbs_gemm");
  return which == 0 ? acc0 : acc1;
}

std::vector<std::string> compiled_archs() {
  std::vector<std::string> archs;
#ifdef MXPLUS_HAVE_SM90A
  archs.push_back("sm90a");
#endif
#ifdef MXPLUS_HAVE_SM100A
  archs.push_back("sm100a");
#endif
  return archs;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sm90_fp8_chunk_gemm", &sm90_fp8_chunk_gemm);
  m.def("sm100_pack_scales", &sm100_pack_scales);
  m.def("sm100_fp4_mbs_gemm", &sm100_fp4_mbs_gemm);
  m.def("compiled_archs", &compiled_archs);
}
