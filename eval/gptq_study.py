"""Study: SmolLM2 perplexity per scheme x weight method (rtn, rtn-aware, gptq).

Each row quantizes SmolLM2 with `vllm_mxplus.checkpoint.quantize_checkpoint` (the code behind
`mxplus quantize --method ...`), reads the checkpoint back with `vllm_mxplus.checkpoint.load`
and computes perplexity in-process with transformers using the plugin's reference numerics
(ops.reference.reference_linear: the stored weight dequantized to fp32, activations
fake-quantized per token with the scheme's activation format, fp32 GEMM, bf16 model), which
is what vLLM's reference backend computes on CPU, up to GEMM accumulation order.

Text: eval/tasks/wiki_ppl.jsonl (and news_ppl.jsonl with --tasks news), the documents of the
`mxplus eval` study; each document is scored in one window after the tokenizer's BOS token
(lm-eval's loglikelihood_rolling). Word perplexity = exp(sum NLL / sum words), token
perplexity = exp(sum NLL / sum tokens). Calibration: the held-out Wikipedia text (default).

  python eval/gptq_study.py --rows mxfp4-mbs-h:gptq nvfp4:rtn ...   # append rows
  python eval/gptq_study.py --rows mxfp4-mbs-h:rtn@mbsd2 --reuse     # an activation option
  python eval/gptq_study.py --table-only                             # table + chart

A row SCHEME:METHOD@ACT serves the same weights with another activation quantizer (runtime
MBS-D, smaller macro blocks) or rotates both sides (block Hadamard): eval/act_options.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import act_options  # eval/act_options.py, next to this script
import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "gptq-smollm2-135m"
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


# short names of vllm_mxplus.calibration.smoothing.FOLDS, by their first consumer
FOLD_NAMES = {
    "self_attn.q_proj": "qkv",
    "mlp.gate_proj": "gate_up",
    "mlp.down_proj": "down",
    "self_attn.o_proj": "o",
}


@contextlib.contextmanager
def _only_folds(names: list[str] | None) -> Iterator[None]:
    """Smoothing with only the named folds (None: all) while the block runs."""
    from vllm_mxplus.calibration import smoothing

    if names is None:
        yield
        return
    every = {FOLD_NAMES[f.consumers[0]]: f for f in smoothing.FOLDS}
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise SystemExit(f"unknown fold(s) {unknown}; folds: {', '.join(every)}")
    saved = smoothing.FOLDS
    smoothing.FOLDS = tuple(f for n, f in every.items() if n in names)
    try:
        yield
    finally:
        smoothing.FOLDS = saved


def _docs(task: str, n: int) -> list[str]:
    """The first n documents of the task (all 20 / 71 when n is 0)."""
    path = HERE / "tasks" / f"{task}_ppl.jsonl"
    docs = [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
    return docs[:n] if n else docs


def _quantized_model(
    src: Path,
    ckpt: Path | None,
    scheme: str | None,
    dtype: torch.dtype = torch.bfloat16,
    act: str | None = None,
) -> torch.nn.Module:
    """The bf16 model with every quantized linear on the reference numerics: weights from
    `ckpt` (or, for a hadB option, rotated and quantized RTN here), activations with the
    scheme's format or the `act` option (eval/act_options.py; for wmbN the checkpoint was
    written with --macro-block N)."""
    from transformers import AutoModelForCausalLM

    from vllm_mxplus.backends.reference.linear import reference_linear
    from vllm_mxplus.checkpoint import load
    from vllm_mxplus.formats import MACRO_BLOCK, fake_quantize, get_format, get_scheme
    from vllm_mxplus.quant_rules import stays_unquantized

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype).eval()
    if scheme is None or scheme == "bf16":
        return model
    sch = get_scheme(scheme)
    afmt = sch.activation_format
    per_row = get_format(afmt).scale_rule == "e4m3"
    mods = dict(model.named_modules())
    rot_b = act_options.rotation_block(act)
    if act:
        act_options.check_scheme(act, afmt)
    act_q = act_options.activation_quantizer(act) if act else None
    if rot_b is None:
        assert ckpt is not None
        weights = {n: q.dequantize(torch.float32) for n, q in load(ckpt).items()}
        _load_kept_tensors(model, ckpt)
        rot = {}
    else:  # rotated offline, RTN with the scheme's weight format
        names = [
            n
            for n, m in mods.items()
            if isinstance(m, torch.nn.Linear)
            and n.startswith("model.")
            and not stays_unquantized(n)
        ]
        rot = {n: act_options.block_rotation(mods[n].in_features, rot_b) for n in names}
        weights = {
            n: fake_quantize(mods[n].weight.float() @ rot[n], sch.weight_format) for n in names
        }
    for name, w in weights.items():
        lin = mods[name]
        r = rot.get(name)

        def forward(
            x: torch.Tensor,
            _w: torch.Tensor = w,
            _b=lin.bias,
            _r=r,  # noqa: ANN001
        ) -> torch.Tensor:
            if _r is not None:
                x = x.float() @ _r
            if act_q is None:
                return reference_linear(
                    x, _w, _b, afmt, per_row=per_row, out_dtype=dtype, macro_block=MACRO_BLOCK
                )
            b = None if _b is None else _b.float()
            return torch.nn.functional.linear(act_q(x), _w, b).to(dtype)

        lin.forward = forward
        lin.weight = None  # the bf16 weight is not what the served model computes with
    return model


def _load_kept_tensors(model: torch.nn.Module, ckpt: Path) -> int:
    """Copy the checkpoint's unquantized tensors (norms, embeddings, lm_head, biases) into
    `model`: with --smooth they differ from the source model's. Returns how many."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    n = 0
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118  (safe_open is not iterable)
                p = params.get(name)
                if p is not None:
                    t = fh.get_tensor(name)
                    if t.shape != p.shape:
                        raise ValueError(
                            f"{path}: {name} is {tuple(t.shape)}, model has {tuple(p.shape)}"
                        )
                    p.data.copy_(t)
                    n += 1
    if n == 0:
        raise ValueError(f"{ckpt}: no unquantized tensor matched the model's parameters")
    return n


def perplexity(model: torch.nn.Module, tok, docs: list[str]) -> dict:  # noqa: ANN001
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    nll = 0.0
    n_tok = n_words = 0
    with torch.no_grad():
        for text in docs:
            ids = [prefix] + tok(text, add_special_tokens=False)["input_ids"]
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            n_tok += len(ids) - 1
            n_words += len(text.split())
    return {
        "word_ppl": math.exp(nll / n_words),
        "token_ppl": math.exp(nll / n_tok),
        "tokens": n_tok,
        "words": n_words,
    }


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
            with _only_folds(folds):
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
    model = _quantized_model(Path(args.model), ckpt, scheme, act=act or None)
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
        f"- command: `{command}` (rows), then `python eval/gptq_study.py --table-only`",
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
        "Activation options (eval/act_options.py), word perplexity (wiki); 'own' is the "
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
        + "; ACT an activation option of eval/act_options.py: mbsd, mbsdR, mbN, hadB) or bf16",
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
        f"OMP_NUM_THREADS=1 python eval/gptq_study.py --rows ... --docs {args.docs} "
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
