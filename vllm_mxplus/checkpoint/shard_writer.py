"""Writing a planned checkpoint: shards of at most N bytes, streamed tensor by tensor into a
hidden temporary directory, then swapped in for DST (the second half of `quantizer.py`).

Each source tensor is read, quantized (or copied byte for byte) and written before the next
is read (`write_all`); `swap_in` renames the finished directory to DST, moving an existing
DST (--force) aside first, so no DST that looks complete exists unless the run finished.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vllm_mxplus.checkpoint.codec import WEIGHTS_METADATA_KEY, encode, quantize_weight
from vllm_mxplus.checkpoint.errors import CheckpointError
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
from vllm_mxplus.formats import MACRO_BLOCK, QuantizedTensor

logger = logging.getLogger(__name__)

TMP_TAG = ".mxplus-tmp-"
OLD_TAG = ".mxplus-old-"


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


def warn_stale_tmp(dst: Path) -> None:
    for p in dst.parent.glob(f".{dst.name}{TMP_TAG}*"):
        logger.warning("%s: left by an interrupted run (incomplete, safe to delete)", p)


def write_all(
    source: SourceModel,
    shards: list[Shard],
    fmt: str,
    tmp: Path,
    device: str,
    report: QuantizeReport,
    progress: bool,
    precomputed: dict[str, QuantizedTensor],
    rewritten: dict[str, torch.Tensor] | None = None,
    macro_block: int = MACRO_BLOCK,
) -> None:
    """Write every shard into tmp (MBS bytes per `macro_block` elements). `precomputed`: QuantizedTensors by module (calibrated
    methods); `rewritten`: source tensors by name that replace the file's (smoothing), in
    the source dtype: quantized like a source tensor, or written as they are."""
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
) -> float:
    w = read_tensor(it.info, f) if src is None else src  # type: ignore[arg-type]
    if done is not None:  # quantized by calibration: only its error is measured here
        x32 = w.float()
        sig = float(torch.sum(x32.square(), dtype=torch.float64))
        err = float(torch.sum((x32 - done.dequantize()).square_(), dtype=torch.float64))
        bar.update(it.info.nbytes)
        for sfx, t in encode(done).items():
            writer.write(f"{it.decision.module}.{sfx}", t)
        return math.nan if sig == 0 else (math.inf if err == 0 else 10.0 * math.log10(sig / err))
    done_bytes = 0

    def on_progress(frac: float) -> None:
        nonlocal done_bytes
        target = int(frac * it.info.nbytes)
        bar.update(target - done_bytes)
        done_bytes = target

    try:
        q, sig, err = quantize_weight(w, fmt, device, on_progress, macro_block)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(
            f"{it.info.path}: cannot quantize tensor {it.info.name!r} ({e})"
        ) from None
    del w
    module = it.decision.module
    for sfx, t in encode(q).items():
        writer.write(f"{module}.{sfx}", t)
    if sig == 0:
        return math.nan
    return math.inf if err == 0 else 10.0 * math.log10(sig / err)


def _mean_finite(v: list[float]) -> float:
    vals = [x for x in v if not math.isnan(x)]
    return sum(vals) / len(vals) if vals else math.nan


def _shard_metadata(shard: Shard, fmt: str) -> dict[str, str]:
    weights = {
        i.decision.module: {"shape": list(i.info.shape), "dtype": i.info.dtype}
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
    """Rename tmp to dst; an existing dst (--force) is moved aside first, deleted after."""
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
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()
