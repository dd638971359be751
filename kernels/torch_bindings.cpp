// pybind11 module `mxplus_cutlass`: torch wrappers of the C-ABI launchers (mxplus_launchers.h).
// The torch custom ops (with fake impls) are registered in vllm_mxplus/ops/cutlass_prefill.py.
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

torch::Tensor workspace_for(size_t bytes, const torch::Tensor& like) {
  return torch::empty({static_cast<int64_t>(bytes > 0 ? bytes : 1)},
                      like.options().dtype(torch::kUInt8));
}

void sm90_fp8_chunk_gemm(torch::Tensor a, torch::Tensor a_scale, torch::Tensor b,
                         torch::Tensor b_scale, c10::optional<torch::Tensor> bias,
                         torch::Tensor out) {
  check_cuda(a, "a_fp8", torch::kFloat8_e4m3fn);
  check_cuda(b, "b_fp8", torch::kFloat8_e4m3fn);
  check_cuda(a_scale, "a_scale", torch::kFloat32);
  check_cuda(b_scale, "b_scale", torch::kFloat32);
  check_cuda(out, "out", torch::kBFloat16);
  int m = a.size(0), k = a.size(1), n = b.size(0);
  TORCH_CHECK(b.size(1) == k && a_scale.size(0) == k / 128 && a_scale.size(1) == m &&
              b_scale.size(0) == k / 128 && b_scale.size(1) == n, "operand shapes disagree");
  const void* bias_ptr = nullptr;
  if (bias.has_value()) {
    check_cuda(*bias, "bias", torch::kBFloat16);
    TORCH_CHECK(bias->numel() == n, "bias must have N elements");
    bias_ptr = bias->data_ptr();
  }
  if (m == 0) return;
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  size_t need = 0;
  mxplus_sm90_fp8_chunk_gemm(a.data_ptr(), a_scale.data_ptr<float>(), b.data_ptr(),
                             b_scale.data_ptr<float>(), bias_ptr, out.data_ptr(), m, n, k,
                             nullptr, 0, &need, stream);
  auto ws = workspace_for(need, a);
  check(mxplus_sm90_fp8_chunk_gemm(a.data_ptr(), a_scale.data_ptr<float>(), b.data_ptr(),
                                   b_scale.data_ptr<float>(), bias_ptr, out.data_ptr(), m, n, k,
                                   ws.data_ptr(), ws.numel(), &need, stream),
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
  TORCH_CHECK(sigma_a.size(0) == k / 128 && sigma_a.size(1) == (m + 3) / 4 * 4 &&
              sigma_b.size(0) == k / 128 && sigma_b.size(1) == (n + 3) / 4 * 4,
              "sigma_a / sigma_b must be [k/128, rows rounded up to 4]");
  auto opts = a.options().dtype(torch::kFloat32);
  auto acc0 = torch::zeros({m, n}, opts);
  auto acc1 = use_mbs ? torch::empty({m, n}, opts) : acc0;
  if (m == 0) return acc0;
  const c10::cuda::OptionalCUDAGuard guard(a.device());
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  int which = 0;
  size_t need = 0;
  // First call sizes the workspace (every chunk launch needs the same amount).
  int rc = mxplus_sm100_fp4_mbs_gemm(a.data_ptr(), a_sf.data_ptr<uint8_t>(), b.data_ptr(),
                                     b_sf.data_ptr<uint8_t>(), sigma_a.data_ptr<float>(),
                                     sigma_b.data_ptr<float>(), acc0.data_ptr<float>(),
                                     acc1.data_ptr<float>(), m, n, k, use_mbs, &which, nullptr, 0,
                                     &need, stream);
  if (rc == MXPLUS_ERR_WORKSPACE) {
    auto ws = workspace_for(need, a);
    rc = mxplus_sm100_fp4_mbs_gemm(a.data_ptr(), a_sf.data_ptr<uint8_t>(), b.data_ptr(),
                                   b_sf.data_ptr<uint8_t>(), sigma_a.data_ptr<float>(),
                                   sigma_b.data_ptr<float>(), acc0.data_ptr<float>(),
                                   acc1.data_ptr<float>(), m, n, k, use_mbs, &which,
                                   ws.data_ptr(), ws.numel(), &need, stream);
  }
  check(rc, "sm100_fp4_mbs_gemm");
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
