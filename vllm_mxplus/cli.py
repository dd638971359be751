"""The `mxplus` command: quantize | qsnr | prepare (and more as they land).

Each subcommand lives next to its code as a module with `add_parser(subparsers)` and
`run(args) -> int`; this file only wires them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Callable
from typing import Any

# command -> the module providing add_parser(subparsers) and run(args)
SUBCOMMANDS = {
    "quantize": "vllm_mxplus.checkpoint.cli_quantize",
    "qsnr": "vllm_mxplus.analysis.cli_qsnr",
    "eval": "vllm_mxplus.evaluation.cli_eval",
    "prepare": "vllm_mxplus.assets.prepare",
    "kernels": "vllm_mxplus.kernel_tools.cli",
}
PACKAGE = "vllm_mxplus"


def _import_failure(module: str, err: ImportError) -> str:
    """Why a subcommand module did not import, in one line a user can act on."""
    missing = getattr(err, "name", None)
    if isinstance(err, ModuleNotFoundError) and missing and missing.split(".")[0] != PACKAGE:
        return (
            f"needs the Python package {missing.split('.')[0]!r}, which is not installed "
            f"(pip install 'vllm-mxplus[test,eval,data]' or scripts/setup_env.sh)"
        )
    return f"{module} failed to import: {type(err).__name__}: {err} (a bug: please report it)"


def _unavailable(
    command: str, module: str, err: ImportError
) -> Callable[[argparse.Namespace], int]:
    """A stand-in `run` for a subcommand whose module failed to import: it says why, exit 1."""
    reason = _import_failure(module, err)

    def run(args: argparse.Namespace) -> int:
        if reason.endswith("(a bug: please report it)"):
            traceback.print_exception(err, file=sys.stderr)
        print(f"mxplus {command}: unavailable: {reason}", file=sys.stderr)
        return 1

    return run


class _RawDescriptionParser(argparse.ArgumentParser):
    """A subcommand's parser: its --help keeps the line breaks of its description."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mxplus",
        description="vllm-mxplus: MXFP4 with Overflow-Aware Scaling and Macro Block Scaling. "
        "Serve with `vllm serve MODEL --quantization mxfp4-mbs`; these tools quantize "
        "checkpoints offline, analyse fidelity and run the paper's evaluations.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=_RawDescriptionParser
    )
    for command, name in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(name)
        except ImportError as err:  # never silent: the command stays listed and says why
            p = sub.add_parser(
                command, help=f"(unavailable: {_import_failure(name, err)})", add_help=False
            )
            p.set_defaults(func=_unavailable(command, name, err), unavailable=True)
            continue
        before = set(sub.choices)
        module.add_parser(sub)
        for cmd in set(sub.choices) - before:
            if sub.choices[cmd].get_default("func") is None:
                sub.choices[cmd].set_defaults(func=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # an unavailable subcommand takes any arguments: it only says why it cannot run
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "unavailable", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
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
