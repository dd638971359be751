"""Writing a planned checkpoint: shards of at most N bytes, streamed tensor by tensor into a
hidden temporary directory, then swapped in for DST (the second half of `quantizer.py`).

Each source tensor is read, quantized (or copied byte for byte) and written before the next
is read (`write_all`); `swap_in` renames the finished directory to DST, moving an existing
DST (--force) aside first, so no DST that looks complete exists unless the run finished.

Crash safety (`claim_dst`): a run holds an flock on `.DST.mxplus-lock` next to DST from
before its temporary directory exists until after the swap, so a second run on the same DST
is refused instead of racing it, and whatever a run killed without cleanup (SIGKILL, power
loss, OOM) left next to DST is recognised by the next run: `.DST.mxplus-tmp-*` (an unfinished
output: removed) and `.DST.mxplus-old-*` (the previous DST of a --force run killed between its
two renames: renamed back when DST is missing, else removed), each named in a warning. Files
and directories are fsync'ed before and after the rename. A failed write (full disk, file
size limit, read-only or unwritable target) raises CheckpointError naming the file and what to
do; the temporary directory is removed and DST and SRC are left as they were.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import logging
import math
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vllm_mxplus.checkpoint.codec import WEIGHTS_METADATA_KEY, encode, quantize_weight
from vllm_mxplus.checkpoint.errors import CheckpointError, write_failure
from vllm_mxplus.checkpoint.layout import FORMAT_VERSION
from vllm_mxplus.checkpoint.report import QuantizeReport
from vllm_mxplus.checkpoint.rules import Decision
from vllm_mxplus.checkpoint.safetensors_io import (
    PlannedTensor,
    StreamingWriter,
    TensorInfo,
    read_tensor,
)
from vllm_mxplus.checkpoint.source import INDEX_NAME, SINGLE_NAME, SourceModel
from vllm_mxplus.errors import UsageError
from vllm_mxplus.formats import MACRO_BLOCK, QuantizedTensor

logger = logging.getLogger(__name__)

# (module, QuantizedTensor) -> suffix -> the tensor stored as MODULE.SUFFIX
Encoder = Callable[[str, QuantizedTensor], dict[str, torch.Tensor]]
TMP_TAG = ".mxplus-tmp-"
OLD_TAG = ".mxplus-old-"
LOCK_TAG = ".mxplus-lock"


@dataclass
class Item:
    info: TensorInfo
    decision: Decision
    outputs: list[PlannedTensor]

    @property
    def out_bytes(self) -> int:
        return sum(p.nbytes for p in self.outputs)


@dataclass
class Shard:
    file: str
    items: list[Item] = field(default_factory=list)


def split_shards(items: list[Item], max_bytes: int) -> list[Shard]:
    groups: list[list[Item]] = [[]]
    size = 0
    for it in items:
        if groups[-1] and size + it.out_bytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(it)
        size += it.out_bytes
    n = len(groups)
    names = (
        [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    return [Shard(name, g) for name, g in zip(names, groups)]


def check_disk_space(parent: Path, need: int) -> None:
    probe = parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise CheckpointError(
            f"{probe}: {need / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free"
        )


def stale_paths(dst: Path) -> list[Path]:
    """What interrupted runs left next to dst: temporary and moved-aside directories."""
    prefix = glob.escape(f".{dst.name}")
    return sorted(
        p for tag in (TMP_TAG, OLD_TAG) for p in dst.parent.glob(f"{prefix}{glob.escape(tag)}*")
    )


def recover_stale(dst: Path) -> None:
    """Clean what interrupted runs left next to dst (call it holding dst's lock)."""
    stale = stale_paths(dst)
    olds = [p for p in stale if OLD_TAG in p.name]
    if olds and not (dst.exists() or dst.is_symlink()):
        # A --force run died between renaming DST aside and renaming its output in: the
        # moved-aside directory is the complete previous DST.
        keep = max(olds, key=lambda p: p.lstat().st_mtime)
        os.rename(keep, dst)
        _fsync_dir(dst.parent)
        stale.remove(keep)
        logger.warning(
            "%s: restored as %s (a --force run was killed while replacing it)", keep, dst
        )
    for p in stale:
        what = "an unfinished output" if TMP_TAG in p.name else "a replaced DST"
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
        logger.warning("%s: removed, %s left by an interrupted run", p, what)


@contextmanager
def claim_dst(dst: Path, force: bool) -> Iterator[Path]:
    """Lock dst, clean up after interrupted runs, and yield a new temporary directory next
    to it; the directory is removed at exit unless `swap_in` moved it to dst. An OSError
    inside becomes a CheckpointError naming the file (`write_failure`)."""
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        lock = _lock(dst)
    except OSError as e:
        raise write_failure(dst.parent, e, "create files next to DST") from None
    tmp: Path | None = None
    try:
        recover_stale(dst)
        if (dst.exists() or dst.is_symlink()) and not force:
            raise UsageError(f"{dst}: DST exists; pass --force to replace it")
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}{TMP_TAG}", dir=dst.parent))
        yield tmp
    except OSError as e:
        raise write_failure(tmp or dst.parent, e) from None
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        _unlock(dst, lock)


def _lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}{LOCK_TAG}"


def _lock(dst: Path) -> int:
    path = _lock_path(dst)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UsageError(
                f"{dst}: another mxplus quantize (pid {holder}) is writing this DST; wait for "
                "it or choose another DST"
            ) from None
        try:  # its previous holder may have unlinked the file between our open and flock
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            return fd
        os.close(fd)


def _unlock(dst: Path, fd: int) -> None:
    # unlink before unlocking, so a waiting run re-opens a fresh file (see _lock)
    with contextlib.suppress(OSError):
        os.unlink(_lock_path(dst))
    os.close(fd)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(path: Path, text: str) -> None:
    """Write the file whose presence says an output directory is finished (config.json) so
    that it never exists half-written: a sibling `.partial` file renamed over it when whole."""
    part = path.with_name(path.name + ".partial")
    part.write_text(text, encoding="utf-8")
    os.replace(part, path)


def _fsync_tree(path: Path) -> None:
    """fsync every file of a (flat) output directory and the directory itself."""
    for p in path.iterdir():
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def write_all(
    source: SourceModel,
    shards: list[Shard],
    fmt: str,
    tmp: Path,
    device: str,
    report: QuantizeReport,
    progress: bool,
    precomputed: MutableMapping[str, QuantizedTensor],
    rewritten: dict[str, torch.Tensor] | None = None,
    macro_block: int = MACRO_BLOCK,
    encoder: Encoder | None = None,
) -> None:
    """Write every shard into tmp (MBS bytes per `macro_block` elements). `precomputed`: QuantizedTensors by module (calibrated
    methods); `rewritten`: source tensors by name that replace the file's (smoothing), in
    the source dtype: quantized like a source tensor, or written as they are. `encoder`:
    (module, QuantizedTensor) -> suffix -> stored tensor (default: codec.encode, the
    plugin's layout)."""
    rewritten = dict(rewritten or {})
    total_in = sum(i.info.nbytes for s in shards for i in s.items)
    n_tensors = sum(len(s.items) for s in shards)
    qsnrs: dict[str, list[float]] = defaultdict(list)
    weight_map: dict[str, str] = {}
    done = 0
    bar = tqdm(
        total=total_in,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"quantize {fmt}",
        disable=not progress,
        dynamic_ncols=True,
    )
    handles: dict[Path, object] = {}
    try:
        for shard in shards:
            meta = _shard_metadata(shard, fmt)
            writer = StreamingWriter(
                tmp / shard.file, [p for i in shard.items for p in i.outputs], meta
            )
            try:
                for it in shard.items:
                    f = handles.get(it.info.path) or handles.setdefault(
                        it.info.path,
                        open(it.info.path, "rb"),  # noqa: SIM115
                    )
                    src = rewritten.pop(it.info.name, None)
                    if it.decision.quantize:
                        assert it.decision.module is not None  # a quantized tensor's module
                        q_db = _quantize_one(
                            it,
                            f,
                            fmt,
                            device,
                            writer,
                            bar,
                            precomputed.pop(it.decision.module, None),
                            src,
                            macro_block,
                            encoder,
                        )
                        qsnrs[fmt].append(q_db)
                        report.n_quantized += 1
                        report.weights_quantized += math.prod(it.info.shape)
                    elif src is not None:
                        writer.write(it.info.name, src)
                        bar.update(it.info.nbytes)
                        report.n_kept += 1
                    else:
                        writer.copy_from(it.info, f)  # type: ignore[arg-type]
                        bar.update(it.info.nbytes)
                        report.n_kept += 1
                    for p in it.outputs:
                        weight_map[p.name] = shard.file
                    report.bytes_in += it.info.nbytes
                    report.bytes_out += it.out_bytes
                    done += 1
                    bar.set_postfix_str(f"{done}/{n_tensors} tensors", refresh=False)
                writer.close()
            except BaseException:
                writer.abort()
                raise
    finally:
        bar.close()
        for h in handles.values():
            h.close()  # type: ignore[attr-defined]
    if rewritten:
        raise CheckpointError(
            f"rewritten tensors not in the source checkpoint: {', '.join(sorted(rewritten))}"
        )
    report.shards = len(shards)
    report.qsnr_db = {k: _mean_finite(v) for k, v in qsnrs.items()}
    if len(shards) > 1:
        index = {"metadata": {"total_size": report.bytes_out}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _quantize_one(
    it: Item,
    f: object,
    fmt: str,
    device: str,
    writer: StreamingWriter,
    bar: tqdm,
    done: QuantizedTensor | None = None,
    src: torch.Tensor | None = None,
    macro_block: int = MACRO_BLOCK,
    encoder: Encoder | None = None,
) -> float:
    encoder = encoder or _encode_mxplus
    module = it.decision.module
    assert module is not None  # a quantized tensor's module
    w = read_tensor(it.info, f) if src is None else src  # type: ignore[arg-type]
    if it.decision.transposed:  # stored [E, K, N] (gpt-oss): quantized along K, as [E, N, K]
        w = w.transpose(-1, -2).contiguous()
    if done is not None:  # quantized by calibration: only its error is measured here
        x32 = w.float()
        sig = float(torch.sum(x32.square(), dtype=torch.float64))
        err = float(torch.sum((x32 - done.dequantize()).square_(), dtype=torch.float64))
        bar.update(it.info.nbytes)
        for sfx, t in encoder(module, done).items():
            writer.write(f"{module}.{sfx}", t)
        return math.nan if sig == 0 else (math.inf if err == 0 else 10.0 * math.log10(sig / err))
    done_bytes = 0

    def on_progress(frac: float) -> None:
        nonlocal done_bytes
        target = int(frac * it.info.nbytes)
        bar.update(target - done_bytes)
        done_bytes = target

    try:
        q, sig, err = quantize_weight(w, fmt, device, on_progress, macro_block=macro_block)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"{it.info.path}: cannot quantize tensor {it.info.name!r} ({e})"
        ) from None
    del w
    for sfx, t in encoder(module, q).items():
        writer.write(f"{module}.{sfx}", t)
    if sig == 0:
        return math.nan
    return math.inf if err == 0 else 10.0 * math.log10(sig / err)


def _encode_mxplus(module: str, q: QuantizedTensor) -> dict[str, torch.Tensor]:
    return encode(q)


def _mean_finite(v: list[float]) -> float:
    vals = [x for x in v if not math.isnan(x)]
    return sum(vals) / len(vals) if vals else math.nan


def _shard_metadata(shard: Shard, fmt: str) -> dict[str, str]:
    weights = {
        i.decision.module: {
            "shape": list(i.decision.weight_shape(i.info.shape)),
            "dtype": i.info.dtype,
        }
        for i in shard.items
        if i.decision.quantize
    }
    return {
        "format": "pt",
        "producer": "vllm-mxplus",
        "mxplus_format_version": str(FORMAT_VERSION),
        "mxplus_weight_format": fmt,
        WEIGHTS_METADATA_KEY: json.dumps(weights, separators=(",", ":")),
    }


def swap_in(tmp: Path, dst: Path) -> None:
    """Rename tmp to dst; an existing dst (--force) is moved aside first, deleted after.
    Everything is on disk (fsync) before the first rename and the renames after the last."""
    _fsync_tree(tmp)
    old = None
    if dst.exists() or dst.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{dst.name}{OLD_TAG}", dir=dst.parent))
        os.rmdir(old)
        os.rename(dst, old)
    try:
        os.rename(tmp, dst)
    except OSError as e:
        if old is not None:
            os.rename(old, dst)
        raise CheckpointError(
            f"{dst}: cannot move the finished checkpoint into place ({e})"
        ) from None
    _fsync_dir(dst.parent)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
