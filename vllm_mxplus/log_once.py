"""Log a message once per process and key: backend choices, fallbacks, platform notes.

One registry for the whole package, so a situation logged by the linear selector, the MoE
experts or the platform setup is never repeated per layer."""

from __future__ import annotations

import logging
from collections.abc import Hashable

_SEEN: set[Hashable] = set()


def log_once(logger: logging.Logger, key: Hashable, level: int, msg: str, *args: object) -> bool:
    """Log `msg % args` at `level` the first time `key` is seen; True when it was logged."""
    if key in _SEEN:
        return False
    _SEEN.add(key)
    logger.log(level, msg, *args)
    return True
