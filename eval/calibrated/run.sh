#!/usr/bin/env bash
# Calibrated SmolLM2 checkpoints served by vLLM: quantize (once) MBS-H at macro block 32 and
# NVFP4, with `--method rtn-aware` and with `--method gptq` (both `--smooth 0.5`, 8 x 256
# calibration tokens), then score their Wikipedia and news word perplexity with
# `mxplus eval eval/calibrated/smollm2-135m-calibrated.yaml`.
# Resumable (existing checkpoints and finished cells are kept). Writes
# eval/calibrated/ (next to this script).
#   nohup eval/calibrated/run.sh > /tmp/calibrated-served.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
MX=${MXPLUS:-.venv/bin/mxplus}
SRC=~/.cache/vllm-mxplus/models/SmolLM2-135M-Instruct-bfloat16
DST=~/.cache/vllm-mxplus/calibrated
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
[ -d "$SRC" ] || "$MX" prepare
mkdir -p "$DST"
quantize() {  # NAME ARGS...
  local name=$1; shift
  if [ ! -d "$DST/$name" ]; then
    OMP_NUM_THREADS=1 "$MX" quantize "$SRC" "$DST/$name" --smooth 0.5 \
      --nsamples 8 --seqlen 256 --no-progress "$@"
  fi
}
quantize smollm2-mbsh-rtnaware-sq-mb32 --method rtn-aware --scheme mxfp4-mbs-h --macro-block 32
quantize smollm2-nvfp4-rtnaware-sq --method rtn-aware --scheme nvfp4
quantize smollm2-mbsh-gptq-sq-mb32 --method gptq --scheme mxfp4-mbs-h --macro-block 32
quantize smollm2-nvfp4-gptq-sq --method gptq --scheme nvfp4
"$MX" eval eval/calibrated/smollm2-135m-calibrated.yaml --out eval/calibrated "$@"
