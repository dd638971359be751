#!/usr/bin/env bash
# The calibrated grid served by vLLM: quantize SmolLM2 with `--method rtn-aware` and `--method
# gptq` (8 x 256 calibration tokens, macro block 128, no smoothing) for MXFP4-OCP, 16-OAS,
# MBS-S, MBS-H and NVFP4, then score each checkpoint's Wikipedia and news word perplexity with
# `mxplus eval eval/calibrated-grid/smollm2-135m-calibrated-grid.yaml`, in the config's order. Quantization
# (one thread) runs one checkpoint ahead of the evaluation, which starts each cell as soon as
# its checkpoint exists. Resumable: existing checkpoints and finished cells are kept.
# Writes eval/calibrated-grid/ (next to this script); the scheme x method table and chart:
#   python eval/calibrated-grid/grid.py
#   nohup eval/calibrated-grid/run.sh > /tmp/calibrated-grid.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/../.."
MX=${MXPLUS:-.venv/bin/mxplus}
SRC=~/.cache/vllm-mxplus/models/SmolLM2-135M-Instruct-bfloat16
DST=~/.cache/vllm-mxplus/calibrated
CFG=eval/calibrated-grid/smollm2-135m-calibrated-grid.yaml
OUT=eval/calibrated-grid
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
[ -d "$SRC" ] || "$MX" prepare
mkdir -p "$DST" "$OUT/logs"
# model id (as in $CFG) -> scheme; the method is the id's suffix
declare -A SCHEME=([mbsh]=mxfp4-mbs-h [nvfp4]=nvfp4 [mbss]=mxfp4-mbs-s [oas16]=mxfp4-16-oas
  [ocp]=mxfp4-ocp)
IDS=(mbsh-gptq nvfp4-gptq mbss-gptq mbsh-rtnaware nvfp4-rtnaware oas16-gptq ocp-gptq
  mbss-rtnaware oas16-rtnaware ocp-rtnaware)
method_of() { [ "${1#*-}" = rtnaware ] && echo rtn-aware || echo gptq; }
quantize_all() {
  for id in "${IDS[@]}"; do
    local dir="$DST/smollm2-$id"
    [ -d "$dir" ] && continue
    { echo "start $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"
      OMP_NUM_THREADS=1 "$MX" quantize "$SRC" "$dir" --scheme "${SCHEME[${id%%-*}]}" \
        --method "$(method_of "$id")" --nsamples 8 --seqlen 256 --no-progress
      echo "end $(date -u +%FT%TZ), load $(cut -d' ' -f1-3 /proc/loadavg)"; } \
      > "$OUT/logs/quantize-$id.log" 2>&1
  done
}
quantize_all &
QPID=$!
trap 'kill $QPID 2>/dev/null || true' EXIT
for id in "${IDS[@]}"; do
  while [ ! -f "$DST/smollm2-$id/config.json" ]; do
    kill -0 $QPID 2>/dev/null || [ -f "$DST/smollm2-$id/config.json" ] || {
      echo "quantization of $id failed: $OUT/logs/quantize-$id.log" >&2; exit 1; }
    sleep 20
  done
  "$MX" eval "$CFG" --out "$OUT" --models "$id" --no-progress "$@"
done
wait $QPID
"$MX" eval "$CFG" --out "$OUT" --table-only --no-plot > /dev/null
