#!/usr/bin/env bash
# The study's calibrated rows: quantize (once) the best served checkpoint of MBS-S, MBS-H and
# NVFP4 from the calibrated studies, then run calibrated.yaml's cells into this folder.
# Resumable: existing checkpoints and finished cells are kept. Then:
#   python eval/smollm2-135m-benchmarks/analyze.py
#   nohup eval/smollm2-135m-benchmarks/run_calibrated.sh > /tmp/bench-calibrated.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
MX=${MXPLUS:-.venv/bin/mxplus}
SRC=~/.cache/vllm-mxplus/models/SmolLM2-135M-Instruct-bfloat16
DST=~/.cache/vllm-mxplus/calibrated
OUT=eval/smollm2-135m-benchmarks
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
[ -d "$SRC" ] || "$MX" prepare
mkdir -p "$DST" "$OUT/logs"
quantize() {  # NAME ARGS...
  local name=$1; shift
  [ -d "$DST/$name" ] && return 0
  { echo "start $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
    OMP_NUM_THREADS=1 "$MX" quantize "$SRC" "$DST/$name" --nsamples 8 --seqlen 256 \
      --no-progress "$@"
    echo "end $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"; } \
    > "$OUT/logs/quantize-$name.log" 2>&1
}
quantize smollm2-mbss-gptq --scheme mxfp4-mbs-s --method gptq
quantize smollm2-mbsh-rtnaware-sq-mb32 --scheme mxfp4-mbs-h --method rtn-aware --smooth 0.5 \
  --macro-block 32
quantize smollm2-nvfp4-rtnaware-sq --scheme nvfp4 --method rtn-aware --smooth 0.5
"$MX" eval "$OUT/calibrated.yaml" --out "$OUT"
