"""`mxplus qsnr`: Figure 6 / Appendix A of the paper as a tool."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from vllm_mxplus.analysis import report as rep
from vllm_mxplus.analysis import sources
from vllm_mxplus.assets import default_cache_dir
from vllm_mxplus.calibration.smooth_option import add_smooth_option, check_alpha
from vllm_mxplus.errors import UsageError
from vllm_mxplus.formats import check_format_macro_block, get_format
from vllm_mxplus.formats.constants import MACRO_BLOCK

DEFAULT_FORMATS = ["mxfp4-ocp", "mxplus", "mxfp4-16-oas", "mxfp4-mbs-s", "mxfp4-mbs-d", "nvfp4"]

HELP = """QSNR per format (paper eq. 1 and 2) of (a) every linear weight of a local safetensors
model, (b) the inputs of every linear layer captured while the model (transformers, CPU) reads
a text file, and (c) the GEMM outputs. Prints a markdown table (mean and worst per format and
tensor kind), the OAS take-up and the flush-to-zero rate; writes JSON and a PNG bar chart
like the paper's Figure 6 on request. Without MODEL it runs on synthetic tensors."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "qsnr",
        help="QSNR of weights, activations and GEMM outputs per format",
        description=HELP,
    )
    p.add_argument(
        "model",
        nargs="?",
        type=Path,
        help="local HF model dir with safetensors (default: synthetic tensors)",
    )
    p.add_argument(
        "--text",
        type=Path,
        help="text file whose tokens drive the activation capture "
        "(default: the embedded Wikipedia text if prepared)",
    )
    p.add_argument(
        "--formats",
        nargs="+",
        default=DEFAULT_FORMATS,
        metavar="FMT",
        help=f"formats to compare (default: {' '.join(DEFAULT_FORMATS)})",
    )
    p.add_argument(
        "--macro-block",
        nargs="+",
        type=int,
        default=[MACRO_BLOCK],
        metavar="N",
        help="MBS macro-block sizes, a multiple of 16, e.g. 32 64 128 256 512 for the "
        "Appendix A ablation (default: 128)",
    )
    p.add_argument("--tokens", type=int, default=256, help="tokens of text to run (default: 256)")
    p.add_argument(
        "--max-rows", type=int, default=256, help="activation rows kept per layer (default: 256)"
    )
    p.add_argument("--weights-only", action="store_true", help="skip activations and outputs")
    add_smooth_option(
        p,
        "measure the model smoothed as `mxplus quantize --smooth ALPHA` would store it "
        "(statistics from the same tokens; Llama-like models): compare a run with and "
        "without to see the effect per tensor",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="write all per-tensor numbers as JSON")
    p.add_argument("--plot", type=Path, metavar="PNG", help="write a Figure-6-style bar chart")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def _validate(args: argparse.Namespace) -> None:
    fmts = [get_format(f) for f in args.formats]
    for m in args.macro_block:
        for fmt in fmts:
            if fmt.mbs:
                check_format_macro_block(fmt, m, "--macro-block")
    if args.model is not None and not (args.model / "config.json").is_file():
        raise ValueError(f"{args.model}: not a model dir (no config.json)")
    if args.text is not None and not args.text.is_file():
        raise ValueError(f"--text {args.text}: no such file")
    if args.smooth is not None and (args.model is None or args.weights_only):
        raise ValueError("--smooth needs a MODEL and its activations (not --weights-only)")
    if args.smooth is not None:
        try:
            check_alpha(args.smooth)
        except UsageError as e:
            raise ValueError(str(e)) from None


def _default_text() -> Path | None:
    path = default_cache_dir() / "text" / "wikipedia.txt"
    return path if path.is_file() else None


def run(args: argparse.Namespace) -> int:
    try:
        _validate(args)
    except ValueError as e:
        print(f"mxplus qsnr: error: {e}", file=sys.stderr)
        return 2
    t0 = time.time()
    progress = not args.no_progress
    weights: Iterable[tuple[str, torch.Tensor]]
    if args.model is None:
        synthetic, pairs = sources.synthetic_tensors()
        weights, n_weights, title = synthetic, len(synthetic), "synthetic tensors"
    else:
        weights = sources.checkpoint_linear_weights(args.model)
        n_weights, title = sources.count_linear_weights(args.model), args.model.name
        pairs = {}
        if not args.weights_only:
            text_path = args.text or _default_text()
            if text_path is None:
                print(
                    "mxplus qsnr: error: no --text given and the embedded text is not prepared "
                    "(run `mxplus prepare --what text`)",
                    file=sys.stderr,
                )
                return 2
            pairs, smoothed = sources.capture_linear_inputs(
                args.model, text_path.read_text(), args.tokens, args.max_rows, args.smooth
            )
            if args.smooth is not None:
                original = dict(weights)
                weights = [(n, smoothed.get(n, w)) for n, w in original.items()]
                title = f"{title}, smoothed (alpha {args.smooth})"
    if args.weights_only:
        pairs = {}
    report = rep.analyse(weights, pairs, args.formats, args.macro_block, n_weights, progress)
    report.meta = {
        "title": f"QSNR by format: {title}",
        "model": str(args.model or "synthetic"),
        "text": str(args.text or (_default_text() if args.model else "")),
        "tokens": args.tokens,
        "macro_blocks": args.macro_block,
        "smooth": args.smooth,
        "seconds": round(time.time() - t0, 1),
    }
    print(rep.markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
        print(f"wrote {args.json}")
    if args.plot:
        rep.plot(report, str(args.plot))
        print(f"wrote {args.plot}")
    return 0
