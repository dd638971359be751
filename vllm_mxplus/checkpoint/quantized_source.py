"""Quantized sources for `mxplus quantize`: FP4 checkpoints dequantized exactly, then requantized.

Two layouts are read (docs/checkpoints.md, Quantized sources):
* compressed-tensors (`quant_method: compressed-tensors`, every config group in format
  `nvfp4-pack-quantized` or `mxfp4-pack-quantized`): NAME.weight_packed (E2M1 codes, low
  nibble first), NAME.weight_scale (E4M3, or E8M0 uint8 with bias 127) and, for NVFP4,
  NAME.weight_global_scale G (a divisor); w = value * (scale / G) in fp32, the library's own
  formula (`compressed_tensors.quantization.lifecycle.forward_helpers._dequantize`), kept in
  fp32 (the library then casts to bf16); MXFP4 weights are exact in bf16 and stored so.
* gpt-oss MXFP4 (`quant_method: mxfp4`): expert stacks NAME_blocks uint8 [E, N, K/32, 16]
  and NAME_scales uint8 E8M0 [E, N, K/32]; w [E, K, N] = value * 2^(scale - 127) in bf16,
  transposed as transformers' `convert_moe_packed_tensors` returns them (gpt-oss's bf16
  layout, x @ W).

`materialize` writes that dequantized model into a directory (same shard files, every
other tensor copied byte for byte, quantization_config dropped), which the quantizer then
reads like any bf16 source; `passthrough` gives the MXFP4 weights' own codes and scales, so
that an `mxfp4-ocp` target keeps them bit for bit instead of re-rounding.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_mxplus.checkpoint.errors import CheckpointError
from vllm_mxplus.checkpoint.layout import SUFFIX_GLOBAL, SUFFIX_PACKED, SUFFIX_SCALE
from vllm_mxplus.checkpoint.safetensors_io import (
    PlannedTensor,
    StreamingWriter,
    TensorInfo,
    read_header,
    read_tensor,
)
from vllm_mxplus.checkpoint.shard_writer import check_disk_space
from vllm_mxplus.checkpoint.source import INDEX_NAME, SINGLE_NAME, WEIGHT_SUFFIXES, shard_files
from vllm_mxplus.formats import QuantizedTensor, get_format
from vllm_mxplus.formats.constants import MX_BLOCK
from vllm_mxplus.formats.e2m1 import e2m1_decode, unpack_fp4
from vllm_mxplus.formats.mx import dequantize_e8m0_blocks

CT_METHOD = "compressed-tensors"
GPT_OSS_METHOD = "mxfp4"
CT_NVFP4, CT_MXFP4 = "nvfp4-pack-quantized", "mxfp4-pack-quantized"
CT_DROPPED = ("weight_global_scale", "input_global_scale", "weight_zero_point", "input_zero_point")
GPT_OSS_BLOCKS, GPT_OSS_SCALES = "_blocks", "_scales"
SKIPPED = (INDEX_NAME, "config.json")  # rewritten


@dataclass(frozen=True)
class QuantizedSource:
    """What a quantized SRC holds: `kind` CT_NVFP4, CT_MXFP4 or GPT_OSS_METHOD."""

    kind: str

    @property
    def is_mxfp4(self) -> bool:
        return self.kind != CT_NVFP4


def quantized_source(config: dict[str, Any], where: Path) -> QuantizedSource | None:
    """The quantized layout of a source config.json; None for an unquantized one. Raises
    CheckpointError for a quantization this quantizer cannot dequantize exactly."""
    qcfg = config.get("quantization_config")
    if qcfg is None:
        return None
    method = qcfg.get("quant_method", "?") if isinstance(qcfg, dict) else qcfg
    if method == GPT_OSS_METHOD:
        return QuantizedSource(GPT_OSS_METHOD)
    if method == CT_METHOD:
        assert isinstance(qcfg, dict)
        groups = qcfg.get("config_groups") or {}
        fmts = {
            (g.get("format") if isinstance(g, dict) else None) or qcfg.get("format")
            for g in groups.values()
        }
        fmt = next(iter(fmts)) if len(fmts) == 1 else None
        if fmt in (CT_NVFP4, CT_MXFP4):
            return QuantizedSource(str(fmt))
        raise CheckpointError(
            f"{where}: compressed-tensors format(s) {sorted(map(str, fmts))} cannot be read; "
            f"a quantized source must be all {CT_NVFP4} or all {CT_MXFP4} (or gpt-oss "
            "mxfp4); quantize a bf16/fp16/fp32 checkpoint"
        )
    raise CheckpointError(
        f"{where}: the model is already quantized (quant_method {method!r}); quantize a "
        "bf16/fp16/fp32 checkpoint (quantized sources: compressed-tensors NVFP4/MXFP4, "
        "gpt-oss mxfp4)"
    )


def _mx_dequant(packed: torch.Tensor, scales: torch.Tensor, k: int) -> torch.Tensor:
    """value * 2^(scale - 127) in fp32 [..., K] for E8M0 scales of MX_BLOCK elements each: the
    formats' own rule (an E8M0 code 255 is NaN), as the mxfp4-ocp passthrough reads them."""
    return dequantize_e8m0_blocks(unpack_fp4(packed, k), scales, MX_BLOCK)


def dequantize_ct(tensors: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    """One compressed-tensors module's weight [N, K] (suffix -> stored tensor): fp32 for
    NVFP4 (the library's fp32 product), bf16 for MXFP4 (exact)."""
    packed, scale = tensors[SUFFIX_PACKED], tensors[SUFFIX_SCALE]
    k = packed.shape[-1] * 2
    if kind == CT_MXFP4:
        return _mx_dequant(packed, scale, k).to(torch.bfloat16)
    vals = e2m1_decode(unpack_fp4(packed, k)).reshape(*packed.shape[:-1], -1, 16)
    # the library: scale.to(bf16) (exact for E4M3) / G (fp32 [1]) -> fp32, then value * that
    eff = scale.to(torch.bfloat16) / tensors[SUFFIX_GLOBAL].to(torch.float32)
    return (vals * eff[..., None]).reshape(packed.shape[:-1] + (k,))


def dequantize_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A gpt-oss expert stack [E, N, G, 16] + [E, N, G] -> bf16 [E, K, N] (transformers'
    `convert_moe_packed_tensors`: dequantized along K, then transposed)."""
    e, n, g, b = blocks.shape
    out = torch.empty(e, g * b * 2, n, dtype=torch.bfloat16)
    for i in range(e):  # one expert at a time: fp32 temporaries of one expert, not the stack
        w = _mx_dequant(blocks[i].reshape(n, g * b), scales[i], g * b * 2)
        out[i] = w.to(torch.bfloat16).T
    return out


@dataclass
class _Out:
    """One output tensor: its plan and the source tensors it is made of (suffix -> info)."""

    planned: PlannedTensor
    parts: dict[str, TensorInfo]
    module: str | None  # a dequantized weight's module; None: copied as is


def _plan_shard(
    infos: list[TensorInfo], by_name: dict[str, TensorInfo], src: QuantizedSource
) -> list[_Out]:
    outs: list[_Out] = []
    for t in infos:
        name = t.name
        if src.kind == GPT_OSS_METHOD:
            if (
                name.endswith(GPT_OSS_SCALES)
                and name[: -len(GPT_OSS_SCALES)] + GPT_OSS_BLOCKS in by_name
            ):
                continue
            if name.endswith(GPT_OSS_BLOCKS):
                base = name[: -len(GPT_OSS_BLOCKS)]
                sc = by_name.get(base + GPT_OSS_SCALES)
                if sc is None or len(t.shape) != 4:
                    raise CheckpointError(f"{t.path}: {name!r} has no {base + GPT_OSS_SCALES!r}")
                e, n, g, b = t.shape
                plan = PlannedTensor(base, "BF16", (e, g * b * 2, n))
                outs.append(_Out(plan, {"blocks": t, "scales": sc}, base))
                continue
        else:
            module, _, suffix = name.rpartition(".")
            if suffix in (SUFFIX_SCALE, *CT_DROPPED) and f"{module}.{SUFFIX_PACKED}" in by_name:
                continue
            if suffix == SUFFIX_PACKED:
                parts = {SUFFIX_PACKED: t}
                for sfx in (SUFFIX_SCALE, SUFFIX_GLOBAL):
                    if f"{module}.{sfx}" in by_name:
                        parts[sfx] = by_name[f"{module}.{sfx}"]
                if f"{module}.weight_zero_point" in by_name:
                    raise CheckpointError(f"{t.path}: {module!r} is asymmetric (zero point)")
                need = (SUFFIX_SCALE, SUFFIX_GLOBAL) if src.kind == CT_NVFP4 else (SUFFIX_SCALE,)
                missing = [s for s in need if s not in parts]
                if missing or len(t.shape) != 2:
                    raise CheckpointError(
                        f"{t.path}: {name!r} {list(t.shape)} lacks {module}.{missing[0] if missing else '?'} "
                        "(compressed-tensors 2-D weights need their scales)"
                    )
                dt = "F32" if src.kind == CT_NVFP4 else "BF16"
                plan = PlannedTensor(f"{module}.weight", dt, (t.shape[0], t.shape[1] * 2))
                outs.append(_Out(plan, parts, module))
                continue
        outs.append(_Out(PlannedTensor(name, t.dtype, t.shape), {"": t}, None))
    return outs


def _make(out: _Out, src: QuantizedSource) -> torch.Tensor:
    stored = {k: read_tensor(v) for k, v in out.parts.items()}
    if src.kind == GPT_OSS_METHOD:
        return dequantize_gpt_oss(stored["blocks"], stored["scales"])
    return dequantize_ct(stored, src.kind)


def materialize(
    src: Path, dst: Path, qsrc: QuantizedSource, keep_codes: bool = False
) -> dict[str, QuantizedTensor]:
    """Write SRC dequantized into the empty directory dst (see the module docstring).

    keep_codes (an MXFP4 source): also return {module: QuantizedTensor mxfp4-ocp} of every
    dequantized weight, its stored codes and scales as they are (`_passthrough`)."""
    shards = shard_files(src)
    per_shard = [read_header(s)[0] for s in shards]
    by_name = {t.name: t for infos in per_shard for t in infos}
    kept: dict[str, QuantizedTensor] = {}
    weight_map: dict[str, str] = {}
    plans = [_plan_shard(infos, by_name, qsrc) for infos in per_shard]
    check_disk_space(dst, sum(o.planned.nbytes for outs in plans for o in outs))
    for shard, outs in zip(shards, plans):
        writer = StreamingWriter(dst / shard.name, [o.planned for o in outs], {"format": "pt"})
        try:
            for o in outs:
                if o.module is None:
                    with open(o.parts[""].path, "rb") as fh:
                        writer.copy_from(o.parts[""], fh)
                else:
                    writer.write(o.planned.name, _make(o, qsrc))
                    if keep_codes:
                        kept[o.module] = _passthrough(o, qsrc)
                weight_map[o.planned.name] = shard.name
            writer.close()
        except BaseException:
            writer.abort()
            raise
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and f.name not in SKIPPED:
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    if len(shards) > 1 or shards[0].name != SINGLE_NAME:
        index = {"metadata": {}, "weight_map": weight_map}
        (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return kept


def _passthrough(o: _Out, src: QuantizedSource) -> QuantizedTensor:
    """The stored MXFP4 codes and E8M0 scales of one module as an mxfp4-ocp QuantizedTensor:
    a compressed-tensors weight [N, K], or a gpt-oss expert stack as the [E, N, K] weight the
    quantizer makes of it (checkpoint/rules.py: its experts are quantized transposed)."""
    if src.kind == GPT_OSS_METHOD:
        blocks = read_tensor(o.parts["blocks"])
        e, n, g, b = blocks.shape
        return QuantizedTensor(
            codes=blocks.reshape(e, n, g * b),
            scales=read_tensor(o.parts["scales"]),
            spec=get_format("mxfp4-ocp"),
            shape=torch.Size((e, n, g * b * 2)),
        )
    return QuantizedTensor(
        codes=read_tensor(o.parts[SUFFIX_PACKED]),
        scales=read_tensor(o.parts[SUFFIX_SCALE]),
        spec=get_format("mxfp4-ocp"),
        shape=torch.Size(o.planned.shape),
    )
