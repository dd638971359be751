"""`mxplus quantize SRC DST --scheme NAME`: the offline quantizer's command line."""

from __future__ import annotations

import argparse
import logging
import re
import signal
import sys
from typing import Any

from vllm_mxplus.calibration.data import DEFAULT_NSAMPLES, DEFAULT_SEQLEN
from vllm_mxplus.calibration.rtn_aware import METHODS
from vllm_mxplus.calibration.smooth_option import add_smooth_option
from vllm_mxplus.checkpoint.ct_format import FORMAT_MXPLUS, FORMATS
from vllm_mxplus.checkpoint.errors import CheckpointError
from vllm_mxplus.checkpoint.quantizer import DEFAULT_MAX_SHARD_BYTES, quantize_checkpoint
from vllm_mxplus.errors import UsageError
from vllm_mxplus.formats import MACRO_BLOCK, SCHEMES

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}

DESCRIPTION = """\
Quantize a local Hugging Face model directory (safetensors, single file or sharded; bf16/fp16/
fp32, or FP4-quantized, see below) into the vllm-mxplus checkpoint layout: packed FP4 weights,
E8M0 (or E4M3) block scales, MBS bytes, and a quantization_config in config.json that vLLM
detects with no flag; or, with --format compressed-tensors, into the layout other tools read
(docs/checkpoints.md).

Linear weights (attention, MLP, MoE experts) are quantized with the scheme's weight format;
lm_head, embeddings and MoE routers stay in their original dtype, as do modules matched by
--ignore. Tokenizer and other non-weight files are copied. The run streams tensor by tensor
(memory ~ the largest tensor) and writes into a temporary directory renamed to DST at the end.

Methods (--method): `rtn` (default) rounds to nearest with the parameters the format's
specification picks (docs/numerics.md). `rtn-aware` and `gptq` first run the model in
transformers (fp32) layer by layer on calibration text, each layer seeing the outputs of the
already-quantized earlier layers with activations quantized as served: `rtn-aware` chooses
every group parameter (E8M0 / E4M3 block scales, the MBS-D byte) to minimise the error
weighted by E[x^2] of the layer's inputs, still rounding to nearest; `gptq` also corrects
each column's rounding error on the columns not yet quantized (GPTQ, 1% damping, natural
order). Both write the same checkpoint layout, served by vLLM unchanged; they need a
transformers-loadable decoder (Llama-like) and take minutes on a small model on CPU.
Measured on SmolLM2 served by vLLM (eval/calibrated-grid/): use
`rtn-aware` for the MBS schemes' MBS-D weights (mxfp4-mbs-h / mxfp4-mbs) and `gptq` for the
others.

Formats (--format): `mxplus` (default) writes the plugin's layout, for every scheme;
`compressed-tensors` writes nvfp4 / mxfp4-ocp in the layout of llm-compressor
(quant_method compressed-tensors, nvfp4-pack-quantized / mxfp4-pack-quantized), which vLLM
serves with its in-tree method and transformers reads; its decompressed weights equal the
plugin's dequantized ones bit for bit (nvfp4: power-of-two global scale per fused layer, under
which rtn-aware / gptq choose their block scales; static activation scale from the calibration
text, --calib or the embedded default); every --method and --smooth. The
paper's formats (mxplus, mxfp4-16-oas, MBS) exist only in the plugin's layout.

Quantized sources: SRC may be a compressed-tensors NVFP4 / MXFP4 checkpoint or a gpt-oss
MXFP4 one (quant_method mxfp4, *_blocks / *_scales experts). It is dequantized exactly and
requantized to --scheme; an mxfp4-ocp target keeps an MXFP4 source's codes and scales bit
for bit (--method rtn, no --smooth).

Smoothing (--smooth ALPHA, with any method): per input channel of each group of linears a
factor moves quantization difficulty from the activations to the weights (SmoothQuant),
folded exactly into the operation before them (the norms, up_proj rows, v_proj rows), so the
model computes the same function; only its stored tensors change.
"""

EPILOG = """\
examples:
  mxplus quantize ./SmolLM2-135M ./SmolLM2-135M-mbs --scheme mxfp4-mbs
  mxplus quantize ./llama ./llama-nvfp4 --scheme nvfp4 --ignore 're:layers\\.0\\.' --force
  mxplus quantize ./SmolLM2-135M ./SmolLM2-135M-mbs-gptq --scheme mxfp4-mbs --method gptq
  mxplus quantize ./llama ./llama-aware --method rtn-aware --calib my_text.txt --nsamples 64
  mxplus quantize ./SmolLM2-135M ./SmolLM2-135M-mbs-sq --scheme mxfp4-mbs --smooth 0.5
  mxplus quantize ./llama ./llama-nvfp4-ct --scheme nvfp4 --format compressed-tensors
  mxplus quantize ./llama-nvfp4-ct ./llama-mbs --scheme mxfp4-mbs   # a quantized SRC
"""


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '123' -> bytes (argparse type)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (e.g. 5GB, 500MiB)")
    n = float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()]
    if n < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return int(n)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add the `quantize` subcommand to an argparse subparsers object."""
    p = subparsers.add_parser(
        "quantize",
        help="quantize a Hugging Face checkpoint offline",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("src", metavar="SRC", help="local Hugging Face model directory (safetensors)")
    p.add_argument("dst", metavar="DST", help="output directory (must not exist unless --force)")
    p.add_argument(
        "--scheme",
        default="mxfp4-mbs",
        choices=list(SCHEMES),
        metavar="NAME",
        help="quantization scheme: " + ", ".join(SCHEMES) + " (default: %(default)s)",
    )
    p.add_argument(
        "--ignore",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep modules matching PATTERN in high precision (repeatable): an "
        "fnmatch glob on the module name or a dotted suffix of it "
        "(e.g. 'down_proj', 'model.layers.0.*'), or 're:REGEX' (re.search)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="device that quantizes: cpu, cuda, cuda:N (default: cuda if available, else cpu)",
    )
    p.add_argument("--force", action="store_true", help="replace DST if it exists")
    p.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=DEFAULT_MAX_SHARD_BYTES,
        metavar="SIZE",
        help="largest output shard, e.g. 5GB, 500MiB (default: 5GB)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--format",
        default=FORMAT_MXPLUS,
        choices=list(FORMATS),
        help="checkpoint layout: mxplus (the plugin's, every scheme, detected by vllm-mxplus) or "
        "compressed-tensors (nvfp4 and mxfp4-ocp only: the layout llm-compressor writes, "
        "served by vLLM's in-tree compressed-tensors method and read by transformers; nvfp4 "
        "measures its static activation scale on the calibration text, see --calib) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--method",
        default="rtn",
        choices=list(METHODS),
        help="rtn: the specification's parameters, round to nearest; rtn-aware: "
        "group parameters chosen input-weighted on calibration text; gptq: "
        "GPTQ error compensation with those parameters (default: %(default)s)",
    )
    p.add_argument(
        "--calib",
        default=None,
        metavar="FILE",
        help="calibration text (UTF-8) for rtn-aware / gptq / --smooth / the static activation "
        "scale of --scheme nvfp4 --format compressed-tensors (default: the embedded "
        "Wikipedia text, held out from the evaluation text; needs mxplus prepare)",
    )
    p.add_argument(
        "--nsamples",
        type=int,
        default=DEFAULT_NSAMPLES,
        metavar="N",
        help="calibration windows (default: %(default)s)",
    )
    p.add_argument(
        "--seqlen",
        type=int,
        default=DEFAULT_SEQLEN,
        metavar="T",
        help="tokens per calibration window (default: %(default)s)",
    )
    add_smooth_option(
        p,
        "SmoothQuant-style smoothing folded into the weights and norms before "
        "quantizing (any --method): per input channel s = max|x|^ALPHA / max|w|^(1-ALPHA) "
        "from the calibration text; ALPHA in (0, 1), 0.5 to 0.7 measured best on SmolLM2. Llama-like "
        "models (llama, mistral, qwen2, qwen3); no serving change (default: off)",
    )
    p.add_argument(
        "--macro-block",
        type=int,
        default=MACRO_BLOCK,
        metavar="N",
        help="MBS schemes: one MBS byte per N elements of weights and activations, N a "
        "multiple of 16 (16, 32, 64, 128). Smaller N: finer scales, lower error, 8/N bits "
        "per element for the bytes (128: 0.0625, 32: 0.25); recorded in the checkpoint, "
        "served by vLLM as is; the CPU kernels take any N, the GPU (Triton) kernels powers of "
        "two 16-2048 (prefill at 128: CUTLASS; N not a power of two: the reference path). "
        "Every --method, with or without --smooth: rtn-aware and gptq choose the MBS byte per N elements and calibrate with "
        "activations quantized at N (default: %(default)s, the paper's)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="rtn-aware / gptq: continue an interrupted run of the same command after its last "
        "finished decoder layer (the state kept in .DST.mxplus-calib next to DST; a run "
        "without --resume discards it; a different request is refused)",
    )
    p.set_defaults(func=run)


class _Terminated(BaseException):
    """SIGTERM; a BaseException like KeyboardInterrupt, so no `except Exception` on the
    way (torch, tqdm, the safetensors check) can swallow it."""


def _on_sigterm(signum: int, frame: object) -> None:
    raise _Terminated()


# quantize_checkpoint keyword -> the argparse dest it takes its value from
_OPTION_DESTS = {
    "ignore": "ignore",
    "device": "device",
    "force": "force",
    "max_shard_bytes": "max_shard_size",
    "method": "method",
    "calib": "calib",
    "nsamples": "nsamples",
    "seqlen": "seqlen",
    "smooth": "smooth",
    "macro_block": "macro_block",
    "out_format": "format",
    "resume": "resume",
}


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """quantize_checkpoint's keyword arguments from the parsed command line."""
    return {kw: getattr(args, dest) for kw, dest in _OPTION_DESTS.items()} | {
        "progress": not args.no_progress
    }


def run(args: argparse.Namespace) -> int:
    """Run `quantize` for parsed args; print a summary; return the exit code."""
    logging.basicConfig(level=logging.WARNING, format="mxplus quantize: warning: %(message)s")
    try:  # SIGTERM unwinds like Ctrl-C, so the temp dir is removed (main thread only)
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:
        previous = None
    try:
        report = quantize_checkpoint(args.src, args.dst, args.scheme, **_options(args))
    except UsageError as e:
        print(f"mxplus quantize: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointError, OSError) as e:
        print(f"mxplus quantize: error: {e}", file=sys.stderr)
        return EXIT_FAILURE
    except (KeyboardInterrupt, _Terminated):
        print(f"mxplus quantize: interrupted; {args.dst} was not written", file=sys.stderr)
        return 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(report.summary())
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m vllm_mxplus.checkpoint.cli_quantize ...`)."""
    parser = argparse.ArgumentParser(prog="mxplus")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["quantize", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
