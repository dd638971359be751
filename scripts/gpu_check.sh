#!/usr/bin/env bash
# Run every GPU test (pytest -m gpu) and the GPU benchmarks ($GPU_BENCHES) in one call, with
# logs under $OUT (default ./out). Meant for a lent GPU box, run from the repository root;
# the whole run stays within ~8 minutes (per-step timeouts below).
#
#   bash scripts/gpu_check.sh            # OUT=./out
#   OUT=/tmp/o bash scripts/gpu_check.sh
#
# Environment: uses .venv if present; otherwise makes .venv-gpu on top of the machine's
# Python *with its system site-packages*, so an installed CUDA torch is reused (never
# re-downloaded), and pip-installs only what is missing: this package (-e, no deps), pytest,
# hypothesis, numpy, safetensors, tqdm, and triton if absent.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
say() { echo "[gpu_check] $*" | tee -a "$LOG"; }
START=$(date +%s)

if [ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
  PY=.venv/bin/python
else
  SYS_PY=$(command -v python3 || command -v python)
  if [ ! -x .venv-gpu/bin/python ]; then
    say "creating .venv-gpu (system site-packages) from $SYS_PY"
    "$SYS_PY" -m venv --system-site-packages .venv-gpu >>"$LOG" 2>&1 || { say "venv failed"; exit 2; }
  fi
  PY=.venv-gpu/bin/python
  if ! $PY -c "import torch" 2>/dev/null; then
    say "no torch on this machine: installing it (slow)"
    timeout 300 $PY -m pip install -q torch >>"$LOG" 2>&1
  fi
  missing=$($PY - <<'PYEOF'
import importlib.util as u
need = {"pytest": "pytest", "hypothesis": "hypothesis", "numpy": "numpy",
        "safetensors": "safetensors", "tqdm": "tqdm", "triton": "triton"}
print(" ".join(pip for mod, pip in need.items() if u.find_spec(mod) is None))
PYEOF
)
  if [ -n "$missing" ]; then
    say "pip install $missing"
    timeout 240 $PY -m pip install -q $missing >>"$LOG" 2>&1 || say "pip install failed (see log)"
  fi
  timeout 120 $PY -m pip install -q --no-deps -e . >>"$LOG" 2>&1 || say "pip install -e . failed"
fi

$PY - <<'PYEOF' 2>&1 | tee -a "$LOG"
import platform, torch
try:
    import triton; tv = triton.__version__
except Exception as e:
    tv = f"missing ({e})"
dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA"
print(f"[gpu_check] {platform.node()} | {dev} | python {platform.python_version()} | "
      f"torch {torch.__version__} (cuda {torch.version.cuda}) | triton {tv}")
PYEOF

unset TRITON_INTERPRET
rc=0
# the optional CUTLASS extension (kernels/README.md): sm90a on Hopper, sm100a on Blackwell
ARCH=$($PY -c "import torch; print('100a' if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 10 else '90a')" 2>/dev/null || echo 90a)
$PY -m pip install -q nvidia-cutlass==4.2.0.0 >>"$LOG" 2>&1
say "build CUTLASS extension for sm_$ARCH (timeout 240 s)"
timeout 240 $PY kernels/build.py --archs "$ARCH" > "$OUT/build_ext.log" 2>&1 || say "extension build failed (see build_ext.log)"
say "pytest -m gpu (timeout 240 s)"
timeout 240 $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -rfEs \
  --junitxml="$OUT/gpu_tests.xml" tests > "$OUT/pytest_gpu.log" 2>&1
prc=$?
tail -n 25 "$OUT/pytest_gpu.log" | tee -a "$LOG"
[ $prc -eq 0 ] || { say "pytest exit code $prc"; rc=1; }

# GPU benchmarks only (the CPU ones, e.g. bench_quantize / bench_serve_cpu, are not device checks)
GPU_BENCHES=${GPU_BENCHES:-"bench_act_quant bench_decode_gemm bench_prefill_gemm"}
for name in $GPU_BENCHES; do
  b=benchmarks/$name.py
  [ -f "$b" ] || { say "skip $name: not in this checkout"; continue; }
  left=$(( 470 - ($(date +%s) - START) ))
  if [ $left -lt 20 ]; then say "skip $name: time budget spent"; rc=1; continue; fi
  t=$(( left < 150 ? left : 150 ))
  say "$name (timeout $t s)"
  timeout "$t" $PY "$b" > "$OUT/$name.log" 2>&1
  brc=$?
  cat "$OUT/$name.log" | tee -a "$LOG" >/dev/null
  tail -n 40 "$OUT/$name.log"
  [ $brc -eq 0 ] || { say "$name exit code $brc"; rc=1; }
done
say "done in $(( $(date +%s) - START )) s, exit $rc; logs in $OUT"
exit $rc
