"""The offline quantizer: a bf16/fp16/fp32 HF model dir -> the stored layout of docs/numerics.md
("Packing and checkpoint layout").

Streaming: the output headers are planned from the source headers, then each source tensor
is read, quantized (or copied byte for byte) and written before the next is read, so peak
memory is about the largest tensor plus its temporaries, not the model. The calibrated
methods (--method rtn-aware | gptq, calibration.py) are the exception: they first run the
model in transformers layer by layer and keep the quantized linears (4-bit, ~1/4 of bf16)
until they are written.

Atomic (`shard_writer.py`): everything is written into a hidden temporary directory next to
DST (config.json last) and renamed to DST at the end; a failure or Ctrl-C removes it, so no DST
that looks complete ever exists unless the run finished. A run killed outright (SIGKILL) leaves
that directory behind, hidden; the next run on the same DST removes it (`claim_dst`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Mapping, MutableMapping
from pathlib import Path
from typing import Any, cast

import torch

from vllm_mxplus.calibration.data import DEFAULT_NSAMPLES, DEFAULT_SEQLEN, calibration_tokens
from vllm_mxplus.calibration.input_amax import linear_input_amax
from vllm_mxplus.calibration.rtn_aware import METHODS, Method, calibrate_and_quantize
from vllm_mxplus.calibration.smooth_option import check_alpha
from vllm_mxplus.calibration.smoothing import input_absmax, smooth_model
from vllm_mxplus.checkpoint.codec import (
    stored_layout,
)
from vllm_mxplus.checkpoint.ct_format import (
    FORMAT_CT,
    FORMAT_MXPLUS,
    FORMATS,
    check_ct_request,
    check_ct_shape,
    ct_encode,
    ct_stored_layout,
    make_ct_quantization_config,
    nvfp4_ct_globals,
    nvfp4_ct_weights,
)
from vllm_mxplus.checkpoint.errors import CheckpointError
from vllm_mxplus.checkpoint.layer_loader import StreamedModel
from vllm_mxplus.checkpoint.layer_state import CalibrationState
from vllm_mxplus.checkpoint.layout import make_quantization_config
from vllm_mxplus.checkpoint.quantized_source import materialize, quantized_source
from vllm_mxplus.checkpoint.report import QuantizeReport, peak_rss_bytes
from vllm_mxplus.checkpoint.rules import FUSED_GROUPS, IgnoreMatcher, classify
from vllm_mxplus.checkpoint.safetensors_io import (
    PlannedTensor,
)
from vllm_mxplus.checkpoint.shard_writer import (
    Encoder,
    Item,
    check_disk_space,
    claim_dst,
    split_shards,
    swap_in,
    write_all,
    write_marker,
)
from vllm_mxplus.checkpoint.source import SourceModel, open_source, read_json
from vllm_mxplus.checkpoint.source_check import check_source
from vllm_mxplus.errors import UsageError
from vllm_mxplus.formats import MACRO_BLOCK, QuantizedTensor, check_macro_block, get_scheme

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' historical default shard size (5 GB)


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
    smooth: float | None = None,
    macro_block: int = MACRO_BLOCK,
    out_format: str = FORMAT_MXPLUS,
    resume: bool = False,
) -> QuantizeReport:
    """Quantize the HF model dir `src` into `dst` with `scheme` (any name in formats.SCHEMES).

    src may itself be quantized (compressed-tensors NVFP4/MXFP4, gpt-oss mxfp4): it is
    dequantized exactly first (quantized_source.py). out_format: "mxplus" (the plugin's
    layout) or "compressed-tensors" (nvfp4 / mxfp4-ocp only, ct_format.py).

    ignore: module-name patterns kept in high precision (rules.IgnoreMatcher).
    method: "rtn" (the spec's parameters, round to nearest), "rtn-aware" (group parameters
    chosen input-weighted on calibration text, round to nearest) or "gptq"; the calibrated
    methods read `calib` (a text file; default: the held-out embedded Wikipedia text),
    `nsamples` windows of `seqlen` tokens (calibration.py). smooth: SmoothQuant migration
    strength alpha in (0, 1), folded into the weights and norms before any method, from the
    same calibration tokens (smoothing.py); None: no smoothing. macro_block: the MBS macro
    block of both weights and activations (docs/numerics.md, Macro Block Scaling; recorded
    as quantization_config.macro_block_size, so vLLM serves it; any method, with or without
    smoothing: the calibrated methods choose the group parameters per macro block of that size
    and calibrate with activations quantized at it). Raises UsageError for a bad
    request and CheckpointError for a source or write failure.
    """
    t0 = time.perf_counter()
    try:
        s = get_scheme(scheme)
    except ValueError as e:
        raise UsageError(str(e)) from None
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
    if resume and method == "rtn":
        raise UsageError("--resume continues a calibration: it needs --method rtn-aware or gptq")
    if smooth is not None:
        check_alpha(smooth)
    if out_format not in FORMATS:
        raise UsageError(f"--format {out_format!r}: choose one of {', '.join(FORMATS)}")
    if out_format == FORMAT_CT:
        check_ct_request(s.name)
    try:
        check_macro_block(s, macro_block, "--macro-block")
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        matcher = IgnoreMatcher(list(ignore))
    except ValueError as e:  # an invalid regular expression
        raise UsageError(str(e)) from None
    cfg_path = src_p / "config.json"  # missing: open_source says so
    qsrc = quantized_source(read_json(cfg_path), cfg_path) if cfg_path.is_file() else None
    # a quantized source is dequantized into a hidden directory next to DST, read from there
    read_p = src_p
    kept: dict[str, QuantizedTensor] = {}
    tmp_src: tempfile.TemporaryDirectory[str] | None = None
    if qsrc is not None:
        # keep the source's MXFP4 codes where the target is the same format, rounded alike
        keep = qsrc.is_mxfp4 and s.name == "mxfp4-ocp" and method == "rtn" and smooth is None
        dst_p.parent.mkdir(parents=True, exist_ok=True)
        tmp_src = tempfile.TemporaryDirectory(prefix=f".{dst_p.name}.mxplus-src-", dir=dst_p.parent)
        read_p = Path(tmp_src.name)
    try:
        if qsrc is not None:
            kept = materialize(src_p, read_p, qsrc, keep_codes=keep)
        fmt = s.weight_format
        source = open_source(read_p)
        check_source(source, matcher.patterns, src_p)  # headers and config.json only
        items = _plan(source, fmt, matcher, macro_block, out_format, s.name)
        unquantized = _unquantized_modules(items, source.config)
        _warn_split_fused_groups(items)
        shards = split_shards(items, max_shard_bytes)
        check_disk_space(dst_p.parent, sum(i.out_bytes for i in items))
        precomputed: MutableMapping[str, QuantizedTensor] = dict(kept)
        rewritten: dict[str, torch.Tensor] = {}
        input_amax: dict[str, torch.Tensor] = {}
        ct_nvfp4 = out_format == FORMAT_CT and s.weight_format == "nvfp4"
        state: CalibrationState | None = None
        if method != "rtn" or smooth is not None or ct_nvfp4:
            precomputed, rewritten, input_amax, state = _calibrated_weights(
                read_p,
                source,
                src_p,
                dst_p,
                resume,
                items,
                s.name,
                method,
                calib,
                nsamples,
                seqlen,
                device,
                progress,
                smooth,
                macro_block,
                ct_nvfp4,
            )
        encoder: Encoder | None = None
        if ct_nvfp4:
            precomputed = nvfp4_ct_weights(items, rewritten, dict(precomputed))
            encoder = lambda module, q: ct_encode(q, input_amax[module])  # noqa: E731

        report = QuantizeReport(
            src=str(src_p),
            dst=str(dst_p),
            scheme=s.name,
            weight_format=fmt,
            device=device,
            unquantized_modules=unquantized,
            unused_ignore=matcher.unused(),
        )
        with claim_dst(dst_p, force) as tmp:  # locked; interrupted runs cleaned; removed on error
            write_all(
                source,
                shards,
                fmt,
                tmp,
                device,
                report,
                progress,
                precomputed,
                rewritten,
                macro_block,
                encoder,
            )
            for f in source.other_files:
                shutil.copy2(f, tmp / f.name)
            config = dict(source.config)
            if out_format == FORMAT_CT:
                config["quantization_config"] = make_ct_quantization_config(s.name, unquantized)
            else:
                config["quantization_config"] = make_quantization_config(
                    s.name, unquantized, macro_block
                )
            if out_format == FORMAT_MXPLUS and (method != "rtn" or smooth is not None):
                # provenance only; loaders ignore it
                config["quantization_config"]["calibration"] = {
                    "method": method,
                    "nsamples": nsamples,
                    "seqlen": seqlen,
                    "text": str(calib) if calib is not None else "embedded Wikipedia (held out)",
                    **({"smoothing": {"alpha": smooth}} if smooth is not None else {}),
                }
            # config.json last: a directory without it is never taken for a finished checkpoint.
            write_marker(tmp / "config.json", json.dumps(config, indent=2) + "\n")
            swap_in(tmp, dst_p)
        if state is not None:
            state.remove()  # finished: nothing left to resume
        report.seconds = time.perf_counter() - t0
        report.peak_rss = peak_rss_bytes()
        return report
    finally:
        if tmp_src is not None:
            tmp_src.cleanup()


def _calibrated_weights(
    src: Path,
    source: SourceModel,
    origin: Path,
    dst: Path,
    resume: bool,
    items: list[Item],
    scheme: str,
    method: str,
    calib: str | os.PathLike[str] | None,
    nsamples: int,
    seqlen: int,
    device: str,
    progress: bool,
    smooth: float | None,
    macro_block: int,
    ct_nvfp4: bool = False,
) -> tuple[
    MutableMapping[str, QuantizedTensor],
    dict[str, torch.Tensor],
    dict[str, torch.Tensor],
    CalibrationState | None,
]:
    """Run calibration (calibration/rtn_aware.py) for a calibrated method, after smoothing
    (`smooth`): (QuantizedTensors by module, rewritten source tensors by name, max |input| by
    module over the calibration text when ct_nvfp4, measured after smoothing and before any
    quantization, the calibration state on disk to remove once DST is written).
    ct_nvfp4 (nvfp4 written as compressed-tensors): also choose the group parameters under
    the global scales that layout stores (ct_format.nvfp4_ct_globals) instead of the
    plugin's per-weight ones.

    A calibrated method alone streams the model (layer_loader.StreamedModel: one decoder
    layer's weights in memory at a time); smoothing and ct_nvfp4's input maxima need the whole
    model at once and load it (fp32). Either way each finished layer goes to the state on
    disk (layer_state.py), which `resume` continues."""
    targets = {
        i.decision.module
        for i in items
        if i.decision.module is not None and i.decision.quantize and len(i.info.shape) == 2
    }
    tokens = calibration_tokens(src, calib, nsamples, seqlen)
    state = None
    if method != "rtn":
        fingerprint = _fingerprint(origin, source, scheme, method, tokens, targets)
        fingerprint.update(smooth=smooth, macro_block=macro_block, ct_nvfp4=ct_nvfp4)
        state = CalibrationState(dst, fingerprint, resume)

    def calibrate(model: torch.nn.Module, **extra: Any) -> Any:
        return calibrate_and_quantize(
            model,
            tokens,
            scheme,
            cast(Method, method),
            targets,
            device=device,
            progress=progress,
            macro_block=macro_block,
            **extra,
        )

    if method != "rtn" and smooth is None and not ct_nvfp4:
        streamed = StreamedModel(src, source.tensors, device, method)
        res = calibrate(streamed.model, streamed=streamed, state=state)
        _log_missed(targets, res.weights, method)
        return res.weights, {}, {}, state
    try:
        from transformers import AutoModelForCausalLM

        model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
        model.to(device)
    except Exception as e:  # transformers raises many kinds for an unloadable model
        raise UsageError(
            f"{src}: transformers cannot load it for --method {method} ({e}); use --method rtn"
        ) from None
    rewritten: dict[str, torch.Tensor] = {}
    if smooth is not None:
        dtypes = {i.info.name: i.info.torch_dtype or torch.float32 for i in items}
        changed = smooth_model(model, input_absmax(model, tokens, device), smooth, dtypes)
        params = dict(model.named_parameters())
        rewritten = {n: params[n].detach().to("cpu", dtypes[n]).clone() for n in changed}
    input_amax: dict[str, torch.Tensor] = {}
    if ct_nvfp4:
        quantized = {i.decision.module for i in items if i.decision.quantize}
        try:
            input_amax = linear_input_amax(model, tokens, device, {m for m in quantized if m})
        except ValueError as e:
            raise CheckpointError(f"{src}: {e}") from None
    if method == "rtn":
        return {}, rewritten, input_amax, None
    # of the very weights calibration quantizes: the source's, or `rewritten` (smooth_model
    # rounds the model's weights to their stored dtype)
    ct_globals = nvfp4_ct_globals(items, rewritten) if ct_nvfp4 else None
    res = calibrate(
        model,
        nvfp4_global=None if ct_globals is None else ct_globals.__getitem__,
        state=state,
    )
    del model
    _log_missed(targets, res.weights, method)
    return res.weights, rewritten, input_amax, state


def _log_missed(targets: set[str], done: Mapping[str, QuantizedTensor], method: str) -> None:
    missed = sorted(targets - set(done))
    if missed:
        logger.warning(
            "--method %s: %d weight(s) outside the decoder layers get plain RTN (e.g. %s)",
            method,
            len(missed),
            missed[0],
        )


def _fingerprint(
    origin: Path,
    source: SourceModel,
    scheme: str,
    method: str,
    tokens: torch.Tensor,
    targets: set[str],
) -> dict[str, object]:
    """What a resumed calibration must share with the run it continues: the source (its
    tensors' names, dtypes and shapes, its files' sizes and times), the request, the
    calibration tokens (text, tokenizer, nsamples, seqlen) and the quantized modules."""
    files = sorted(p for p in origin.iterdir() if p.is_file() and not p.name.startswith("."))
    src_files = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    headers = [(t.name, t.dtype, list(t.shape)) for t in source.tensors]
    return {
        "source": str(origin),
        "source_files": _digest(src_files),
        "source_tensors": _digest(headers),
        "scheme": scheme,
        "method": method,
        "tokens": hashlib.sha256(tokens.to(torch.int64).contiguous().numpy().tobytes()).hexdigest(),
        "targets": _digest(sorted(targets)),
    }


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()


def _check_paths(src: Path, dst: Path, force: bool) -> None:
    if not src.is_dir():
        raise UsageError(f"{src}: SRC is not a directory (a local Hugging Face model dir)")
    rs, rd = src.resolve(), dst.resolve()
    if rs == rd or rd in rs.parents:
        raise UsageError(f"{dst}: DST would overwrite SRC {src}")
    if dst.exists() or dst.is_symlink():  # noqa: SIM102
        if not force:
            raise UsageError(f"{dst}: DST exists; pass --force to replace it")


def _plan(
    source: SourceModel,
    fmt: str,
    matcher: IgnoreMatcher,
    macro_block: int,
    out_format: str = FORMAT_MXPLUS,
    scheme: str = "",
) -> list[Item]:
    items = []
    for t in source.tensors:
        d = classify(t.name, t.dtype, t.shape, matcher, source.model_type)
        if d.quantize:
            assert d.module is not None
            shape = d.weight_shape(t.shape)
            if out_format == FORMAT_CT:
                check_ct_shape(t.name, shape, scheme)
                layout = ct_stored_layout(scheme, shape)
            else:
                layout = stored_layout(fmt, shape, macro_block)
            outs = [
                PlannedTensor(f"{d.module}.{sfx}", dt, shp) for sfx, (dt, shp) in layout.items()
            ]
        else:
            outs = [PlannedTensor(t.name, t.dtype, t.shape)]
        items.append(Item(t, d, outs))
    names = [p.name for i in items for p in i.outputs]
    if len(names) != len(set(names)):
        dup = next(n for n in names if names.count(n) > 1)
        raise CheckpointError(f"{source.path}: output tensor {dup!r} would be written twice")
    return items


def _unquantized_modules(items: list[Item], config: dict) -> list[str]:
    mods = {i.decision.module for i in items if i.decision.module and not i.decision.quantize}
    if config.get("tie_word_embeddings"):
        mods.add("lm_head")  # tied: no lm_head tensor, but vLLM still builds the module
    return sorted(mods)


def _warn_split_fused_groups(items: list[Item]) -> None:
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
