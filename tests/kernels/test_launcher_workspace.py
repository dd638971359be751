"""The workspace protocol of the CUTLASS launchers (mxplus_launchers.h), compiled with the host
C++ compiler and run on fake launchers: a kernel that needs no workspace runs exactly once
(a "size query" that runs the GEMM would run every prefill GEMM twice), one that needs a
workspace gets it on the second call, and errors pass through."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from vllm_mxplus.backends.cutlass import build as cutlass_ext

PROGRAM = r"""
#include <cstdio>
#include <cstdlib>
#include "mxplus_launchers.h"

static int fail(const char* what) { std::printf("FAIL %s\n", what); return 1; }

int main() {
  static char buffer[256];
  int runs = 0, calls = 0, allocs = 0;
  // (a) no workspace needed: the first call runs the kernel and returns OK
  auto no_ws = [&](void* ws, size_t bytes, size_t* need) {
    ++calls; *need = 0; ++runs; return MXPLUS_OK;
  };
  auto alloc = [&](size_t bytes) -> void* { ++allocs; return bytes <= 256 ? buffer : nullptr; };
  if (mxplus_run_with_workspace(no_ws, alloc) != MXPLUS_OK) return fail("a: rc");
  if (runs != 1 || calls != 1 || allocs != 0) return fail("a: ran more than once");
  // (b) 96 bytes needed: the query returns MXPLUS_ERR_WORKSPACE without running
  runs = calls = allocs = 0;
  auto with_ws = [&](void* ws, size_t bytes, size_t* need) {
    ++calls; *need = 96;
    if (ws == nullptr || bytes < 96) return MXPLUS_ERR_WORKSPACE;
    ++runs; return MXPLUS_OK;
  };
  if (mxplus_run_with_workspace(with_ws, alloc) != MXPLUS_OK) return fail("b: rc");
  if (runs != 1 || calls != 2 || allocs != 1) return fail("b: query then one run");
  // (c) other errors are returned at once
  runs = calls = allocs = 0;
  auto broken = [&](void*, size_t, size_t* need) { ++calls; *need = 0; return MXPLUS_ERR_SHAPE; };
  if (mxplus_run_with_workspace(broken, alloc) != MXPLUS_ERR_SHAPE) return fail("c: rc");
  if (calls != 1 || allocs != 0) return fail("c: retried");
  std::printf("OK\n");
  return 0;
}
"""


def _cuda_include() -> Path:
    """The CUDA toolkit's include dir (the header needs cuda_runtime.h for cudaStream_t)."""
    roots = [os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    try:
        roots.append(str(Path(cutlass_ext.nvcc_path()).resolve().parent.parent))
    except cutlass_ext.BuildError:
        pass
    for root in filter(None, roots):
        if (Path(root) / "include" / "cuda_runtime.h").is_file():
            return Path(root) / "include"
    pytest.skip(f"cuda_runtime.h not found under {[r for r in roots if r]}")


@pytest.mark.skipif(shutil.which("c++") is None, reason="no host C++ compiler (c++)")
def test_run_with_workspace_runs_once(tmp_path):
    src = tmp_path / "ws.cpp"
    src.write_text(PROGRAM)
    exe = tmp_path / "ws"
    cc = subprocess.run(
        [
            "c++",
            "-std=c++17",
            f"-I{cutlass_ext.SOURCE_DIR}",
            f"-I{_cuda_include()}",
            str(src),
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cc.returncode == 0, cc.stderr[-3000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0 and run.stdout.strip() == "OK", run.stdout


def test_bindings_use_the_protocol():
    """Both GEMM wrappers in torch_bindings.cpp go through mxplus_run_with_workspace (the
    protocol above), not a hand-written query-then-run."""
    text = (cutlass_ext.SOURCE_DIR / "torch_bindings.cpp").read_text()
    assert text.count("mxplus_run_with_workspace(") == 2
    assert "nullptr, 0, &need" not in text
