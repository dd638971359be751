"""Tables in the paper's shape from saved lm-eval JSON: one column per task, the average,
the gap to NVFP4 and the share of the MXFP4-OCP -> NVFP4 gap a row closes; plus a PNG chart.

Accuracies are shown in % (metric x scale), perplexities as they are. For each kind of task
present (accuracy, perplexity) the summary columns are:
  avg     mean over that kind's tasks (only when the row has all of them)
  gap     avg(row) - avg(target): accuracy points (negative = worse than NVFP4) or perplexity
          (positive = worse)
  closed  (avg(row) - avg(baseline)) / (avg(target) - avg(baseline)) in %: 0% = MXFP4-OCP,
          100% = NVFP4, the same formula for both kinds.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_mxplus.evaluation.config import KINDS, EvalConfig, TaskSpec
from vllm_mxplus.evaluation.runner import effective_limit, saved_results, task_done

KIND_LABEL = {"accuracy": "acc", "perplexity": "ppl"}


@dataclass(frozen=True)
class Value:
    value: float  # scaled (accuracy in %)
    stderr: float | None  # scaled, when lm-eval reports one
    n: int | None  # evaluated items (documents for perplexity)
    file: str


def _stderr(res: dict, metric: str) -> float | None:
    name, _, filt = metric.partition(",")
    v: Any = res.get(f"{name}_stderr,{filt}")
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def collect(
    cfg: EvalConfig,
    out_dir: Path,
    limit: float | None = None,
) -> dict[tuple[str, str, str], Value]:
    """(model id, row id, task) -> the newest saved value measured with the wanted limit."""
    values: dict[tuple[str, str, str], Value] = {}
    for model in cfg.models:
        for row in cfg.rows:
            for data in saved_results(out_dir, model.id, row.id):  # oldest first
                for task in cfg.tasks:
                    if not task_done(data, task, effective_limit(task, limit)):
                        continue
                    res = data["results"][task.task]
                    n = data.get("n-samples", {}).get(task.task, {}).get("effective")
                    se = _stderr(res, task.metric)
                    values[(model.id, row.id, task.task)] = Value(
                        value=float(res[task.metric]) * task.scale,
                        stderr=None if se is None else se * task.scale,
                        n=n,
                        file=data["mxplus"].get("file", ""),
                    )
    return values


def _avg(
    cfg: EvalConfig, values: dict, model: str, row: str | None, tasks: list[TaskSpec]
) -> float | None:
    if row is None or not tasks:
        return None
    got: list[Any] = [values.get((model, row, t.task)) for t in tasks]
    if any(v is None for v in got):
        return None
    return sum(v.value for v in got) / len(got)


def summarize(cfg: EvalConfig, values: dict) -> dict:
    """Per model, kind and row: avg, gap to target, gap closed vs baseline (JSON-ready)."""
    out: dict = {}
    for model in cfg.models:
        for kind in KINDS:
            tasks = [t for t in cfg.tasks if t.kind == kind]
            if not tasks:
                continue
            base = _avg(cfg, values, model.id, cfg.baseline, tasks)
            tgt = _avg(cfg, values, model.id, cfg.target, tasks)
            for row in cfg.rows:
                avg = _avg(cfg, values, model.id, row.id, tasks)
                gap = None if avg is None or tgt is None else avg - tgt
                closed = None
                if (
                    avg is not None
                    and base is not None
                    and tgt is not None
                    and abs(tgt - base) > 1e-12
                ):
                    closed = 100.0 * (avg - base) / (tgt - base)
                out.setdefault(model.id, {}).setdefault(kind, {})[row.id] = {
                    "avg": avg,
                    "gap_to_target": gap,
                    "gap_closed_pct": closed,
                }
    return out


def _fmt(v: float | None, digits: int = 2, sign: bool = False) -> str:
    if v is None:
        return "—"
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


def markdown_table(cfg: EvalConfig, values: dict, show_stderr: bool = True) -> str:
    """The paper-shaped table: rows = schemes, columns = tasks then summary columns."""
    summary = summarize(cfg, values)
    multi = len(cfg.models) > 1
    target_label = cfg.row(cfg.target).label if cfg.target else None
    head = ["Format"]
    for model in cfg.models:
        for t in cfg.tasks:
            unit = " (%)" if t.kind == "accuracy" else ""
            arrow = "↑" if t.higher_is_better else "↓"
            head.append(f"{model.label + ' ' if multi else ''}{t.label}{unit} {arrow}")
        for kind in KINDS:
            if not any(t.kind == kind for t in cfg.tasks):
                continue
            pre = f"{model.label} " if multi else ""
            k = KIND_LABEL[kind]
            head.append(f"{pre}Avg {k}")
            if target_label:
                head.append(f"{pre}Δ{k} vs {target_label}")
                if cfg.baseline:
                    head.append(f"{pre}Gap closed")
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|",
    ]
    for row in cfg.rows:
        cells = [row.label]
        for model in cfg.models:
            for t in cfg.tasks:
                v = values.get((model.id, row.id, t.task))
                if v is None:
                    cells.append("—")
                elif show_stderr and v.stderr is not None:
                    cells.append(f"{v.value:.2f} ± {v.stderr:.2f}")
                else:
                    cells.append(f"{v.value:.2f}")
            for kind in KINDS:
                if not any(t.kind == kind for t in cfg.tasks):
                    continue
                s = summary[model.id][kind][row.id]
                cells.append(_fmt(s["avg"]))
                if target_label:
                    cells.append(_fmt(s["gap_to_target"], sign=True))
                    if cfg.baseline:
                        c = s["gap_closed_pct"]
                        cells.append("—" if c is None else f"{round(c) + 0:d}%")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def step_gains(cfg: EvalConfig, values: dict) -> list[str]:
    """avg(row) - avg(previous row) for the rows from the baseline up to the target; a row
    without results is skipped (the step then spans it)."""
    summary = summarize(cfg, values)
    ids = [r.id for r in cfg.rows]
    lo = ids.index(cfg.baseline) if cfg.baseline else 0
    hi = ids.index(cfg.target) if cfg.target else len(ids)
    chain = cfg.rows[lo : hi + 1] if hi >= lo else ()
    out = []
    for model in cfg.models:
        for kind, rows in summary.get(model.id, {}).items():
            parts = []
            done = [r for r in chain if rows[r.id]["avg"] is not None]  # skip missing rows
            for prev, cur in zip(done, done[1:]):
                a, b = rows[prev.id]["avg"], rows[cur.id]["avg"]
                parts.append(f"{cur.label} − {prev.label} {b - a:+.2f}")
            if parts:
                pre = f"{model.label} " if len(cfg.models) > 1 else ""
                out.append(f"{pre}{KIND_LABEL[kind]}: " + "; ".join(parts))
    return out


def reference_markdown(cfg: EvalConfig) -> str:
    """The paper's own figures as quoted in the config (empty when none)."""
    ref = cfg.reference
    if not ref:
        return ""
    out = ["**Paper reference** (" + ref.get("source", "the paper's text") + "):"]
    if ref.get("text"):
        out.append("> " + " ".join(str(ref["text"]).split()))
    labels = {r.id: r.label for r in cfg.rows}

    def name(key: str) -> str:  # "mxfp4-ocp->mxplus" -> "MXFP4-OCP -> MX+"
        def one(part: str) -> str:
            head, _, rid = part.rpartition("/")
            return (head + "/" if head else "") + labels.get(rid, rid)

        return " -> ".join(one(p) for p in key.split("->"))

    for block, what in (
        ("average", "average"),
        ("delta_average", "average gain"),
        ("gap_to_target", "gap to target"),
    ):
        for k, v in ref.get(block, {}).items():
            if isinstance(v, dict):
                v = ", ".join(f"{kk}: {vv}" for kk, vv in v.items())
            out.append(f"- {what} {name(str(k))}: {v}")
    return "\n".join(out)


def write_report(
    cfg: EvalConfig,
    out_dir: Path,
    limit: float | None = None,
    header: str = "",
    plot: bool = True,
    notes: str = "",
) -> tuple[Path, Path, Path | None]:
    """Write OUT/<name>.md, OUT/<name>.json and OUT/<name>.png from the saved cells."""
    values = collect(cfg, out_dir, limit)
    md = [f"# {cfg.title}", ""]
    if header:
        md += [header.rstrip(), ""]
    md += [markdown_table(cfg, values), ""]
    steps = step_gains(cfg, values)
    if steps:
        md += [
            "Successive gains of the average (each row minus the row above it, the way the "
            "paper's text reports them; accuracy in points, perplexity in ppl, negative = "
            "lower perplexity):",
            "",
        ]
        md += [f"- {line}" for line in steps] + [""]
    ours = [t.label for t in cfg.tasks if t.source == "ours"]
    if ours:
        md += [f"Tasks of our choice (not named by the paper): {', '.join(ours)}.", ""]
    ref = reference_markdown(cfg)
    if ref:
        md += [ref, ""]
    walls = cell_walls(cfg, out_dir, {v.file for v in values.values()})
    if walls:
        total = sum(w for _, _, w in walls)
        md += [
            f"Wall time per cell (lm-eval worker, engine start included; total "
            f"{total / 60:.1f} min):",
            "",
        ]
        md += [f"- {name}: {w / 60:.1f} min" for name, _, w in walls] + [""]
    if notes:
        md += [notes.rstrip(), ""]
    md_path = out_dir / f"{cfg.name}.md"
    md_path.write_text("\n".join(md))
    data = {
        "config": cfg.name,
        "title": cfg.title,
        "baseline": cfg.baseline,
        "target": cfg.target,
        "rows": {r.id: {"label": r.label, "quantization": r.quantization} for r in cfg.rows},
        "tasks": {
            t.task: {
                "label": t.label,
                "metric": t.metric,
                "kind": t.kind,
                "num_fewshot": t.num_fewshot,
                "source": t.source,
            }
            for t in cfg.tasks
        },
        "values": {
            f"{m}/{r}/{t}": {"value": v.value, "stderr": v.stderr, "n": v.n, "file": v.file}
            for (m, r, t), v in values.items()
        },
        "summary": summarize(cfg, values),
        "reference": cfg.reference,
    }
    json_path = out_dir / f"{cfg.name}.json"
    json_path.write_text(json.dumps(data, indent=2))
    png = plot_chart(cfg, values, out_dir / f"{cfg.name}.png") if plot and values else None
    return md_path, json_path, png


def cell_walls(cfg: EvalConfig, out_dir: Path, files: set[str]) -> list[tuple[str, str, float]]:
    """(model/row: tasks, file, wall seconds) of the result files the table uses."""
    out = []
    for f in sorted(files):
        try:
            meta = json.loads(Path(f).read_text()).get("mxplus", {})
        except (OSError, json.JSONDecodeError):
            continue
        if "wall_s" in meta:
            name = f"{meta.get('model')}/{meta.get('row')}: {', '.join(meta.get('tasks', []))}"
            out.append((name, f, float(meta["wall_s"])))
    return out


def plot_chart(cfg: EvalConfig, values: dict, path: Path) -> Path:
    """Grouped bars: one panel per (model, kind), one group per task, one bar per row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(m, k) for m in cfg.models for k in KINDS if any(t.kind == k for t in cfg.tasks)]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.2), squeeze=False)
    colors = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]  # a ListedColormap
    for ax, (model, kind) in zip(axes[0], panels):
        tasks = [t for t in cfg.tasks if t.kind == kind]
        width = 0.8 / len(cfg.rows)
        for i, row in enumerate(cfg.rows):
            xs, ys, es = [], [], []
            for j, t in enumerate(tasks):
                v = values.get((model.id, row.id, t.task))
                if v is not None:
                    xs.append(j + (i - (len(cfg.rows) - 1) / 2) * width)
                    ys.append(v.value)
                    es.append(v.stderr or 0.0)
            ax.bar(
                xs,
                ys,
                width,
                yerr=es if any(es) else None,
                label=row.label,
                color=colors[i % len(colors)],
                capsize=2,
            )
        ax.set_xticks(range(len(tasks)))
        ax.set_xticklabels([t.label for t in tasks], rotation=15)
        ax.set_ylabel("accuracy (%)" if kind == "accuracy" else "word perplexity (lower is better)")
        ax.set_title(f"{model.label}: {kind}")
        if kind == "perplexity":
            ys_all = [
                values[(model.id, r.id, t.task)].value
                for r in cfg.rows
                for t in tasks
                if (model.id, r.id, t.task) in values
            ]
            if ys_all:
                lo, hi = min(ys_all), max(ys_all)
                ax.set_ylim(lo - 0.1 * (hi - lo + 1e-9) - 0.5, hi + 0.1 * (hi - lo + 1e-9))
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(cfg.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
