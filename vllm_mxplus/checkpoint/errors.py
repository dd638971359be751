"""The errors of the checkpoint package; each message is one line naming the file / tensor.
(`vllm_mxplus.errors.UsageError`: a wrong request, shared with the calibration package.)"""

from __future__ import annotations

import errno
from pathlib import Path

NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: RLIMIT_FSIZE or FS file limit
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)


class CheckpointError(RuntimeError):
    """A source or quantized checkpoint cannot be read or written (CLI exit code 1)."""


def write_failure(path: Path, e: OSError, what: str = "write") -> CheckpointError:
    """A CheckpointError for a failed write: the file, the OS's reason and what to do."""
    if e.errno in NO_SPACE:
        hint = "free disk space (or raise the file size limit / quota) and run again"
    elif e.errno in NOT_WRITABLE:
        hint = "choose a DST in a writable directory"
    else:
        hint = "check the target file system"
    where = e.filename or path
    return CheckpointError(
        f"{where}: cannot {what} ({e.strerror or e}); nothing was written to DST, {hint}"
    )
