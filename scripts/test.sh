#!/usr/bin/env bash
# The test suite (CPU). GPU tests are marked `gpu` and skip with a reason without CUDA.
# Triton kernels run under TRITON_INTERPRET=1 (set by tests/backends/conftest.py).
# MXPLUS_TEST_WORKERS (default 2) pytest-xdist workers, each running whole test files
# (--dist loadfile: a file's fixtures, e.g. its vLLM engines, are built once; in the order
# tests/conftest.py sorts them, heavy files first: --no-loadscope-reorder); 0 runs the
# tests in this process (a single file, a debugger). --durations: the 30 slowest tests, so a
# CI log shows where its time went. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/python -m pytest -q -n "${MXPLUS_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=30 "$@"
