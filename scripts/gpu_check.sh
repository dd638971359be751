#!/usr/bin/env bash
# The GPU check for one lent H100 / H200 (or B200) call: at most 10 minutes of wall time on
# the device tool (600 s per call; 15 min of device time per task including start-up), so
# every step is time-boxed and writes its JSON under $OUT even when cut. Installs nothing:
# the box has python3 with torch (CUDA 13), triton, nvcc, ninja, pytest, no vLLM, no network.
#
#   bash scripts/gpu_check.sh --prepare            # HERE, before sending the tree: copy the
#                                                  # CUTLASS headers the kernels include into
#                                                  # .cache/gpu_check/ (git-ignored, ~14 MiB)
#   bash scripts/gpu_check.sh --dry-run [--budget S]   # the plan and time boxes, runs nothing
#   OUT=DIR bash scripts/gpu_check.sh [--budget S]     # on the GPU box (OUT default ./out)
#
# Device tool: run(command="bash scripts/gpu_check.sh --budget 540", carry=[".cache/gpu_check"],
# timeout_s=600). Steps, in this order (boxes from scripts/gpu_check.py, scaled to --budget,
# default 570 s; a step starts only with >= 10 s left):
#   prereq   python modules, nvcc, CUTLASS headers, the device                          20 s
#   build    CUTLASS extension for this arch, started in the BACKGROUND here (all cores
#            but two, nvcc --split-compile, the keyed ~/.cache build directory: a second
#            call on the same machine reuses it); waited for before `cutlass`
#   served   selection + self-test per scheme: linears first, then every expert kind    60 s
#   speed    CUDA-graph replay timings with the L2 flushed: Llama-3-8B's four linears per
#            M against bf16, beside the static estimate (benchmarks/results/); act-quant
#            vs a bf16 copy; one expert's GEMM at 64 tokens                             120 s
#   sweep    the replay floor; the decode layer per VLLM_MXPLUS_GPU_PROGRAMS_PER_SM; the
#            decode GEMM alone per split-K x BLOCK_N x warps x stages (qkv, down at M 1
#            and 16); the FP8-chunk prefill's stages apart; MX+ / NVFP4 decode against
#            mx_gemm at M 1 / 4 / 16                                                     90 s
#   stack    8B-shaped stack (linears, MoE, gpt-oss MoE) under torch.compile, CUDA
#            graphs at M 1/8/16/24/64/512, replay = eager                                90 s
#   pytest_gpu  the reference on CUDA against the CPU, the Triton decode / x_hat tests and the
#            packed-weight FP8 GEMM's (its inline PTX on the GPU),
#            on CUDA tensors, then pytest -m gpu                                         70 s
#   cutlass  after the build: self-test (random within bound, then exact data bit for
#            bit), FP8-subnormal and every-row-inexact probes at M 512, capture, timing  80 s
#   correct  every CUDA backend at Llama-3-8B shapes against float64 (what is left)
# Until `cutlass`, VLLM_MXPLUS_BACKEND keeps the Triton backends (gpu_check.py TRITON_ONLY):
# a build finishing mid-step changes no choice. Cold Triton compiles count inside each box.
# $OUT (packed at the end into $OUT/gpu_check.tgz): <step>.json per step ("started" written first, "cut" when its box ran out),
# gpu_check.json (the steps' status, rc and seconds, the device), gpu_check.log (all output),
# build.log (the background build), pytest_gpu.xml (junit of the first pytest run; a killed
# pytest writes none).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
MODE=run
BUDGET_S=${GPU_CHECK_BUDGET_S:-570}
while [ $# -gt 0 ]; do
  case "$1" in
    --prepare) MODE=prepare ;;
    --dry-run) MODE=dry ;;
    --budget) BUDGET_S=${2:?--budget needs seconds}; shift ;;
    --budget=*) BUDGET_S=${1#--budget=} ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) echo "gpu_check.sh: unknown option $1 (--prepare, --dry-run, --budget S)" >&2; exit 2 ;;
  esac
  shift
done
case "$BUDGET_S" in ''|*[!0-9]*) echo "gpu_check.sh: --budget takes whole seconds" >&2; exit 2 ;; esac
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python  # a checkout's venv (dry runs here)
else PY=python3; fi                                     # the GPU box's system python
HEADERS=.cache/gpu_check/cutlass  # include/ + tools/util/include/: the headers the kernels need

# ----------------------------------------------------------------------------- --prepare
if [ "$MODE" = prepare ]; then
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
  exec "$PY" - "$HEADERS" <<'PYEOF'
"""Copy exactly the CUTLASS headers that nvcc -M lists for both kernels into the tree."""
import os, shutil, subprocess, sys
from pathlib import Path
from vllm_mxplus.backends.cutlass import build as ce

dest = Path(sys.argv[1])
roots = [d.resolve() for d in ce.cutlass_include_dirs()]  # [include, tools/util/include]
base = roots[0].parent  # .../source
needed = set()
for arch, name in ce.SOURCES.items():
    cmd = ce.nvcc_command(ce.SOURCE_DIR / name, Path(os.devnull), arch)
    cmd = [c for c in cmd if c not in ("-c", "-o", os.devnull)] + ["-M"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    for tok in out.replace("\\\n", " ").split():
        p = Path(tok).resolve() if not tok.endswith(":") else None
        if p and any(p.is_relative_to(r) for r in roots):
            needed.add(p)
if dest.exists():
    shutil.rmtree(dest)
size = 0
for p in sorted(needed):
    target = dest / p.relative_to(base)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(p, target)
    size += p.stat().st_size
print(f"[gpu_check] prepared {len(needed)} CUTLASS headers ({size / 2**20:.1f} MiB) in {dest}; "
      f"carry '{dest.parent}' (git-ignored: .cache/) with the run")
PYEOF
fi

OUT=${OUT:-./out}
START=$(date +%s)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
declare -A BOX
while read -r name secs; do BOX[$name]=$secs; done < <("$PY" scripts/gpu_check.py --boxes --budget "$BUDGET_S")
if [ "$MODE" = dry ]; then
  "$PY" scripts/gpu_check.py --dry-run --budget "$BUDGET_S"
  echo "[gpu_check] dry run: nothing executed (OUT would be $OUT)"
  exit 0
fi
# The device tool returns at most 8 files: the run writes under $FINAL/all, and the summary
# packs that folder into $FINAL/gpu_check.tgz beside copies of the summary, speed, sweep and log.
FINAL=$OUT
OUT=$FINAL/all
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
say() { echo "[gpu_check] $*" | tee -a "$LOG"; }
elapsed() { echo $(( $(date +%s) - START )); }
STEPS_JSON="$OUT/steps.jsonl"
: > "$STEPS_JSON"
step_record() {  # name rc seconds status detail
  printf '{"step": "%s", "rc": %s, "seconds": %s, "status": "%s", "detail": "%s"}\n' \
    "$1" "$2" "$3" "$4" "$(echo "$5" | tr '"\n' "' " | cut -c1-300)" >> "$STEPS_JSON"
}
box_for() {  # the step's box, cut to what is left of the budget (minus 10 s for the summary)
  local left=$(( BUDGET_S - 10 - $(elapsed) )) b=${BOX[$1]}
  echo $(( b < left ? b : left ))
}
mark_cut() {  # a step JSON still "started"/"running" after its box: "cut"
  timeout 10 "$PY" - "$OUT/$1.json" "$2" <<'PYEOF' || true
import json, sys
from pathlib import Path
p = Path(sys.argv[1])
rec = json.loads(p.read_text()) if p.exists() else {"step": p.stem, "checks": []}
if rec.get("status") in (None, "started", "running"):
    rec["status"] = "cut"
    rec["cut_after_s"] = int(sys.argv[2])
    p.write_text(json.dumps(rec, indent=1))
PYEOF
}
rc=0

# ----------------------------------------------------------------------------- prereq
t0=$(date +%s)
PRE=$(timeout "$(box_for prereq)" "$PY" - "$HEADERS" <<'PYEOF' 2>&1
import importlib.util as u, json, os, shutil, sys
from pathlib import Path
need = ["torch", "triton", "numpy"]
info = {"missing": [m for m in need if u.find_spec(m) is None]}
info["ninja"] = bool(shutil.which("ninja")) or u.find_spec("ninja") is not None
info["nvcc"] = shutil.which("nvcc") or ""
info["cores"] = os.cpu_count()
hdr = Path(sys.argv[1])
info["headers"] = str(hdr) if (hdr / "include" / "cutlass").is_dir() else ""
if not info["headers"] and u.find_spec("cutlass_library"):
    info["headers"] = "nvidia-cutlass wheel"
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda"] = bool(torch.cuda.is_available())
    if info["cuda"]:
        cap = torch.cuda.get_device_capability()
        info["device"] = torch.cuda.get_device_name()
        info["capability"] = f"{cap[0]}.{cap[1]}"
        info["arch"] = {(9, 0): "90a", (10, 0): "100a"}.get(cap, "")
except Exception as e:
    info["torch_error"] = repr(e)
try:
    import triton
    info["triton"] = triton.__version__
except Exception:
    pass
print(json.dumps(info))
PYEOF
)
echo "$PRE" | tee -a "$LOG"
echo "$PRE" | tail -n1 > "$OUT/prereq.json"
field() { echo "$PRE" | tail -n1 | "$PY" -c "import json,sys; v=json.load(sys.stdin).get('$1',''); print(' '.join(v) if isinstance(v, list) else v)" 2>/dev/null; }
NVCC=$(field nvcc); HDRS=$(field headers); CUDA=$(field cuda); ARCH=$(field arch); NINJA=$(field ninja)
CORES=$(nproc 2>/dev/null || echo 4)
if [ "$CUDA" != "True" ]; then
  step_record prereq 1 $(( $(date +%s) - t0 )) failed "no CUDA device"; rc=1
else
  step_record prereq 0 $(( $(date +%s) - t0 )) ok "$(field device) sm_$ARCH"
fi

# ----------------------------------------------------------------------------- build (background)
BUILD_PID=""
BUILD_T0=$(date +%s)
if [ -z "$NVCC" ] || [ -z "$HDRS" ] || [ "$NINJA" != "True" ] || [ -z "$ARCH" ]; then
  step_record build -1 0 skipped "nvcc=${NVCC:-none} headers=${HDRS:-none (--prepare)} ninja=$NINJA arch=${ARCH:-none}"
  say "build skipped: the cutlass step will say why"
else
  [ -d "$HEADERS/include" ] && export CUTLASS_DIR=$ROOT/$HEADERS
  BJOBS=$(( CORES > 4 ? CORES - 2 : CORES ))  # two cores left to the Triton steps meanwhile
  b=$(( BUDGET_S - 10 - $(elapsed) ))
  say "build CUTLASS sm_$ARCH in the background with $BJOBS jobs (at most $b s; cached builds return at once)"
  ( timeout "$b" "$PY" -m vllm_mxplus.backends.cutlass.build --archs "$ARCH" --jobs "$BJOBS" \
      > "$OUT/build.log" 2>&1; echo $? > "$OUT/build.rc" ) &
  BUILD_PID=$!
fi
wait_build() {  # the background build's record, waiting at most $1 s for it
  [ -z "$BUILD_PID" ] && return 0
  local waited=0
  while kill -0 "$BUILD_PID" 2>/dev/null && [ "$waited" -lt "$1" ]; do sleep 2; waited=$(( waited + 2 )); done
  local secs=$(( $(date +%s) - BUILD_T0 ))
  if kill -0 "$BUILD_PID" 2>/dev/null; then
    pkill -P "$BUILD_PID" 2>/dev/null; kill "$BUILD_PID" 2>/dev/null
    step_record build 124 "$secs" cut "still building after $secs s"; BUILD_PID=""; return 1
  fi
  local brc; brc=$(cat "$OUT/build.rc" 2>/dev/null || echo 1)
  cat "$OUT/build.log" >> "$LOG"
  if [ "$brc" = 0 ]; then step_record build 0 "$secs" ok "$(grep '^\[build\]' "$OUT/build.log" | tail -n1)"
  else step_record build "$brc" "$secs" "$([ "$brc" = 124 ] && echo cut || echo failed)" "see build.log"; fi
  BUILD_PID=""
  [ "$brc" = 0 ]
}

run_step() {  # name box: gpu_check.py STEP under a time box; its record
  local step=$1 b=$2
  if [ "$b" -lt 10 ]; then
    step_record "$step" -1 0 skipped "budget spent"
    printf '{"step": "%s", "status": "skipped", "reason": "budget spent"}\n' "$step" > "$OUT/$step.json"
    return
  fi
  say "$step (box $b s)"
  local t0; t0=$(date +%s)
  timeout --kill-after=5 "$b" "$PY" scripts/gpu_check.py "$step" --out "$OUT" >> "$LOG" 2>&1
  local src=$?
  if [ $src -eq 124 ] || [ $src -eq 137 ]; then
    mark_cut "$step" "$b"; step_record "$step" $src $(( $(date +%s) - t0 )) cut "box $b s ran out"; rc=1
  elif [ $src -eq 0 ]; then step_record "$step" 0 $(( $(date +%s) - t0 )) ok ""
  else mark_cut "$step" "$b"; step_record "$step" $src $(( $(date +%s) - t0 )) failed "see $step.json"; rc=1; fi
}

# ----------------------------------------------------------------------------- Triton steps
for step in served speed sweep stack; do run_step "$step" "$(box_for "$step")"; done

# ----------------------------------------------------------------------------- pytest on CUDA
# The reference on CUDA against the CPU (every format, bit for bit), then the Triton kernels'
# own tests on CUDA tensors (tests/backends/conftest.py: compiled kernels when a GPU is
# present): the decode GEMM of every format and its x_hat quantizer, then the tests marked gpu. -v: each result is in the log even when the box cuts pytest short
# (a killed pytest writes no junit file).
PYTEST_FIRST="tests/formats/test_device_division.py tests/backends/triton/test_triton_gemm_blocks.py tests/backends/triton/test_triton_split_k_finish.py tests/backends/cutlass/test_fp8_packed_gemm.py tests/backends/triton/test_triton_x_hat.py tests/backends/triton/test_triton_decode_nvfp4.py tests/backends/triton/test_triton_decode_mxplus.py tests/backends/triton/test_triton_decode_gemm.py"
b=$(box_for pytest_gpu)
if [ "$b" -ge 30 ]; then
  say "pytest on CUDA (box $b s): $PYTEST_FIRST, then -m gpu"
  t0=$(date +%s)
  # shellcheck disable=SC2086  # the file list splits on purpose
  timeout --kill-after=5 "$b" "$PY" -m pytest -v --maxfail=10 -p no:cacheprovider -o addopts="" -rfEs \
    --junitxml="$OUT/pytest_gpu.xml" $PYTEST_FIRST >> "$LOG" 2>&1
  prc=$?
  left=$(( b - ($(date +%s) - t0) ))
  if [ $prc -eq 0 ] && [ "$left" -ge 20 ]; then
    timeout --kill-after=5 "$left" "$PY" -m pytest -v --maxfail=10 -p no:cacheprovider -o addopts="" \
      -rfEs -m gpu tests/backends tests/kernels >> "$LOG" 2>&1
    prc=$?
  fi
  if [ $prc -eq 0 ]; then step_record pytest_gpu 0 $(( $(date +%s) - t0 )) ok ""
  elif [ $prc -eq 124 ] || [ $prc -eq 137 ]; then step_record pytest_gpu $prc $(( $(date +%s) - t0 )) cut "box $b s (results so far: gpu_check.log)"; rc=1
  else step_record pytest_gpu $prc $(( $(date +%s) - t0 )) failed "see gpu_check.log / pytest_gpu.xml"; rc=1; fi
else
  step_record pytest_gpu -1 0 skipped "budget spent"
fi

# ----------------------------------------------------------------------------- cutlass, correct
b=$(box_for cutlass)
if wait_build $(( b / 2 )); then
  export MXPLUS_REQUIRE_CUTLASS=1
  run_step cutlass "$(box_for cutlass)"
else
  step_record cutlass -1 0 skipped "no CUTLASS extension (see the build record)"; rc=1
fi
run_step correct $(( BUDGET_S - 10 - $(elapsed) ))

# ----------------------------------------------------------------------------- summary
timeout 10 "$PY" - "$STEPS_JSON" "$OUT" "$rc" "$(elapsed)" "$BUDGET_S" <<'PYEOF' | tee -a "$LOG"
import json, sys
from pathlib import Path
steps = [json.loads(l) for l in Path(sys.argv[1]).read_text().splitlines() if l.strip()]
out = Path(sys.argv[2])
res = {"exit": int(sys.argv[3]), "seconds": int(sys.argv[4]), "budget": int(sys.argv[5]),
       "steps": steps}
try:
    res["prereq"] = json.loads((out / "prereq.json").read_text())
except Exception as e:
    res["prereq_error"] = repr(e)
for s in ("served", "speed", "sweep", "stack", "cutlass", "correct"):
    p = out / f"{s}.json"
    if p.exists():
        rec = json.loads(p.read_text())
        res[s] = {"status": rec.get("status"), "failed": rec.get("failed", []),
                  "checks": len(rec.get("checks", []))}
(out / "gpu_check.json").write_text(json.dumps(res, indent=1))
print(f"[gpu_check] {out / 'gpu_check.json'}: exit {res['exit']}, {res['seconds']} s of "
      f"{res['budget']}: " + ", ".join(f"{s['step']} {s['status']}" for s in steps))
PYEOF
tar czf "$FINAL/gpu_check.tgz" -C "$FINAL" all \
  && for f in gpu_check.json speed.json sweep.json gpu_check.log; do if [ -f "$OUT/$f" ]; then cp "$OUT/$f" "$FINAL/"; fi; done \
  && rm -rf "$OUT"
echo "[gpu_check] $FINAL: gpu_check.tgz (every file of the run), gpu_check.json, speed.json, sweep.json, gpu_check.log"
exit $rc
