"""Errors shared by the command-line tools and the packages behind them."""

from __future__ import annotations


class UsageError(ValueError):
    """The request itself is wrong: unknown scheme, DST exists, SRC missing, a bad option value
    (CLI exit code 2). The message names the option or path at fault and what to do."""
