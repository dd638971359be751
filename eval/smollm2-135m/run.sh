#!/usr/bin/env bash
# The SmolLM2-135M CPU study: every paper row + BF16 through vLLM with the plugin, on the local
# tasks of eval/tasks/ (Wikipedia and news word perplexity, three BIG-bench sets).
# Resumable: rerun after an interruption (finished rows are skipped). Writes this folder: raw
# lm-eval JSON per row (raw/), runs.jsonl, and the table smollm2-135m.{md,json,png}, with
# notes.md appended under the table.
#   nohup eval/smollm2-135m/run.sh > /tmp/smollm2-study.log 2>&1 &
# Pass extra `mxplus eval` options through, e.g. --rows bf16 nvfp4.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
HERE=eval/smollm2-135m
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
if [ ! -f eval/tasks/wiki_ppl.jsonl ]; then
  : "${BIGBENCH:?set BIGBENCH=path/to/bigbench-1.0.0.tar.gz to build eval/tasks (see eval/tasks/README.md)}"
  "$PY" eval/tasks/build.py --bigbench "$BIGBENCH"
fi
"$PY" -m vllm_mxplus.cli prepare --what model >/dev/null 2>&1 || true   # the bf16 SmolLM2 checkpoint
"$PY" -m vllm_mxplus.cli eval configs/smollm2-135m.yaml --out "$HERE" --notes "$HERE/notes.md" "$@"
