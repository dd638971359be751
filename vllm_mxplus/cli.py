"""The `mxplus` command: quantize | qsnr | prepare (and more as they land).

Each subcommand lives next to its code as a module with `add_parser(subparsers)` and
`run(args) -> int`; this file only wires them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# modules providing add_parser/run; one whose optional dependencies are missing is skipped
SUBCOMMANDS = [
    "vllm_mxplus.checkpoint.cli_quantize",
    "vllm_mxplus.analysis.cli_qsnr",
    "vllm_mxplus.evaluation.cli_eval",
    "vllm_mxplus.assets.prepare",
    "vllm_mxplus.ops.cli_kernels",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxplus",
        description="vllm-mxplus: MXFP4 with Overflow-Aware Scaling and Macro Block Scaling. "
        "Serve with `vllm serve MODEL --quantization mxfp4-mbs`; these tools quantize "
        "checkpoints offline, analyse fidelity and run the paper's evaluations.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(name)
        except ImportError:  # a subcommand whose optional dependencies are missing
            continue
        before = set(sub.choices)
        module.add_parser(sub)
        for cmd in set(sub.choices) - before:
            if sub.choices[cmd].get_default("func") is None:
                sub.choices[cmd].set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("mxplus: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
