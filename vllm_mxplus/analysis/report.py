"""The QSNR report behind `mxplus qsnr`: Figure 6 (per-format QSNR of activations, weights and
GEMM outputs) and the Appendix A macro-block ablation, as a table, JSON and a PNG chart."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from vllm_mxplus.analysis.metrics import (
    flush_to_zero_rate,
    format_label,
    oas_takeup,
    tensor_metrics,
)
from vllm_mxplus.formats import MACRO_BLOCK, fake_quantize, get_format, qsnr

KINDS = ("activation", "weight", "output")


@dataclass
class Record:
    kind: str
    tensor: str
    fmt: str
    qsnr: float
    ftz: float | None = None


@dataclass
class Report:
    records: list[Record] = field(default_factory=list)
    oas_takeup: dict[str, float] = field(default_factory=dict)  # kind -> share of blocks
    meta: dict[str, object] = field(default_factory=dict)

    def summary(self) -> list[dict[str, Any]]:
        """Mean and worst QSNR (and mean flush-to-zero) per (kind, format)."""
        groups: dict[tuple[str, str], list[Record]] = {}
        for r in self.records:
            groups.setdefault((r.kind, r.fmt), []).append(r)
        rows: list[dict[str, Any]] = []
        for (kind, fmt), rs in groups.items():
            q = [r.qsnr for r in rs if math.isfinite(r.qsnr)]
            ftz = [r.ftz for r in rs if r.ftz is not None]
            rows.append(
                {
                    "kind": kind,
                    "format": fmt,
                    "n": len(rs),
                    "mean_db": sum(q) / len(q) if q else float("nan"),
                    "worst_db": min(q) if q else float("nan"),
                    "ftz": sum(ftz) / len(ftz) if ftz else None,
                }
            )
        order = {k: i for i, k in enumerate(KINDS)}
        fmts = list(dict.fromkeys(r.fmt for r in self.records))
        rows.sort(key=lambda r: (order[r["kind"]], fmts.index(r["format"])))
        return rows

    def to_json(self) -> dict[str, object]:
        return {
            "meta": self.meta,
            "oas_takeup": self.oas_takeup,
            "summary": self.summary(),
            "records": [asdict(r) for r in self.records],
        }


def _variants(formats: Iterable[str], macro_blocks: list[int]) -> list[tuple[str, int]]:
    out = []
    for fmt in formats:
        sizes = macro_blocks if get_format(fmt).mbs else [MACRO_BLOCK]
        out += [(fmt, m) for m in sizes]
    return out


def analyse(
    weights: Iterable[tuple[str, torch.Tensor]],
    inputs: dict[str, torch.Tensor],
    formats: list[str],
    macro_blocks: list[int],
    n_weights: int | None = None,
    progress: bool = True,
) -> Report:
    """QSNR of every weight, and for layers with captured inputs (keyed by module name, i.e.
    the weight name without ".weight") of the activation and the GEMM output, per format.
    Each weight is quantized once per format and reused for its GEMM output."""
    variants = _variants(formats, macro_blocks)
    report = Report()
    takeup: dict[str, list[float]] = {"weight": [], "activation": []}
    for name, w in tqdm(
        weights, total=n_weights, desc="layers", unit="tensor", disable=not progress
    ):
        module = name[: -len(".weight")] if name.endswith(".weight") else name
        x = inputs.get(module)
        takeup["weight"].append(oas_takeup(w))
        if x is not None:
            takeup["activation"].append(oas_takeup(x))
            ref = x.double() @ w.double().T
        for fmt, mb in variants:
            label = format_label(fmt, mb)
            w_hat = fake_quantize(w, fmt, macro_block=mb)
            wf = w.float()
            report.records.append(
                Record("weight", name, label, qsnr(wf, w_hat), flush_to_zero_rate(wf, w_hat))
            )
            if x is None:
                continue
            m = tensor_metrics(x, fmt, macro_block=mb, per_row=True)
            report.records.append(Record("activation", module, label, m["qsnr"], m["ftz"]))
            x_hat = fake_quantize(x, fmt, macro_block=mb, per_row=True).double()
            report.records.append(
                Record("output", module, label, qsnr(ref, x_hat @ w_hat.double().T))
            )
    report.oas_takeup = {k: sum(v) / len(v) for k, v in takeup.items() if v}
    return report


def markdown(report: Report) -> str:
    """The summary as a markdown table, plus OAS take-up."""
    lines = [
        "| tensors | format | n | mean QSNR (dB) | worst QSNR (dB) | flush-to-zero |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in report.summary():
        ftz = f"{100 * r['ftz']:.2f}%" if r["ftz"] is not None else "–"
        lines.append(
            f"| {r['kind']} | {r['format']} | {r['n']} | {r['mean_db']:.2f} | "
            f"{r['worst_db']:.2f} | {ftz} |"
        )
    for kind, v in report.oas_takeup.items():
        lines.append(
            f"\nOAS take-up ({kind}s): {100 * v:.1f}% of non-zero 16-blocks get a "
            "different scale than masking 6/a."
        )
    return "\n".join(lines)


def plot(report: Report, path: str) -> None:
    """A grouped bar chart like the paper's Figure 6: mean QSNR per format and tensor kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report.summary()
    fmts = list(dict.fromkeys(r["format"] for r in rows))
    kinds = [k for k in KINDS if any(r["kind"] == k for r in rows)]
    width = 0.8 / max(1, len(fmts))
    fig, ax = plt.subplots(figsize=(min(12, 3 + 0.45 * len(fmts) * len(kinds)), 4.5))
    for i, fmt in enumerate(fmts):
        vals = [
            next((r["mean_db"] for r in rows if r["kind"] == k and r["format"] == fmt), 0)
            for k in kinds
        ]
        xs = [j + i * width for j in range(len(kinds))]
        bars = ax.bar(xs, vals, width, label=fmt)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks([j + width * (len(fmts) - 1) / 2 for j in range(len(kinds))], kinds)
    ax.set_ylabel("mean QSNR (dB)")
    ax.set_title(str(report.meta.get("title", "QSNR by format")))
    ax.set_ylim(0, max(r["mean_db"] for r in rows if math.isfinite(r["mean_db"])) * 1.25)
    ax.legend(fontsize=7, ncol=min(len(fmts), 4), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
