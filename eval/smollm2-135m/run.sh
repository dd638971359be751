#!/usr/bin/env bash
# The SmolLM2-135M CPU study: every paper row + BF16 through vLLM with the plugin.
# Resumable: rerun after an interruption. Writes eval/results/smollm2-135m/ (raw lm-eval
# JSON per row, logs) and copies the table to eval/results/smollm2-135m.{md,json,png}.
#   nohup eval/run_smollm2_study.sh > /tmp/smollm2-study.log 2>&1 &
# Pass extra `mxplus eval` options through, e.g. --rows bf16 nvfp4.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ ! -f eval/tasks/wiki_ppl.jsonl ]; then
  : "${BIGBENCH:?set BIGBENCH=path/to/bigbench-1.0.0.tar.gz to build eval/tasks (see eval/tasks/README.md)}"
  "$PY" eval/build_tasks.py --bigbench "$BIGBENCH"
fi
"$PY" -m vllm_mxplus.cli prepare >/dev/null 2>&1 || true   # the bf16 SmolLM2 checkpoint
NOTES=()
if [ -f eval/results/smollm2-135m.notes.md ]; then NOTES=(--notes eval/results/smollm2-135m.notes.md); fi
rc=0
"$PY" -m vllm_mxplus.cli eval configs/smollm2-135m.yaml --out eval/results/smollm2-135m \
  "${NOTES[@]}" "$@" || rc=$?
for ext in md json png; do  # the table of whatever finished, also after a failed cell
  if [ -f "eval/results/smollm2-135m/smollm2-135m.$ext" ]; then
    cp "eval/results/smollm2-135m/smollm2-135m.$ext" "eval/results/smollm2-135m.$ext"
  fi
done
exit $rc
