"""Build the local lm-eval tasks of the SmolLM2 CPU study into eval/tasks/.

* wiki_ppl / news_ppl (loglikelihood_rolling, word perplexity): one document per article of
  the embedded Wikipedia and news texts (vllm_mxplus.assets), in file order, each cut at a
  paragraph boundary to at most --doc-tokens SmolLM2 tokens, until --ppl-tokens are reached.
* bb_<task> (multiple_choice): BIG-bench 1.0.0 task.json items (the PyPI sdist), single
  correct answer, shuffled with a fixed seed so that lm-eval's --limit N takes a random
  sample. The BIG-bench canary string is kept in every record and in eval/tasks/README.md.

Usage (from the repo root):
  curl -sLO <bigbench-1.0.0.tar.gz URL from https://pypi.org/simple/bigbench/>   # or
  pip download --no-deps --no-binary :all: bigbench==1.0.0   # (fails after downloading at
                                                             # metadata; use the archive)
  python eval/tasks/build.py --bigbench bigbench-1.0.0.tar.gz
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS_DIR = HERE

# BIG-bench tasks of the study: written for BIG-bench (no third-party dataset behind them, as
# far as the task files say), >= 100 single-answer items, and SmolLM2-135M scores above
# chance on them (checked with transformers before choosing; see eval/tasks/README.md).
BIGBENCH_TASKS = ("disambiguation_qa", "hindu_knowledge", "phrase_relatedness")
SEED = 1234

# A task YAML: the local JSONL file, then the task kind's own lines.
TASK_YAML = """task: {{name}}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{file}}  # relative to this directory: `mxplus eval` runs lm-eval from here
test_split: test
{body}
metadata:
  version: 1.0
  source: "{source}"
"""
PPL_YAML = TASK_YAML.format(
    body="""output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: byte_perplexity
    aggregation: weighted_perplexity
    higher_is_better: false
  - metric: bits_per_byte
    aggregation: bits_per_byte
    higher_is_better: false""",
    source="{source}",
)
MC_YAML = TASK_YAML.format(
    body="""output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{gold}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true""",
    source="BIG-bench 1.0.0 (PyPI sdist) benchmark_tasks/{bb}/task.json, Apache-2.0",
)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def ppl_docs(text_path: Path, tokenizer, total_tokens: int, doc_tokens: int) -> list[dict]:
    from vllm_mxplus.assets import read_articles

    docs, total = [], 0
    for i, article in enumerate(read_articles(text_path)):
        kept, n = [], 0
        for para in article.split("\n"):
            if not para.strip():
                continue
            k = len(tokenizer(para + "\n").input_ids)
            if kept and n + k > doc_tokens:
                break
            kept.append(para)
            n += k
            if n >= doc_tokens:
                break
        if not kept:
            continue
        text = "\n".join(kept)
        docs.append(
            {
                "text": text,
                "article": i,
                "tokens": len(tokenizer(text).input_ids),
                "words": len(text.split()),
            }
        )
        total += docs[-1]["tokens"]
        if total >= total_tokens:
            break
    return docs


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def load_bigbench(source: Path, task: str) -> dict:
    rel = f"bigbench/benchmark_tasks/{task}/task.json"
    if source.is_dir():
        return json.loads((source / rel).read_text())
    with tarfile.open(source) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(rel))
        return json.load(tar.extractfile(member))


def mc_records(task: dict) -> list[dict]:
    prefix = task.get("task_prefix", "")
    q = task.get("example_input_prefix", "\nQ: ")
    a = task.get("example_output_prefix", "\nA: ")
    out = []
    for ex in task["examples"]:
        scores = ex.get("target_scores")
        if not scores:
            continue
        choices = list(scores)
        best = max(scores.values())
        if sum(1 for v in scores.values() if v == best) != 1:
            continue  # several correct answers: not a single-label item
        prompt = (prefix + q + ex["input"].strip() + a).strip()
        out.append(
            {
                "prompt": prompt,
                "choices": [c.strip() for c in choices],
                "gold": choices.index(next(c for c in choices if scores[c] == best)),
                "canary": task.get("canary", ""),
            }
        )
    random.Random(SEED).shuffle(out)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--bigbench",
        type=Path,
        required=True,
        help="bigbench-1.0.0.tar.gz (PyPI sdist) or its extracted directory",
    )
    ap.add_argument(
        "--ppl-tokens",
        type=int,
        default=16000,
        help="SmolLM2 tokens per perplexity set (default 16000)",
    )
    ap.add_argument(
        "--doc-tokens", type=int, default=1024, help="cap per article (default 1024 tokens)"
    )
    ap.add_argument(
        "--mc-items",
        type=int,
        default=100,
        help="items kept per multiple-choice set after the seeded shuffle (default 100; 0: all)",
    )
    ap.add_argument(
        "--tasks",
        nargs="+",
        default=list(BIGBENCH_TASKS),
        metavar="BB_TASK",
        help=f"BIG-bench tasks (default: {' '.join(BIGBENCH_TASKS)})",
    )
    ap.add_argument("--out", type=Path, default=TASKS_DIR)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from vllm_mxplus.assets import prepare_news_text, prepare_smollm2, prepare_wikipedia_text

    tok = AutoTokenizer.from_pretrained(prepare_smollm2())
    args.out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"seed": SEED, "tokenizer": "SmolLM2-135M-Instruct", "tasks": {}}
    for name, path in (("wiki_ppl", prepare_wikipedia_text()), ("news_ppl", prepare_news_text())):
        docs = ppl_docs(path, tok, args.ppl_tokens, args.doc_tokens)
        write_jsonl(args.out / f"{name}.jsonl", docs)
        (args.out / f"{name}.yaml").write_text(
            PPL_YAML.format(name=name, file=f"{name}.jsonl", source=path.name)
        )
        manifest["tasks"][name] = {
            "source": str(path.name),
            "source_sha256": sha256(path),
            "docs": len(docs),
            "tokens": sum(d["tokens"] for d in docs),
            "words": sum(d["words"] for d in docs),
        }
    manifest["bigbench"] = {
        "archive": args.bigbench.name,
        "sha256": sha256(args.bigbench) if args.bigbench.is_file() else None,
    }
    for bb in args.tasks:
        task = load_bigbench(args.bigbench, bb)
        recs = mc_records(task)
        available = len(recs)
        if args.mc_items:
            recs = recs[: args.mc_items]
        name = f"bb_{bb}"
        write_jsonl(args.out / f"{name}.jsonl", recs)
        (args.out / f"{name}.yaml").write_text(
            MC_YAML.format(name=name, file=f"{name}.jsonl", bb=bb)
        )
        n_choices = sorted({len(r["choices"]) for r in recs})
        chance = sum(1 / len(r["choices"]) for r in recs) / len(recs)
        manifest["tasks"][name] = {
            "bigbench_task": bb,
            "items": len(recs),
            "single_answer_items_available": available,
            "choices": n_choices,
            "chance_acc": round(chance, 4),
            "canary": task.get("canary", ""),
            "description": task.get("description", ""),
        }
    (args.out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
