"""The served calibrated grid: scheme x method word perplexity of SmolLM2, table and chart.

Reads the saved results of three `mxplus eval` studies, all served by vLLM on the CPU kernels
with the same tasks (`eval/tasks/`):

- RTN: `eval/smollm2-135m/avx2/` (the bf16 checkpoint quantized at load);
- rtn-aware and gptq at macro block 128, no smoothing: `eval/calibrated-grid/` (`run.sh`);
- with `--smooth 0.5` (MBS-H also `--macro-block 32`): `eval/calibrated/` (`run.sh` there);

and writes `grid.md` and `grid.png` next to this script. A cell not run yet is "–". The table
and chart code is `vllm_mxplus.evaluation.grid`.

    python eval/calibrated-grid/grid.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_mxplus.evaluation.grid import TASKS, Rows, chart, collect, load_values, table

HERE = Path(__file__).resolve().parent
EVAL = HERE.parent
RTN = EVAL / "smollm2-135m" / "avx2" / "smollm2-135m.json"
GRID = HERE / "smollm2-135m-calibrated-grid.json"
SMOOTH = EVAL / "calibrated" / "smollm2-135m-calibrated.json"
BF16 = EVAL / "smollm2-135m" / "smollm2-135m.json"
BF16_SOURCE = "`eval/smollm2-135m/smollm2-135m.md`"


def _calibrated(rtn_row: str, study_row: str) -> dict[str, tuple[Path, str]]:
    """A scheme's RTN cell (the RTN study's row) and its rtn-aware / gptq cells (this study's
    rows `STUDY_ROW-rtnaware` / `STUDY_ROW-gptq`)."""
    return {
        "rtn": (RTN, f"smollm2-135m/{rtn_row}"),
        "rtn-aware": (GRID, f"{study_row}-rtnaware/served"),
        "gptq": (GRID, f"{study_row}-gptq/served"),
    }


# row label -> {method: (results file, "model/row" key prefix in its "values")}
ROWS: Rows = {
    "MXFP4-OCP": _calibrated("mxfp4-ocp", "ocp"),
    "MXFP4-16-OAS": _calibrated("mxfp4-16-oas", "oas16"),
    "MXFP4-MBS-S": _calibrated("mxfp4-mbs-s", "mbss"),
    "MXFP4-MBS-H": _calibrated("mxfp4-mbs-h", "mbsh"),
    "MXFP4-MBS-H, macro block 32": {
        "rtn-aware + smooth 0.5": (SMOOTH, "mbsh-mb32/served"),
        "gptq + smooth 0.5": (SMOOTH, "mbsh-mb32-gptq/served"),
    },
    "NVFP4": {
        **_calibrated("nvfp4", "nvfp4"),
        "rtn-aware + smooth 0.5": (SMOOTH, "nvfp4/served"),
        "gptq + smooth 0.5": (SMOOTH, "nvfp4-gptq/served"),
    },
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=GRID.parent, help="where grid.md / grid.png go")
    ap.add_argument("--no-plot", action="store_true", help="table only")
    args = ap.parse_args(argv)
    grid = collect(ROWS)
    bf16_all = load_values(BF16)
    bf16 = {
        t: bf16_all[f"smollm2-135m/bf16/{t}"]
        for t, _ in TASKS
        if f"smollm2-135m/bf16/{t}" in bf16_all
    }
    args.out.mkdir(parents=True, exist_ok=True)
    md = table(grid, bf16, ROWS, BF16_SOURCE)
    (args.out / "grid.md").write_text(md)
    if not args.no_plot:
        chart(grid, bf16, args.out / "grid.png", ROWS)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
