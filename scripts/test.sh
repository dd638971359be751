#!/usr/bin/env bash
# The test suite (CPU). GPU tests are marked `gpu` and skip with a reason without CUDA.
# Triton kernels run under TRITON_INTERPRET=1 (set by tests/backends/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
exec .venv/bin/python -m pytest -q "$@"
