"""vLLM parameters for pre-quantized MXFP4-MBS checkpoints (docs/numerics.md,
Packing and checkpoint layout) and their loaders.

Every 2-D tensor (weight_packed, weight_scale, weight_mbs, weight_bm_index) is a
`GroupQuantScaleParameter`/`ModelWeightParameter` with output_dim 0 and input_dim 1: fused
shards (qkv_proj, gate_up_proj) concatenate along N and TP narrows N (column-parallel) or the
K-derived dim (row-parallel) with vLLM's own v2 loaders. That narrowing is exact because a
row-parallel partition always holds whole blocks and whole macro blocks (see
`Scheme.group_size`). The nvfp4 global scale is a `PerTensorScaleParameter`: one fp32 value
per logical weight (q, k, v kept apart).

Which tensors a format stores, with their dtypes and widths, comes from the checkpoint layout's
one table (`checkpoint.layout.stored_tensors`). Our loader wraps the layer's v2 loader to check dtype and shape against the full checkpoint
tensor and to record which shards arrived, so that a missing or misshapen tensor fails at load
with its checkpoint name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from vllm.model_executor.parameter import (
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)

from vllm_mxplus.backends.base import Layer
from vllm_mxplus.checkpoint.layout import (
    SUFFIX_PACKED,
    StoredTensor,
    stored_tensors,
    weight_suffixes,
)
from vllm_mxplus.formats import MACRO_BLOCK, Scheme


class LayerQuantConfig(Protocol):
    """What the linear and MoE methods read from the model's quantization config
    (`config.MxplusConfig`): the one scheme value, the load path, vLLM's fused-module map."""

    scheme: Scheme
    is_checkpoint_quantized: bool
    packed_modules_mapping: dict[str, list[str]]


def working_tp_sizes(k_full: int, unit: int, limit: int = 64) -> list[int]:
    """tensor_parallel_size values up to `limit` that give every rank a whole number of
    `unit`-element groups of a row-parallel K (vLLM splits K evenly: K / tp per rank)."""
    return [
        tp
        for tp in range(1, limit + 1)
        if tp == 1 or (k_full % tp == 0 and (k_full // tp) % unit == 0)
    ]


def tp_hint(k_full: int, unit: int) -> str:
    """The end of a row-parallel sharding error: which tensor_parallel_size values work."""
    sizes = working_tp_sizes(k_full, unit)
    if sizes == [1]:
        return (
            f"No tensor_parallel_size above 1 gives every rank whole groups of {unit} "
            f"out of {k_full}: use tensor_parallel_size=1."
        )
    return f"tensor_parallel_size values that work: {', '.join(map(str, sizes))}."


def check_row_parallel(
    where: str, what: tuple[str, str], k_part: int, k_full: int, scheme: Scheme
) -> None:
    """Refuse a row-parallel K partition that would split a quantization group, naming the
    layer (`where`), the dimension (`what`: its per-partition and full names) and the
    tensor_parallel_size values that work."""
    unit = scheme.group_size
    if k_part != k_full and k_part % unit:
        raise ValueError(
            f"{where}: {what[0]} {k_part} ({what[1]}={k_full}) is not a multiple of {unit}; "
            f"scheme {scheme.name} needs whole {'macro ' if scheme.has_mbs else ''}"
            f"blocks on every rank. {tp_hint(k_full, unit)}"
        )


def tp_max(t: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Elementwise max of t over the TP group, in place (a no-op without TP): every shard
    then sees the whole-weight amax. At load only (an eager collective); the forward takes
    `tp_row_max`."""
    if tp_size > 1:
        from vllm.distributed import get_tp_group

        torch.distributed.all_reduce(
            t, op=torch.distributed.ReduceOp.MAX, group=get_tp_group().device_group
        )
    return t


def tp_row_max(g: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Per-row max over the TP group of per-row values g [..., 1] (NVFP4 activation global
    scales of row-parallel shards), through vLLM's all-gather, the collective its compiled
    graphs and CUDA graphs take (an eager all_reduce in the forward is neither); a max is
    exact, so every rank gets the whole row's value bit for bit. A no-op without TP."""
    if tp_size == 1:
        return g
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(g.contiguous(), dim=-1).amax(-1, keepdim=True)


def shard_names(layer: Layer, packed_mapping: dict[str, list[str]]) -> list[str]:
    """Checkpoint module names of the logical weights of a (possibly fused) layer."""
    prefix = getattr(layer, "prefix", "") or "<linear>"
    parent, _, proj = prefix.rpartition(".")
    subs = packed_mapping.get(proj)
    if subs and len(subs) == len(layer.logical_widths):
        return [f"{parent}.{s}" if parent else s for s in subs]
    return [prefix]


def _shard_index(shard_id: Any) -> int | None:
    if shard_id is None:
        return None
    if isinstance(shard_id, str):
        return {"q": 0, "k": 1, "v": 2}[shard_id]
    if isinstance(shard_id, tuple):
        return None
    return int(shard_id)


def check_stored_tensor(
    name: str, loaded: torch.Tensor, tspec: StoredTensor, k_full: int, ndims: tuple[int, ...]
) -> None:
    """The loader check of one checkpoint tensor, linears and MoE experts alike: its dtype,
    the K-derived width of a per-column tensor (a stacked expert tensor [E, N, cols] too), and
    one value for a global scale; `ndims`: the dims a per-column tensor may have (a linear's
    [N, cols]; an expert's also [E, N, cols]). ValueError naming the tensor otherwise."""
    if loaded.dtype != tspec.dtype:
        raise ValueError(
            f"checkpoint tensor {name} has dtype {loaded.dtype}, expected {tspec.dtype}"
        )
    if tspec.k_per_col:
        want = tspec.cols(k_full)
        if loaded.dim() not in ndims or loaded.shape[-1] != want:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, expected "
                f"[N, {want}] (K={k_full}, {tspec.k_per_col} elements per column)"
            )
    elif loaded.numel() != 1:
        raise ValueError(
            f"checkpoint tensor {name} has shape {tuple(loaded.shape)}, expected one "
            "fp32 value per logical weight"
        )


def _make_loader(
    layer: Layer, tspec: StoredTensor, inner: Callable, names: list[str], k_full: int
) -> Callable:
    """Wrap the layer's v2 loader: check dtype and the K-derived width, record the shard."""

    def loader(param: torch.nn.Parameter, loaded: torch.Tensor, *args, **kwargs) -> Any:
        shard_id = args[0] if args else kwargs.get("loaded_shard_id")
        idx = _shard_index(shard_id)
        name = f"{names[idx] if idx is not None and idx < len(names) else names[0]}.{tspec.suffix}"
        check_stored_tensor(name, loaded, tspec, k_full, (2,))
        try:
            out = inner(param, loaded, *args, **kwargs)
        except (AssertionError, RuntimeError) as e:
            raise ValueError(
                f"checkpoint tensor {name} of shape {tuple(loaded.shape)} does not fit "
                f"parameter {getattr(layer, 'prefix', '')}.{tspec.suffix} of shape "
                f"{tuple(param.shape)}: {e}"
            ) from None
        layer.mxplus_loaded.setdefault(tspec.suffix, set()).add(idx)
        return out

    return loader


def create_quantized_params(
    layer: Layer,
    weight_format: str,
    n_per_partition: list[int],
    k_per_partition: int,
    k_full: int,
    weight_loader: Callable,
    packed_mapping: dict[str, list[str]],
    macro_block: int,
) -> None:
    """Register the checkpoint tensors of one quantized linear as vLLM v2 parameters."""
    names = shard_names(layer, packed_mapping)
    layer.mxplus_loaded = {}
    n = sum(n_per_partition)
    for tspec in stored_tensors(weight_format, macro_block):
        loader = _make_loader(layer, tspec, weight_loader, names, k_full)
        param: PerTensorScaleParameter | ModelWeightParameter | GroupQuantScaleParameter
        if tspec.k_per_col == 0:
            param = PerTensorScaleParameter(
                data=torch.zeros(len(n_per_partition), dtype=tspec.dtype), weight_loader=loader
            )
        else:
            packed = tspec.suffix == SUFFIX_PACKED
            cls = ModelWeightParameter if packed else GroupQuantScaleParameter
            data = torch.zeros(n, tspec.cols(k_per_partition), dtype=tspec.dtype)
            param = cls(data=data, input_dim=1, output_dim=0, weight_loader=loader)
        layer.register_parameter(tspec.suffix, param)


def check_all_loaded(
    layer: Layer, weight_format: str, packed_mapping: dict[str, list[str]]
) -> None:
    """Raise ValueError naming the first checkpoint tensor that never arrived."""
    names = shard_names(layer, packed_mapping)
    n_logical = len(layer.logical_widths)
    for tspec in stored_tensors(weight_format, MACRO_BLOCK):  # suffixes only
        got = layer.mxplus_loaded.get(tspec.suffix, set())
        if None in got:
            continue  # fused on disk: one tensor carried every shard
        for i in range(n_logical):
            if i not in got:
                shard = names[i] if len(names) == n_logical else names[0]
                raise ValueError(
                    f"checkpoint tensor {shard}.{tspec.suffix} is missing "
                    f"(format {weight_format} stores {', '.join(weight_suffixes(weight_format))})"
                )
