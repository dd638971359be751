"""The served calibrated grid: scheme x method word perplexity of SmolLM2, table and chart.

Reads the saved results of three `mxplus eval` studies, all served by vLLM on the CPU kernels
with the same tasks (`eval/tasks/`):

- RTN: `eval/results/smollm2-135m-avx2/` (the bf16 checkpoint quantized at load);
- rtn-aware and gptq at macro block 128, no smoothing: `eval/results/smollm2-135m-calibrated-grid/`
  (`eval/run_calibrated_grid.sh`);
- with `--smooth 0.5` (MBS-H also `--macro-block 32`): `eval/results/smollm2-135m-calibrated/`
  (`eval/run_calibrated_served.sh`);

and writes `grid.md` and `grid.png` into the grid's directory. A cell not run yet is "–".

    python eval/calibrated_grid.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RTN = RESULTS / "smollm2-135m-avx2" / "smollm2-135m.json"
GRID = RESULTS / "smollm2-135m-calibrated-grid" / "smollm2-135m-calibrated-grid.json"
SMOOTH = RESULTS / "smollm2-135m-calibrated" / "smollm2-135m-calibrated.json"
BF16 = RESULTS / "smollm2-135m.json"

TASKS = (("wiki_ppl", "Wikipedia"), ("news_ppl", "news"))
METHODS = ("rtn", "rtn-aware", "gptq", "rtn-aware + smooth 0.5", "gptq + smooth 0.5")

# row label -> {method: (results file, "model/row" key prefix in its "values")}
ROWS: dict[str, dict[str, tuple[Path, str]]] = {
    "MXFP4-OCP": {
        "rtn": (RTN, "smollm2-135m/mxfp4-ocp"),
        "rtn-aware": (GRID, "ocp-rtnaware/served"),
        "gptq": (GRID, "ocp-gptq/served"),
    },
    "MXFP4-16-OAS": {
        "rtn": (RTN, "smollm2-135m/mxfp4-16-oas"),
        "rtn-aware": (GRID, "oas16-rtnaware/served"),
        "gptq": (GRID, "oas16-gptq/served"),
    },
    "MXFP4-MBS-S": {
        "rtn": (RTN, "smollm2-135m/mxfp4-mbs-s"),
        "rtn-aware": (GRID, "mbss-rtnaware/served"),
        "gptq": (GRID, "mbss-gptq/served"),
    },
    "MXFP4-MBS-H": {
        "rtn": (RTN, "smollm2-135m/mxfp4-mbs-h"),
        "rtn-aware": (GRID, "mbsh-rtnaware/served"),
        "gptq": (GRID, "mbsh-gptq/served"),
    },
    "MXFP4-MBS-H, macro block 32": {
        "rtn-aware + smooth 0.5": (SMOOTH, "mbsh-mb32/served"),
        "gptq + smooth 0.5": (SMOOTH, "mbsh-mb32-gptq/served"),
    },
    "NVFP4": {
        "rtn": (RTN, "smollm2-135m/nvfp4"),
        "rtn-aware": (GRID, "nvfp4-rtnaware/served"),
        "gptq": (GRID, "nvfp4-gptq/served"),
        "rtn-aware + smooth 0.5": (SMOOTH, "nvfp4/served"),
        "gptq + smooth 0.5": (SMOOTH, "nvfp4-gptq/served"),
    },
}
TARGET = "NVFP4"


def load_values(path: Path) -> dict[str, float]:
    """ "model/row/task" -> value of one `mxplus eval` JSON ({} if the study has not run)."""
    if not path.is_file():
        return {}
    values = json.loads(path.read_text())["values"]
    return {k: v["value"] for k, v in values.items() if v.get("value") is not None}


def collect() -> dict[str, dict[str, dict[str, float]]]:
    """row -> method -> task -> word perplexity, for the cells that have results."""
    cache: dict[Path, dict[str, float]] = {}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row, methods in ROWS.items():
        for method, (path, prefix) in methods.items():
            values = cache.setdefault(path, load_values(path))
            got = {t: values[f"{prefix}/{t}"] for t, _ in TASKS if f"{prefix}/{t}" in values}
            if got:
                out.setdefault(row, {})[method] = got
    return out


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def table(grid: dict[str, dict[str, dict[str, float]]], bf16: dict[str, float]) -> str:
    head = [
        "| scheme | " + " | ".join(f"{m} ({t})" for m in METHODS for _, t in TASKS) + " |",
        "|---|" + "---:|" * (len(METHODS) * len(TASKS)),
    ]
    lines = list(head)
    for row in ROWS:
        cells = [_fmt(grid.get(row, {}).get(m, {}).get(task)) for m in METHODS for task, _ in TASKS]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    if bf16:
        ppl = " / ".join(_fmt(bf16.get(task)) for task, _ in TASKS)
        lines += ["", f"BF16 (unquantized, `eval/results/smollm2-135m.md`): {ppl}."]
    lines += ["", f"Against {TARGET} under the same method (+: above {TARGET}'s perplexity):", ""]
    lines += head
    target = grid.get(TARGET, {})
    for row in ROWS:
        if row == TARGET:
            continue
        cells = []
        for m in METHODS:
            for task, _ in TASKS:
                mine, ref = grid.get(row, {}).get(m, {}).get(task), target.get(m, {}).get(task)
                cells.append(
                    "–" if mine is None or ref is None else f"{100 * (mine / ref - 1):+.1f} %"
                )
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def chart(grid: dict[str, dict[str, dict[str, float]]], bf16: dict[str, float], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(TASKS), figsize=(13, 4.8), sharey=False)
    rows = list(ROWS)
    width = 0.8 / len(METHODS)
    for ax, (task, label) in zip(axes, TASKS, strict=True):
        for i, m in enumerate(METHODS):
            xs, ys = [], []
            for j, row in enumerate(rows):
                v = grid.get(row, {}).get(m, {}).get(task)
                if v is not None:
                    xs.append(j + (i - (len(METHODS) - 1) / 2) * width)
                    ys.append(v)
            ax.bar(xs, ys, width, label=m)
        if task in bf16:
            ax.axhline(bf16[task], color="k", ls="--", lw=1, label="BF16")
        ax.set_yscale("log")
        ticks = [60, 80, 100, 150, 200, 300, 500]
        ax.set_yticks(ticks, [str(t) for t in ticks])
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([r.replace(", ", "\n") for r in rows], fontsize=8)
        ax.set_title(f"{label} word perplexity (log scale, lower is better)", fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct W4A4 served by vLLM (CPU): method per scheme", fontsize=11)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=GRID.parent, help="where grid.md / grid.png go")
    ap.add_argument("--no-plot", action="store_true", help="table only")
    args = ap.parse_args(argv)
    grid = collect()
    bf16_all = load_values(BF16)
    bf16 = {
        t: bf16_all[f"smollm2-135m/bf16/{t}"]
        for t, _ in TASKS
        if f"smollm2-135m/bf16/{t}" in bf16_all
    }
    args.out.mkdir(parents=True, exist_ok=True)
    md = table(grid, bf16)
    (args.out / "grid.md").write_text(md)
    if not args.no_plot:
        chart(grid, bf16, args.out / "grid.png")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
