#!/usr/bin/env bash
# The main job on the embedded default, from a fresh clone (CPU):
#   1. set up the environment (.venv, vLLM CPU build, this package)   [scripts/setup_env.sh]
#   2. prepare SmolLM2-135M-Instruct (bf16) and clean Wikipedia text  [mxplus prepare]
#   3. quantize it offline with MXFP4-MBS-H (MBS-D weights)           [mxplus quantize]
#   4. serve the quantized checkpoint with vLLM (detected, no flag)   [scripts/generate.py]
#   5. QSNR of weights, activations and GEMM outputs per format       [mxplus qsnr]
# Results land in out/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
PY=.venv/bin/python
MX=.venv/bin/mxplus
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
$MX prepare
MODEL=$($PY -c "from vllm_mxplus.assets.smollm2 import smollm2_dir; print(smollm2_dir())")
mkdir -p out
$MX quantize "$MODEL" out/smollm2-mxfp4-mbs --scheme mxfp4-mbs --force
$PY scripts/generate.py out/smollm2-mxfp4-mbs | tee out/generate-smollm2-mxfp4-mbs.txt
$MX qsnr "$MODEL" --json out/qsnr-smollm2.json --plot out/qsnr-smollm2.png | tee out/qsnr-smollm2.md
echo "quickstart: done; see out/"
