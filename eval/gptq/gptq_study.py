"""Study: SmolLM2 perplexity per scheme x weight method (rtn, rtn-aware, gptq).

Each row quantizes SmolLM2 with `vllm_mxplus.checkpoint.quantize_checkpoint` (the code behind
`mxplus quantize --method ...`), reads the checkpoint back with `vllm_mxplus.checkpoint.load`
and computes perplexity in-process with transformers using the plugin's reference numerics
(vllm_mxplus.evaluation.reference_model, backends.reference.linear.reference_linear: the stored weight dequantized to fp32, activations
fake-quantized per token with the scheme's activation format, fp32 GEMM, bf16 model), which
is what vLLM's reference backend computes on CPU, up to GEMM accumulation order.

Text: eval/tasks/wiki_ppl.jsonl (and news_ppl.jsonl with --tasks news), the documents of the
`mxplus eval` study; each document is scored in one window after the tokenizer's BOS token
(lm-eval's loglikelihood_rolling). Word perplexity = exp(sum NLL / sum words), token
perplexity = exp(sum NLL / sum tokens). Calibration: the held-out Wikipedia text (default).

  python eval/gptq/gptq_study.py --rows mxfp4-mbs-h:gptq nvfp4:rtn ...   # append rows
  python eval/gptq/gptq_study.py --rows mxfp4-mbs-h:rtn@mbsd2 --reuse     # an activation option
  python eval/gptq/gptq_study.py --table-only                             # table + chart

A row SCHEME:METHOD@ACT serves the same weights with another activation quantizer (runtime
MBS-D, smaller macro blocks) or rotates both sides (block Hadamard): vllm_mxplus/evaluation/act_options.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import time
from pathlib import Path

import torch

from vllm_mxplus.evaluation import act_options
from vllm_mxplus.evaluation.reference_model import (
    only_folds,
    perplexity,
    quantized_model,
)

HERE = Path(__file__).resolve().parent
OUT = HERE / "results"
TASKS_DIR = HERE.parent / "tasks"
SCHEMES = ("mxfp4-ocp", "mxfp4-16-oas", "mxfp4-mbs-s", "mxfp4-mbs-h", "nvfp4")
LABELS = {
    "mxfp4-ocp": "MXFP4-OCP",
    "mxfp4-16-oas": "MXFP4-16-OAS",
    "mxfp4-mbs-s": "MBS-S",
    "mxfp4-mbs-h": "MBS-H",
    "nvfp4": "NVFP4",
    "bf16": "BF16",
}
# a method with "+sq": SmoothQuant smoothing (--smooth, alpha from --alpha) before it;
# "+sqA" (e.g. rtn+sq0.3): smoothing with alpha A; "+sq=F,F" or "+sqA=F,F" (e.g.
# rtn+sq=qkv,o): only those of the folds (FOLD_NAMES), the per-fold ablation
METHODS = ("rtn", "rtn-aware", "gptq", "rtn+sq", "rtn-aware+sq", "gptq+sq")


def _docs(task: str, n: int) -> list[str]:
    """The first n documents of the task (all 20 / 71 when n is 0)."""
    path = TASKS_DIR / f"{task}_ppl.jsonl"
    docs = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    return docs[:n] if n else docs


def run_row(row: str, args: argparse.Namespace, tok) -> dict:  # noqa: ANN001
    from vllm_mxplus.checkpoint import quantize_checkpoint
    from vllm_mxplus.formats import MACRO_BLOCK

    scheme, _, rest = row.partition(":")
    method, _, act = rest.partition("@")
    base, _, extra = method.partition("+")
    if extra and not extra.startswith("sq"):
        raise SystemExit(f"{row}: unknown method suffix {extra!r} (+sq, +sqALPHA, +sq=FOLDS)")
    extra, _, fold_list = extra.partition("=")
    folds = fold_list.split(",") if fold_list else None
    smooth = (float(extra[2:]) if len(extra) > 2 else args.alpha) if extra else None
    rotated = act_options.rotation_block(act) is not None
    if rotated and method != "rtn":
        raise SystemExit(f"{row}: @had rows rotate the source weights and quantize them RTN")
    w_macro = act_options.weight_macro_block(act)
    t0 = time.perf_counter()
    ckpt = None
    if scheme != "bf16" and not rotated:
        ckpt = Path(args.work) / (f"{scheme}-{method}" + (f"-mb{w_macro}" if w_macro else ""))
        if not (args.reuse and (ckpt / "config.json").is_file()):
            with only_folds(folds):
                quantize_checkpoint(
                    args.model,
                    ckpt,
                    scheme,
                    method=base,
                    smooth=smooth,
                    force=True,
                    nsamples=args.nsamples,
                    seqlen=args.seqlen,
                    progress=False,
                    macro_block=w_macro or MACRO_BLOCK,
                )
    t_quant = time.perf_counter() - t0
    model = quantized_model(Path(args.model), ckpt, scheme, act=act or None)
    rec = {
        "row": row,
        "scheme": scheme,
        "method": method or None,
        "act": act or None,
        "smooth": smooth,
        "folds": folds,
        "docs": args.docs,
        "nsamples": args.nsamples,
        "seqlen": args.seqlen,
        "quantize_s": round(t_quant, 1),
        "load_avg": os.getloadavg()[0],
    }
    for task in args.tasks:
        rec[task] = perplexity(model, tok, _docs(task, args.docs))
    rec["total_s"] = round(time.perf_counter() - t0, 1)
    if ckpt is not None and not (args.keep or args.reuse):
        shutil.rmtree(ckpt, ignore_errors=True)
    return rec


def _results_path(docs: int) -> Path:
    return OUT / f"results-docs{docs}.jsonl"


def _load_results(docs: int) -> dict[str, dict]:
    path = _results_path(docs)
    if not path.is_file():
        return {}
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["row"]: r for r in recs}


def write_table(command: str, docs: int) -> None:
    res = _load_results(docs)
    lines = [
        "# SmolLM2-135M: weight method x scheme (W4A4, in-process reference numerics)",
        "",
        f"- command: `{command}` (rows), then `python eval/gptq/gptq_study.py --table-only`",
        f"- machine: {_cpu_model()}, {os.cpu_count()} CPUs (shared: see the load averages), "
        f"torch {torch.__version__}",
        "- perplexity: transformers bf16 model, every decoder linear replaced by the "
        "plugin's reference numerics on the written checkpoint (not vLLM); "
        f"the first {docs or 'all'} documents of eval/tasks/wiki_ppl.jsonl",
        "",
    ]
    tasks = sorted({t for r in res.values() for t in ("wiki", "news") if t in r})
    methods = _methods(res)
    head = "| scheme | " + " | ".join(f"{m} ({t})" for t in tasks for m in methods) + " |"
    lines += [
        "Word perplexity (lower is better); BF16: "
        + ", ".join(f"{t} {res['bf16'][t]['word_ppl']:.2f}" for t in tasks if "bf16" in res),
        "",
        head,
        "|---|" + "---:|" * (len(tasks) * len(methods)),
    ]
    for s in SCHEMES:
        cells = []
        for t in tasks:
            for m in methods:
                r = res.get(f"{s}:{m}")
                cells.append(f"{r[t]['word_ppl']:.2f}" if r and t in r else "–")
        lines.append(f"| {LABELS[s]} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Token perplexity (wiki):",
        "",
        "| scheme | " + " | ".join(methods) + " |",
        "|---|" + "---:|" * len(methods),
    ]
    for s in SCHEMES:
        cells = [
            f"{res[f'{s}:{m}']['wiki']['token_ppl']:.2f}" if f"{s}:{m}" in res else "–"
            for m in methods
        ]
        lines.append(f"| {LABELS[s]} | " + " | ".join(cells) + " |")
    lines += _act_table(res)
    lines += ["", "Per row: quantize seconds / total seconds / load average at the start:", ""]
    for r in res.values():
        sq = f", smoothing alpha {r['smooth']}" if r.get("smooth") is not None else ""
        lines.append(
            f"- {r['row']}: {r['quantize_s']} s / {r['total_s']} s / load "
            f"{r['load_avg']:.1f} (calibration {r['nsamples']} x {r['seqlen']} tokens{sq})"
        )
    (OUT / f"table-docs{docs}.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    _chart(res, docs)


def _act_table(res: dict[str, dict]) -> list[str]:
    """Word perplexity (wiki) of the @ACT rows next to their method's own row."""
    acts = sorted({r["row"].partition("@")[2] for r in res.values() if "@" in r["row"]} - {"own"})
    bases = sorted(
        {r["row"].partition(":")[2].partition("@")[0] for r in res.values() if "@" in r["row"]}
    )
    if not acts:
        return []
    lines = [
        "",
        "Activation options (vllm_mxplus/evaluation/act_options.py), word perplexity (wiki); 'own' is the "
        "scheme's own activation format, from an @own row (the same code as the options) "
        "where there is one, else (marked *) the method's row above:",
        "",
        "| scheme | method | own | " + " | ".join(acts) + " |",
        "|---|---|" + "---:|" * (len(acts) + 1),
    ]
    for s in SCHEMES:
        for m in bases:
            opts = [res.get(f"{s}:{m}@{a}") for a in acts]
            own, star = res.get(f"{s}:{m}@own"), ""
            if own is None:
                own, star = res.get(f"{s}:{m}"), "*"
            if all(c is None for c in opts) and star:  # no option and no @own row
                continue
            cells = [f"{own['wiki']['word_ppl']:.2f}{star}" if own else "–"] + [
                f"{c['wiki']['word_ppl']:.2f}" if c and "wiki" in c else "–" for c in opts
            ]
            lines.append(f"| {LABELS[s]} | {m} | " + " | ".join(cells) + " |")
    return lines


def _methods(res: dict[str, dict]) -> list[str]:
    """The methods some scheme has a result for: METHODS order, then the +sqALPHA ones."""
    seen = {r["row"].partition(":")[2] for r in res.values() if ":" in r["row"]}
    seen = {m for m in seen if "@" not in m}
    return [m for m in METHODS if m in seen] + sorted(seen - set(METHODS))


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _chart(res: dict[str, dict], docs: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    # the main methods; the ablations (+sqALPHA, +sq=FOLDS) are in the table only
    methods = [m for m in _methods(res) if m in METHODS]
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        xs, ys = [], []
        for i, s in enumerate(SCHEMES):
            r = res.get(f"{s}:{m}")
            if r and "wiki" in r:
                xs.append(i + (j - (len(methods) - 1) / 2) * width)
                ys.append(r["wiki"]["word_ppl"])
        ax.bar(xs, ys, width, label=m)
    if "bf16" in res:
        ax.axhline(res["bf16"]["wiki"]["word_ppl"], color="k", ls="--", lw=1, label="BF16")
    ax.set_xticks(range(len(SCHEMES)), [LABELS[s] for s in SCHEMES])
    ax.set_ylabel("Wikipedia word perplexity (lower is better)")
    ax.set_title("SmolLM2-135M W4A4: quantization method per scheme (+sq: smoothing, alpha 0.5)")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(OUT / f"chart-docs{docs}.png", dpi=120)


def main() -> int:
    from vllm_mxplus.assets.smollm2 import smollm2_dir

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--rows",
        nargs="*",
        default=[],
        help="SCHEME:METHOD[@ACT] (methods "
        + ", ".join(METHODS)
        + "; ACT an activation option of vllm_mxplus/evaluation/act_options.py: mbsd, mbsdR, mbN, hadB) or bf16",
    )
    ap.add_argument("--alpha", type=float, default=0.5, help="smoothing strength of +sq rows")
    ap.add_argument("--model", default=str(smollm2_dir()))
    ap.add_argument("--tasks", nargs="+", default=["wiki"], choices=["wiki", "news"])
    ap.add_argument("--docs", type=int, default=0, help="first N documents only (0: all)")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--work", default="/tmp/gptq-study", help="where checkpoints are written")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument(
        "--reuse",
        action="store_true",
        help="keep the checkpoints and reuse one already in --work (rows that differ only in @ACT)",
    )
    ap.add_argument("--table-only", action="store_true")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    ns, sl = args.nsamples, args.seqlen
    if args.table_only:  # the calibration the rows were made with, not this call's defaults
        rows = [r for r in _load_results(args.docs).values() if r["scheme"] != "bf16"]
        ns, sl = (rows[0]["nsamples"], rows[0]["seqlen"]) if rows else (ns, sl)
    command = (
        f"OMP_NUM_THREADS=1 python eval/gptq/gptq_study.py --rows ... --docs {args.docs} "
        f"--nsamples {ns} --seqlen {sl}"
    )
    if not args.table_only:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        done = _load_results(args.docs)
        for row in args.rows:
            if row in done:
                print(f"{row}: done already, skipped", flush=True)
                continue
            rec = run_row(row, args, tok)
            with open(_results_path(args.docs), "a", encoding="utf-8") as fh:
                fh.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)
    write_table(command, args.docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
