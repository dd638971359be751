"""The errors of the checkpoint package; each message is one line naming the file / tensor."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A source or quantized checkpoint cannot be read or written (CLI exit code 1)."""


class UsageError(ValueError):
    """The request itself is wrong: unknown scheme, DST exists, SRC missing (CLI exit code 2)."""
