"""The offline quantizer: a bf16/fp16/fp32 HF model dir -> the stored layout of docs/numerics.md
("Packing and checkpoint layout").

Streaming: the output headers are planned from the source headers, then each source tensor
is read, quantized (or copied byte for byte) and written before the next is read, so peak
memory is about the largest tensor plus its temporaries, not the model. The calibrated
methods (--method rtn-aware | gptq, calibration.py) are the exception: they first run the
model in transformers layer by layer and keep the quantized linears (4-bit, ~1/4 of bf16)
until they are written.

Atomic: everything is written into a hidden temporary directory next to DST (config.json
last) and renamed to DST at the end; a failure or Ctrl-C removes it, so no DST that looks
complete ever exists unless the run finished.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from vllm_mxplus.checkpoint.calib_data import DEFAULT_NSAMPLES, DEFAULT_SEQLEN, calibration_tokens
from vllm_mxplus.checkpoint.calibration import METHODS, calibrate_and_quantize
from vllm_mxplus.checkpoint.codec import (
    WEIGHTS_METADATA_KEY,
    encode,
    quantize_weight,
    stored_layout,
)
from vllm_mxplus.checkpoint.errors import CheckpointError, UsageError
from vllm_mxplus.checkpoint.layout import FORMAT_VERSION, make_quantization_config
from vllm_mxplus.checkpoint.report import QuantizeReport, peak_rss_bytes
from vllm_mxplus.checkpoint.rules import Decision, IgnoreMatcher, classify
from vllm_mxplus.checkpoint.safetensors_io import (
    PlannedTensor,
    StreamingWriter,
    TensorInfo,
    read_tensor,
)
from vllm_mxplus.checkpoint.source import INDEX_NAME, SINGLE_NAME, SourceModel, open_source
from vllm_mxplus.formats import QuantizedTensor, get_scheme

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' historical default shard size (5 GB)
TMP_TAG = ".mxplus-tmp-"
OLD_TAG = ".mxplus-old-"
# vLLM fuses these siblings into one layer, which must be all quantized or all not.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class _Item:
    info: TensorInfo
    decision: Decision
    outputs: list[PlannedTensor]

    @property
    def out_bytes(self) -> int:
        return sum(p.nbytes for p in self.outputs)


@dataclass
class _Shard:
    file: str
    items: list[_Item] = field(default_factory=list)


def default_device() -> str:
    """The fastest device available: cuda when torch sees a GPU, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def quantize_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    scheme: str = "mxfp4-mbs",
    *,
    ignore: Iterable[str] = (),
    device: str | None = None,
    force: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: bool = True,
    method: str = "rtn",
    calib: str | os.PathLike[str] | None = None,
    nsamples: int = DEFAULT_NSAMPLES,
    seqlen: int = DEFAULT_SEQLEN,
) -> QuantizeReport:
    """Quantize the HF model dir `src` into `dst` with `scheme` (any name in formats.SCHEMES).

    ignore: module-name patterns kept in high precision (rules.IgnoreMatcher).
    method: "rtn" (the spec's parameters, round to nearest), "rtn-aware" (group parameters
    chosen input-weighted on calibration text, round to nearest) or "gptq"; the calibrated
    methods read `calib` (a text file; default: the held-out embedded Wikipedia text),
    `nsamples` windows of `seqlen` tokens (calibration.py). Raises UsageError for a bad
    request and CheckpointError for a source or write failure.
    """
    t0 = time.perf_counter()
    try:
        s = get_scheme(scheme)
    except ValueError as e:
        raise UsageError(str(e)) from None
    fmt = s.weight_format
    src_p, dst_p = Path(src).absolute(), Path(dst).absolute()
    _check_paths(src_p, dst_p, force)
    device = device or default_device()
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {device!r}: not a torch device (cpu, cuda, cuda:N)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: torch sees no CUDA device")
    if max_shard_bytes <= 0:
        raise UsageError(f"max shard size must be positive, got {max_shard_bytes}")
    if method not in METHODS:
        raise UsageError(f"--method {method!r}: choose one of {', '.join(METHODS)}")
    try:
        matcher = IgnoreMatcher(list(ignore))
    except ValueError as e:  # an invalid regular expression
        raise UsageError(str(e)) from None
    source = open_source(src_p)
    items = _plan(source, fmt, matcher)
    unquantized = _unquantized_modules(items, source.config)
    _warn_split_fused_groups(items)
    shards = _split_shards(items, max_shard_bytes)
    _check_disk_space(dst_p.parent, sum(i.out_bytes for i in items))
    precomputed: dict[str, QuantizedTensor] = {}
    if method != "rtn":
        precomputed = _calibrated_weights(
            src_p, items, s.name, method, calib, nsamples, seqlen, device, progress
        )

    report = QuantizeReport(
        src=str(src_p),
        dst=str(dst_p),
        scheme=s.name,
        weight_format=fmt,
        device=device,
        unquantized_modules=unquantized,
        unused_ignore=matcher.unused(),
    )
    dst_p.parent.mkdir(parents=True, exist_ok=True)
    _warn_stale_tmp(dst_p)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst_p.name}{TMP_TAG}", dir=dst_p.parent))
    try:
        _write_all(source, shards, fmt, tmp, device, report, progress, precomputed)
        for f in source.other_files:
            shutil.copy2(f, tmp / f.name)
        config = dict(source.config)
        config["quantization_config"] = make_quantization_config(s.name, unquantized)
        if method != "rtn":  # provenance only; loaders ignore it
            config["quantization_config"]["calibration"] = {
                "method": method,
                "nsamples": nsamples,
                "seqlen": seqlen,
                "text": str(calib) if calib is not None else "embedded Wikipedia (held out)",
            }
        # config.json last: a directory without it is never taken for a finished checkpoint.
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        _swap_in(tmp, dst_p)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.seconds = time.perf_counter() - t0
    report.peak_rss = peak_rss_bytes()
    return report


def _calibrated_weights(
    src: Path,
    items: list[_Item],
    scheme: str,
    method: str,
    calib: str | os.PathLike[str] | None,
    nsamples: int,
    seqlen: int,
    device: str,
    progress: bool,
) -> dict[str, QuantizedTensor]:
    """Run calibration (calibration.py) over the source model; QuantizedTensors by module."""
    targets = {i.decision.module for i in items if i.decision.quantize and len(i.info.shape) == 2}
    tokens = calibration_tokens(src, calib, nsamples, seqlen)
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).to(device)
    except Exception as e:  # transformers raises many kinds for an unloadable model
        raise UsageError(
            f"{src}: transformers cannot load it for --method {method} ({e}); use --method rtn"
        ) from None
    res = calibrate_and_quantize(
        model,
        tokens,
        scheme,
        method,
        targets,  # type: ignore[arg-type]
        device=device,
        progress=progress,
    )
    del model
    missed = sorted(targets - set(res.weights))
    if missed:
        logger.warning(
            "--method %s: %d weight(s) outside the decoder layers get plain RTN (e.g. %s)",
            method,
            len(missed),
            missed[0],
        )
    return res.weights


def _check_paths(src: Path, dst: Path, force: bool) -> None:
    if not src.is_dir():
        raise UsageError(f"{src}: SRC is not a directory (a local Hugging Face model dir)")
    rs, rd = src.resolve(), dst.resolve()
    if rs == rd or rd in rs.parents:
        raise UsageError(f"{dst}: DST would overwrite SRC {src}")
    if dst.exists() or dst.is_symlink():  # noqa: SIM102
        if not force:
            raise UsageError(f"{dst}: DST exists; pass --force to replace it")


def _plan(source: SourceModel, fmt: str, matcher: IgnoreMatcher) -> list[_Item]:
    items = []
    for t in source.tensors:
        d = classify(t.name, t.dtype, t.shape, matcher, source.model_type)
        if d.quantize:
            assert d.module is not None
            outs = [
                PlannedTensor(f"{d.module}.{sfx}", dt, shp)
                for sfx, (dt, shp) in stored_layout(fmt, t.shape).items()
            ]
        else:
            outs = [PlannedTensor(t.name, t.dtype, t.shape)]
        items.append(_Item(t, d, outs))
    names = [p.name for i in items for p in i.outputs]
    if len(names) != len(set(names)):
        dup = next(n for n in names if names.count(n) > 1)
        raise CheckpointError(f"{source.path}: output tensor {dup!r} would be written twice")
    return items


def _unquantized_modules(items: list[_Item], config: dict) -> list[str]:
    mods = {i.decision.module for i in items if i.decision.module and not i.decision.quantize}
    if config.get("tie_word_embeddings"):
        mods.add("lm_head")  # tied: no lm_head tensor, but vLLM still builds the module
    return sorted(mods)


def _warn_split_fused_groups(items: list[_Item]) -> None:
    status = {i.decision.module: i.decision.quantize for i in items if i.decision.module}
    for mod, q in status.items():  # noqa: B007
        parent, _, leaf = mod.rpartition(".")
        for group in FUSED_GROUPS:
            if leaf != group[0]:
                continue
            states = {status.get(f"{parent}.{g}") for g in group} - {None}
            if len(states) > 1:
                logger.warning(
                    "%s.{%s}: some quantized, some kept; vLLM fuses them into one "
                    "layer, which cannot mix the two",
                    parent,
                    ",".join(group),
                )


def _split_shards(items: list[_Item], max_bytes: int) -> list[_Shard]:
    groups: list[list[_Item]] = [[]]
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
    return [_Shard(name, g) for name, g in zip(names, groups)]


def _check_disk_space(parent: Path, need: int) -> None:
    probe = parent
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise CheckpointError(
            f"{probe}: {need / 2**30:.2f} GiB needed, {free / 2**30:.2f} GiB free"
        )


def _warn_stale_tmp(dst: Path) -> None:
    for p in dst.parent.glob(f".{dst.name}{TMP_TAG}*"):
        logger.warning("%s: left by an interrupted run (incomplete, safe to delete)", p)


def _write_all(
    source: SourceModel,
    shards: list[_Shard],
    fmt: str,
    tmp: Path,
    device: str,
    report: QuantizeReport,
    progress: bool,
    precomputed: dict[str, QuantizedTensor],
) -> None:
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
                    if it.decision.quantize:
                        q_db = _quantize_one(
                            it,
                            f,
                            fmt,
                            device,
                            writer,
                            bar,
                            precomputed.pop(it.decision.module, None),
                        )
                        qsnrs[fmt].append(q_db)
                        report.n_quantized += 1
                        report.weights_quantized += math.prod(it.info.shape)
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
    report.shards = len(shards)
    report.qsnr_db = {k: _mean_finite(v) for k, v in qsnrs.items()}
    if len(shards) > 1:
        index = {"metadata": {"total_size": report.bytes_out}, "weight_map": weight_map}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _quantize_one(
    it: _Item,
    f: object,
    fmt: str,
    device: str,
    writer: StreamingWriter,
    bar: tqdm,
    done: QuantizedTensor | None = None,
) -> float:
    w = read_tensor(it.info, f)  # type: ignore[arg-type]
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
        q, sig, err = quantize_weight(w, fmt, device, on_progress)
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


def _shard_metadata(shard: _Shard, fmt: str) -> dict[str, str]:
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


def _swap_in(tmp: Path, dst: Path) -> None:
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
