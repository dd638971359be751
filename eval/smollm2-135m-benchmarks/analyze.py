"""SmolLM2-135M on standard benchmarks: the table in the paper's shape with paired tests.

Reads the per-item results that `mxplus eval configs/smollm2-135m-benchmarks.yaml --out
eval/smollm2-135m-benchmarks` saved under raw/ (every row scored the same documents; checked)
and writes study.md, study.json and study.png next to this script:

- per task and row: accuracy (%) and its standard error (lm-eval's), LAMBADA perplexity;
- per row: the average over the six accuracies (the paper's "Avg"), the gap to NVFP4 and the
  gap closed from MXFP4-OCP to NVFP4, as in the paper's tables;
- per row, against NVFP4 and against MXFP4-OCP: the paired bootstrap of the average's
  difference on the same items (10,000 resamples, 95 % interval, two-sided p, Holm-adjusted
  over the rows compared with that reference) and, per task, McNemar's exact test;
  vllm_mxplus.evaluation.paired holds the statistics.

    python eval/smollm2-135m-benchmarks/analyze.py [--iters 10000]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any

import numpy as np

from vllm_mxplus.evaluation.config import load_config
from vllm_mxplus.evaluation.paired import (
    Paired,
    check_same_items,
    holm,
    load_row_items,
    mcnemar,
    mean_se,
    paired_bootstrap,
    paired_bootstrap_ppl,
    perplexity,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CONFIG = REPO / "configs" / "smollm2-135m-benchmarks.yaml"
CALIBRATED = HERE / "calibrated.yaml"  # the calibrated checkpoints, one model each, row "served"
MODEL = "smollm2-135m"
PPL_TASK, PPL_METRIC = "lambada_openai", "perplexity"
# Published lm-eval 0-shot figures for SmolLM2-135M-Instruct (HuggingFaceTB's bf16 weights,
# full evaluation sets): the "Baseline" column of the lm-eval table in the model card of
# lldois/SmolLM2-135M-Reasoning-SLERP-Champion (Hugging Face). task -> (metric, percent).
PUBLISHED_SOURCE = (
    "https://huggingface.co/lldois/SmolLM2-135M-Reasoning-SLERP-Champion "
    '(lm-eval, 0-shot, full sets; its "Baseline" column is SmolLM2-135M-Instruct)'
)
PUBLISHED = {
    "hellaswag": ("acc_norm", 42.99),
    "piqa": ("acc_norm", 66.92),
    "arc_easy": ("acc", 54.12),
    "arc_challenge": ("acc_norm", 27.73),
}


def _fmt_paired(p: Paired | None, unit: str = "") -> str:
    if p is None:
        return "—"
    star = " **real**" if p.p_adj is not None and p.p_adj < 0.05 else ""
    adj = f", Holm {p.p_adj:.3f}" if p.p_adj is not None else ""
    pv = "p<0.001" if p.p < 0.001 else f"p={p.p:.3f}"
    return f"{p.diff:+.2f}{unit} [{p.lo:+.2f}, {p.hi:+.2f}] {pv}{adj}{star}"


def _cpu_models(files: list[str]) -> list[str]:
    models = set()
    for f in files:
        env = json.loads(Path(f).read_text()).get("pretty_env_info", "")
        m = re.search(r"Model name:\s*(.+)", env)
        if m:
            models.add(m.group(1).strip())
    return sorted(models)


def analyze(iters: int) -> dict[str, Any]:
    cfg = load_config(CONFIG)
    limits = {t.limit for t in cfg.tasks}
    if len(limits) != 1:
        raise SystemExit(f"{CONFIG}: one limit for every task expected, got {limits}")
    limit = limits.pop()
    tasks = [t for t in cfg.tasks]
    metric = {t.task: t.metric.split(",")[0] for t in tasks}
    rows = {}
    for r in cfg.rows:
        items = load_row_items(HERE / "raw" / MODEL / r.id, limit)
        if items is not None and all(t.task in items.values for t in tasks):
            rows[r.id] = items
    if not rows:
        raise SystemExit(f"no finished row under {HERE / 'raw'}")
    check_same_items(list(rows.values()), [t.task for t in tasks])
    labels = {r.id: r.label for r in cfg.rows}
    calibrated = load_config(CALIBRATED)
    missing_calibrated = []
    for m in calibrated.models:
        items = load_row_items(HERE / "raw" / m.id / "served", limit)
        if items is not None and all(t.task in items.values for t in tasks):
            rows[m.id] = items
            labels[m.id] = m.label
        else:
            missing_calibrated.append(m.id)
    acc = {rid: [it.values[t.task][metric[t.task]] for t in tasks] for rid, it in rows.items()}
    out: dict[str, Any] = {"limit": limit, "tasks": [t.task for t in tasks], "rows": {}}
    for rid, it in rows.items():
        cells = {t.task: mean_se(it.values[t.task][metric[t.task]]) for t in tasks}
        avg = float(np.mean([m for m, _ in cells.values()]))
        avg_se = float(np.sqrt(sum(se**2 for _, se in cells.values())) / len(cells))
        out["rows"][rid] = {
            "label": labels[rid],
            "acc": {k: {"mean": 100 * m, "se": 100 * s} for k, (m, s) in cells.items()},
            "avg": 100 * avg,
            "avg_se": 100 * avg_se,
            "lambada_ppl": perplexity(it.values[PPL_TASK][PPL_METRIC]),
            "n_items": {t.task: len(it.doc_ids[t.task]) for t in tasks},
            "files": [str(Path(f).relative_to(REPO)) for f in it.files],
            "source": it.sources,
        }
    for ref in (cfg.target, cfg.baseline):
        if ref not in rows:
            continue
        family = [rid for rid in rows if rid != ref]
        paired = {rid: paired_bootstrap(acc[rid], acc[ref], iters=iters, seed=0) for rid in family}
        for rid, p in zip(family, holm([paired[r].p for r in family]), strict=True):
            paired[rid].p_adj = p
        ll_ref = rows[ref].values[PPL_TASK][PPL_METRIC]
        for rid in family:
            p = paired[rid]
            row = out["rows"][rid]
            row[f"vs_{ref}"] = {
                "avg_diff": 100 * p.diff,
                "ci95": [100 * p.lo, 100 * p.hi],
                "p": p.p,
                "p_holm": p.p_adj,
                "mcnemar": {
                    t.task: dict(
                        zip(
                            ("only_row", "only_ref", "p"),
                            mcnemar(
                                rows[rid].values[t.task][metric[t.task]],
                                rows[ref].values[t.task][metric[t.task]],
                            ),
                            strict=True,
                        )
                    )
                    for t in tasks
                },
                "lambada_ppl": vars(
                    paired_bootstrap_ppl(
                        rows[rid].values[PPL_TASK][PPL_METRIC], ll_ref, iters=iters, seed=0
                    )
                ),
            }
    base, target = cfg.baseline, cfg.target
    if target in out["rows"]:
        for row in out["rows"].values():
            row["gap_to_target"] = row["avg"] - out["rows"][target]["avg"]
    if base in out["rows"] and target in out["rows"]:
        span = out["rows"][target]["avg"] - out["rows"][base]["avg"]
        for row in out["rows"].values():
            row["gap_closed"] = (row["avg"] - out["rows"][base]["avg"]) / span if span else None
    files = [f for r in out["rows"].values() for f in r["files"]]
    out["cpu"] = _cpu_models([str(REPO / f) for f in files])
    out["commits"] = sorted(
        {s.get("git_commit", "?") for r in out["rows"].values() for s in r["source"]}
    )
    out["modified_files"] = sorted(
        {m for r in out["rows"].values() for s in r["source"] for m in s.get("modified_files", [])}
    )
    out["missing_rows"] = [r.id for r in cfg.rows if r.id not in rows] + missing_calibrated
    if "bf16" in rows:
        out["bf16_vs_published"] = {
            t: {
                "metric": m,
                "ours": 100 * mean_se(rows["bf16"].values[t][m])[0],
                "ours_se": 100 * mean_se(rows["bf16"].values[t][m])[1],
                "published": pub,
            }
            for t, (m, pub) in PUBLISHED.items()
        }
    out["labels"] = {t.task: t.label for t in tasks}
    out["iters"] = iters
    return out


def markdown(res: dict[str, Any]) -> str:
    tasks, labels = res["tasks"], res["labels"]
    rows = res["rows"]
    head = (
        "| Format | "
        + " | ".join(f"{labels[t]} (%)" for t in tasks)
        + " | Avg | Gap to NVFP4 | Gap closed | LAMBADA ppl |"
    )
    lines = [head, "|---|" + "---:|" * (len(tasks) + 4)]
    for r in rows.values():
        cells = [f"{r['acc'][t]['mean']:.1f} ± {r['acc'][t]['se']:.1f}" for t in tasks]
        gap = r.get("gap_to_target")
        closed = r.get("gap_closed")
        lines.append(
            f"| {r['label']} | "
            + " | ".join(cells)
            + f" | {r['avg']:.2f} ± {r['avg_se']:.2f}"
            + f" | {'—' if gap is None else f'{gap:+.2f}'}"
            + f" | {'—' if closed is None else f'{100 * closed:.0f}%'}"
            + f" | {r['lambada_ppl']:.1f} |"
        )
    out = lines
    pub = res.get("bf16_vs_published")
    if pub:
        out += [
            "",
            f"**BF16 against published figures** ({PUBLISHED_SOURCE}). Ours: the first "
            f"{res['limit']:g} documents, the bf16 checkpoint dequantized from the Q4_1 GGUF; "
            "theirs: the full sets, the original bf16 weights. Difference in standard errors "
            "of ours:",
            "",
            "| Task (metric) | ours | published | ours − published | in SEs |",
            "|---|---:|---:|---:|---:|",
        ]
        for t, v in pub.items():
            d = v["ours"] - v["published"]
            z = d / v["ours_se"] if v["ours_se"] else float("nan")
            out.append(
                f"| {labels[t]} ({v['metric']}) | {v['ours']:.1f} ± {v['ours_se']:.1f} | "
                f"{v['published']:.2f} | {d:+.1f} | {z:+.1f} |"
            )
    for ref, name in (("nvfp4", "NVFP4"), ("mxfp4-ocp", "MXFP4-OCP")):
        key = f"vs_{ref}"
        if not any(key in r for r in rows.values()):
            continue
        out += [
            "",
            f"**Paired against {name}** (same items; Avg difference in points, 95 % bootstrap "
            "interval, two-sided p, Holm-adjusted over the rows; **real** = adjusted p < 0.05; "
            "per task McNemar: items only the row / only the reference got right, exact p):",
            "",
            "| Format | Avg − ref | "
            + " | ".join(labels[t] for t in tasks)
            + " | LAMBADA ppl − ref |",
            "|---|---|" + "---|" * (len(tasks) + 1),
        ]
        for r in rows.values():
            v = r.get(key)
            if v is None:
                continue
            p = Paired(v["avg_diff"], v["ci95"][0], v["ci95"][1], v["p"], v["p_holm"])
            mc = " | ".join(
                f"{v['mcnemar'][t]['only_row']}/{v['mcnemar'][t]['only_ref']} "
                f"p={v['mcnemar'][t]['p']:.2f}"
                for t in tasks
            )
            lp = v["lambada_ppl"]
            ppl = Paired(lp["diff"], lp["lo"], lp["hi"], lp["p"])
            out.append(f"| {r['label']} | {_fmt_paired(p)} | {mc} | {_fmt_paired(ppl)} |")
    return "\n".join(out) + "\n"


def chart(res: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    names = [r["label"] for r in rows.values()]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    avg = [r["avg"] for r in rows.values()]
    err = [1.96 * r["avg_se"] for r in rows.values()]
    colors = [
        "tab:red" if r == "nvfp4" else "tab:gray" if r == "bf16" else "tab:blue" for r in rows
    ]
    ax1.bar(range(len(names)), avg, yerr=err, color=colors, capsize=3)
    ax1.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax1.set_ylabel("average accuracy over 6 tasks (%)")
    ax1.set_ylim(min(avg) - 8, max(avg) + 6)
    ax1.set_title("Average accuracy (95 % interval, unpaired)", fontsize=10)
    ax1.grid(axis="y", alpha=0.3)
    diffs = [(r["label"], r["vs_nvfp4"]) for r in rows.values() if "vs_nvfp4" in r]
    if diffs:
        ys = range(len(diffs))
        ax2.errorbar(
            [d["avg_diff"] for _, d in diffs],
            ys,
            xerr=[
                [d["avg_diff"] - d["ci95"][0] for _, d in diffs],
                [d["ci95"][1] - d["avg_diff"] for _, d in diffs],
            ],
            fmt="o",
            capsize=3,
        )
        ax2.axvline(0, color="tab:red", lw=1)
        ax2.set_yticks(list(ys), [n for n, _ in diffs], fontsize=8)
        ax2.invert_yaxis()
        ax2.set_xlabel("Avg − NVFP4 (points), paired bootstrap 95 % interval")
        ax2.set_title("Difference to NVFP4 on the same items", fontsize=10)
        ax2.grid(axis="x", alpha=0.3)
    n = next(iter(rows.values()))["n_items"]
    fig.suptitle(
        f"SmolLM2-135M-Instruct W4A4 served by vLLM (CPU): HellaSwag, PIQA, ARC-E/C, "
        f"WinoGrande, LAMBADA, first {min(n.values())} items each",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=10000, help="bootstrap resamples")
    args = ap.parse_args(argv)
    res = analyze(args.iters)
    head = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    md = [
        "# SmolLM2-135M-Instruct on standard benchmarks, per format (paired)",
        "",
        f"- items: the first {res['limit']:g} documents of each task's evaluation split in "
        "lm-eval's order, the same for every row (checked by document hash)",
        f"- results produced at commit(s) {', '.join(res['commits'])}"
        + (f" with modified files {res['modified_files']}" if res["modified_files"] else "")
        + f", on CPU {', '.join(res['cpu']) or 'unknown'}",
        f"- table: `python eval/smollm2-135m-benchmarks/analyze.py --iters {res['iters']}` "
        f"at {head}",
    ]
    if res["missing_rows"]:
        md.append(f"- rows not run yet: {', '.join(res['missing_rows'])}")
    md += ["", markdown(res)]
    (HERE / "study.md").write_text("\n".join(md))
    (HERE / "study.json").write_text(json.dumps(res, indent=2) + "\n")
    chart(res, HERE / "study.png")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
