"""Scheme x method tables of saved `mxplus eval` results (the served calibrated grid).

A grid row (a scheme) maps each method to (results JSON of one `mxplus eval` study, the
"model/row" prefix of its values); :func:`collect` reads whatever has been saved, so a cell
not run yet prints as "–". The study that uses it: eval/calibrated-grid/grid.py.
"""

from __future__ import annotations

import json
from pathlib import Path

TASKS: tuple[tuple[str, str], ...] = (("wiki_ppl", "Wikipedia"), ("news_ppl", "news"))
METHODS = ("rtn", "rtn-aware", "gptq", "rtn-aware + smooth 0.5", "gptq + smooth 0.5")
TARGET = "NVFP4"

Rows = dict[str, dict[str, tuple[Path, str]]]  # row label -> {method: (results file, prefix)}
Grid = dict[str, dict[str, dict[str, float]]]  # row -> method -> task -> value


def load_values(path: Path) -> dict[str, float]:
    """ "model/row/task" -> value of one `mxplus eval` JSON ({} if the study has not run)."""
    if not path.is_file():
        return {}
    values = json.loads(path.read_text())["values"]
    return {k: v["value"] for k, v in values.items() if v.get("value") is not None}


def collect(rows: Rows) -> Grid:
    """row -> method -> task -> word perplexity, for the cells that have results."""
    cache: dict[Path, dict[str, float]] = {}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for row, methods in rows.items():
        for method, (path, prefix) in methods.items():
            values = cache.setdefault(path, load_values(path))
            got = {t: values[f"{prefix}/{t}"] for t, _ in TASKS if f"{prefix}/{t}" in values}
            if got:
                out.setdefault(row, {})[method] = got
    return out


def _cell(grid: Grid, row: str, method: str, task: str) -> float | None:
    return grid.get(row, {}).get(method, {}).get(task)


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def table(grid: Grid, bf16: dict[str, float], rows: Rows, bf16_source: str) -> str:
    """Markdown: perplexity per row x (method, task), then the gap to TARGET per method."""
    head = [
        "| scheme | " + " | ".join(f"{m} ({t})" for m in METHODS for _, t in TASKS) + " |",
        "|---|" + "---:|" * (len(METHODS) * len(TASKS)),
    ]
    lines = list(head)
    for row in rows:
        cells = [_fmt(_cell(grid, row, m, task)) for m in METHODS for task, _ in TASKS]
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    if bf16:
        ppl = " / ".join(_fmt(bf16.get(task)) for task, _ in TASKS)
        lines += ["", f"BF16 (unquantized, {bf16_source}): {ppl}."]
    lines += ["", f"Against {TARGET} under the same method (+: above {TARGET}'s perplexity):", ""]
    lines += head
    for row in rows:
        if row == TARGET:
            continue
        cells = []
        for m in METHODS:
            for task, _ in TASKS:
                mine, ref = _cell(grid, row, m, task), _cell(grid, TARGET, m, task)
                cells.append(
                    "–" if mine is None or ref is None else f"{100 * (mine / ref - 1):+.1f} %"
                )
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def chart(grid: Grid, bf16: dict[str, float], png: Path, rows: Rows) -> None:
    """Bars per row and method, one panel per task, log scale, BF16 as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(TASKS), figsize=(13, 4.8), sharey=False)
    row_names = list(rows)
    width = 0.8 / len(METHODS)
    for ax, (task, label) in zip(axes, TASKS, strict=True):
        for i, m in enumerate(METHODS):
            xs, ys = [], []
            for j, row in enumerate(row_names):
                v = _cell(grid, row, m, task)
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
        ax.set_xticks(range(len(row_names)))
        ax.set_xticklabels([r.replace(", ", "\n") for r in row_names], fontsize=8)
        ax.set_title(f"{label} word perplexity (log scale, lower is better)", fontsize=10)
        ax.grid(axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct W4A4 served by vLLM (CPU): method per scheme", fontsize=11)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
