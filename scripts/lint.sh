#!/usr/bin/env bash
# Linters, as CI runs them before the tests (.ci/run): ruff (lint + format check) and mypy.
# Configuration lives in pyproject.toml ([tool.ruff], [tool.mypy]); versions are pinned in
# scripts/setup_env.sh.
#
#   bash scripts/lint.sh            # the whole repository
#   bash scripts/lint.sh PATH...    # ruff on these paths only (mypy always checks its scope)
#   FIX=1 bash scripts/lint.sh      # apply ruff's safe fixes and formatting first
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
paths=("$@")
[ ${#paths[@]} -eq 0 ] && paths=(.)
if [ "${FIX:-0}" = 1 ]; then
  "$VENV/bin/ruff" check --fix "${paths[@]}"
  "$VENV/bin/ruff" format "${paths[@]}"
fi
status=0
echo "[lint] ruff check"
"$VENV/bin/ruff" check "${paths[@]}" || status=1
echo "[lint] ruff format --check"
"$VENV/bin/ruff" format --check "${paths[@]}" || status=1
echo "[lint] mypy (scope: [tool.mypy] files in pyproject.toml)"
"$VENV/bin/mypy" || status=1
exit $status
