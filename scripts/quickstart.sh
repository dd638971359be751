#!/usr/bin/env bash
# The main job on the embedded default, from a fresh clone:
#   1. set up the CPU environment (.venv, vLLM CPU build, this package)  [scripts/setup_env.sh]
#   2. prepare SmolLM2-135M-Instruct (bf16) and clean Wikipedia text      [mxplus prepare]
#   3. QSNR of weights, activations and GEMM outputs per format          [mxplus qsnr]
# Results land in out/ (markdown table, JSON, Figure-6-style PNG).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
MX=.venv/bin/mxplus
$MX prepare
MODEL=$($PY -c "from vllm_mxplus.assets.smollm2 import smollm2_dir; print(smollm2_dir())")
mkdir -p out
$MX qsnr "$MODEL" --json out/qsnr-smollm2.json --plot out/qsnr-smollm2.png | tee out/qsnr-smollm2.md
echo "quickstart: done; see out/"
