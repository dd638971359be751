"""Log a message once per process and key: backend choices, fallbacks, platform notes.

One registry for the whole package, so a situation logged by the linear selector, the MoE
experts or the platform setup is never repeated per layer."""

from __future__ import annotations

import logging
from collections.abc import Hashable

_SEEN: set[Hashable] = set()


def log_once(
    logger: logging.Logger,
    key: Hashable,
    level: int,
    msg: str,
    *args: object,
    seen: set[Hashable] | None = None,
) -> bool:
    """Log `msg % args` at `level` the first time `key` is seen; True when it was logged.
    seen: the set of keys to consult (default: the package's one registry)."""
    seen = _SEEN if seen is None else seen
    if key in seen:
        return False
    seen.add(key)
    logger.log(level, msg, *args)
    return True
