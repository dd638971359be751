"""Paired comparisons of rows (formats) on the same benchmark items.

`mxplus eval` keeps lm-eval's per-item metric values when a config sets
``lm_eval: {log_samples: true}`` (under ``mxplus.items`` of each raw results JSON). Every row
scores the same documents, so two rows can be compared item by item, which removes the
between-item variance that dominates a 50-item accuracy's standard error:

* :func:`paired_bootstrap`: the difference of the *average over tasks* (the paper's "Avg"
  column) between two rows, resampling items with replacement within each task (the same
  resampled items for both rows), B times with a fixed seed; a percentile 95 % interval and a
  two-sided p-value (twice the smaller tail of the resampled differences around 0).
* :func:`mcnemar`: per task, the exact two-sided McNemar test on the discordant items (one row
  right, the other wrong); p = binomial tail of min(b, c) out of b + c at 1/2.
* :func:`holm`: Holm's step-down adjustment of a family of p-values (one family per reference
  row), so that "real" (adjusted p < 0.05) holds for the family as a whole.

LAMBADA's perplexity is lm-eval's ``exp(-mean loglikelihood of the target word)``; its paired
difference is bootstrapped the same way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class RowItems:
    """One row's per-item values: task -> metric -> array over the task's doc ids (sorted)."""

    row: str
    doc_ids: dict[str, list[int]]
    doc_hashes: dict[str, list[str | None]]
    values: dict[str, dict[str, np.ndarray]]
    files: list[str]
    sources: list[dict]


def load_row_items(raw_dir: Path, limit: float | None = None) -> RowItems | None:
    """Merge the per-item values of every results JSON under raw_dir (one row's folder).

    Only files saved with `limit` (when given) count; a task present in several files takes
    the newest. None if no file holds per-item values.
    """
    doc_ids: dict[str, list[int]] = {}
    hashes: dict[str, list[str | None]] = {}
    values: dict[str, dict[str, np.ndarray]] = {}
    files, sources = [], []
    found = []
    for f in sorted(raw_dir.glob("*.json")):
        data = json.loads(f.read_text())
        mx = data.get("mxplus", {})
        if limit is not None and mx.get("limit") is not None and float(mx["limit"]) != limit:
            continue
        if mx.get("items"):
            found.append((float(data.get("date", 0.0)), f, data))
    for _, f, data in sorted(found, key=lambda t: t[0]):
        mx = data["mxplus"]
        files.append(str(f))
        sources.append(mx.get("source", {}))
        for task, entry in mx["items"].items():
            doc_ids[task] = list(entry["doc_id"])
            hashes[task] = list(entry.get("doc_hash", [None] * len(entry["doc_id"])))
            values[task] = {
                k: np.asarray(v, dtype=np.float64)
                for k, v in entry.items()
                if k not in ("doc_id", "doc_hash")
            }
    if not values:
        return None
    return RowItems(raw_dir.name, doc_ids, hashes, values, files, sources)


def check_same_items(rows: Sequence[RowItems], tasks: Sequence[str]) -> None:
    """Every row scored the same documents (ids and content hashes) for each task."""
    ref = rows[0]
    for r in rows[1:]:
        for t in tasks:
            if r.doc_ids[t] != ref.doc_ids[t]:
                raise ValueError(f"{t}: rows {ref.row} and {r.row} scored different documents")
            if None not in r.doc_hashes[t] and r.doc_hashes[t] != ref.doc_hashes[t]:
                raise ValueError(f"{t}: rows {ref.row} and {r.row} have different document text")


def perplexity(ll: np.ndarray) -> float:
    """lm-eval's ``perplexity`` aggregation of per-item loglikelihoods."""
    return math.exp(-float(np.mean(ll)))


@dataclass
class Paired:
    diff: float  # row - reference (average accuracy in points, or perplexity)
    lo: float  # 95 % percentile interval
    hi: float
    p: float  # two-sided bootstrap p-value
    p_adj: float | None = None  # Holm-adjusted within its family


def _bootstrap_indices(sizes: Sequence[int], iters: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n, size=(iters, n)) for n in sizes]


def _summary(observed: float, draws: np.ndarray) -> Paired:
    lo, hi = np.percentile(draws, [2.5, 97.5])
    below = float(np.mean(draws <= 0.0))
    above = float(np.mean(draws >= 0.0))
    p = min(1.0, 2.0 * min(below, above))
    return Paired(observed, float(lo), float(hi), p)


def paired_bootstrap(
    a: Sequence[np.ndarray], b: Sequence[np.ndarray], iters: int = 10000, seed: int = 0
) -> Paired:
    """Average over tasks of mean(a_t) - mean(b_t), in the units of the values (0/1 items:
    multiply by 100 for points); a[t] and b[t] are aligned per item."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b, strict=True)):
        raise ValueError("paired_bootstrap: a and b must hold aligned items per task")
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    observed = float(np.mean([d.mean() for d in diffs]))
    idx = _bootstrap_indices([len(d) for d in diffs], iters, seed)
    draws = np.mean([d[i].mean(axis=1) for d, i in zip(diffs, idx, strict=True)], axis=0)
    return _summary(observed, draws)


def paired_bootstrap_ppl(
    ll_a: np.ndarray, ll_b: np.ndarray, iters: int = 10000, seed: int = 0
) -> Paired:
    """perplexity(ll_a) - perplexity(ll_b) on the same items, bootstrapped."""
    if ll_a.shape != ll_b.shape:
        raise ValueError("paired_bootstrap_ppl: unaligned items")
    observed = perplexity(ll_a) - perplexity(ll_b)
    (idx,) = _bootstrap_indices([len(ll_a)], iters, seed)
    draws = np.exp(-ll_a[idx].mean(axis=1)) - np.exp(-ll_b[idx].mean(axis=1))
    return _summary(observed, draws)


def mcnemar(a: np.ndarray, b: np.ndarray) -> tuple[int, int, float]:
    """(items only a got right, items only b got right, exact two-sided p)."""
    ra, rb = a > 0.5, b > 0.5
    only_a = int(np.sum(ra & ~rb))
    only_b = int(np.sum(rb & ~ra))
    n = only_a + only_b
    if n == 0:
        return only_a, only_b, 1.0
    k = min(only_a, only_b)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return only_a, only_b, min(1.0, 2.0 * tail)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm step-down adjusted p-values, in the input order."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def mean_se(x: np.ndarray) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n), as lm-eval)."""
    n = len(x)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
