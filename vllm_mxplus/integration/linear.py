"""The vLLM LinearMethod: create weights, quantize or assemble them once, apply via ops.

Two load paths:
- bf16/fp16 checkpoint + `--quantization NAME`: a plain `weight` parameter is loaded, then
  quantized with the scheme's weight format on the device it lives on (MBS-D for mxfp4-mbs).
  NVFP4 takes one global scale per logical weight (q, k, v apart), reduced over TP ranks.
- pre-quantized checkpoint (quant_method in config.json): the packed codes and scales are
  loaded as they are (params.py) and never re-quantized.
Either way the result is one `QuantizedTensor` per layer, handed to the selected backends
(`vllm_mxplus.backends.selection`); the checkpoint-format parameters are then released.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.parameter import ModelWeightParameter

from vllm_mxplus.backends import LinearDispatch, LinearSpec, current_platform_of, select
from vllm_mxplus.backends.base import Layer
from vllm_mxplus.backends.reference.linear import nvfp4_row_global_scale
from vllm_mxplus.checkpoint.layout import (
    ALL_SUFFIXES,
    SUFFIX_GLOBAL,
    quantized_from_stored,
    weight_suffixes,
)
from vllm_mxplus.formats import QuantizedTensor, logical_amax, quantize, quantize_nvfp4_logical
from vllm_mxplus.integration.mla import (
    apply_weight_only,
    install_dequantized_weight,
    is_weight_only,
    warn_cpu_rotary,
    weight_read_by_attention,
)
from vllm_mxplus.integration.params import (
    LayerQuantConfig,
    check_all_loaded,
    check_row_parallel,
    create_quantized_params,
    tp_max,
    tp_row_max,
)


def quantize_nvfp4_fused(w: torch.Tensor, widths: list[int], tp_size: int) -> QuantizedTensor:
    """NVFP4 of a fused weight with one global scale per logical weight (q, k, v apart), each
    from its whole amax over the TP ranks (`formats.quantize_nvfp4_logical`)."""
    parts = torch.split(w.to(torch.float32), widths, dim=0)
    amax = tp_max(torch.stack([logical_amax(p) for p in parts]), tp_size)
    return quantize_nvfp4_logical(w, amax, widths)


STORED_FUSED_ATTR = "mxplus_stored_fused"


def recording_stored_tensors(layer: Layer, weight_loader: Callable) -> Callable:
    """The layer's weight loader, noting whether the checkpoint stored a fused layer as ONE
    tensor (vLLM loads it with no shard id: Phi-3's qkv_proj / gate_up_proj) or its parts apart
    (a shard id each: Llama's q/k/v)."""

    def load(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args, **kwargs):
        shard = args[0] if args else kwargs.get("loaded_shard_id")
        if shard is None and len(layer.logical_widths) > 1:
            setattr(layer, STORED_FUSED_ATTR, True)
        return weight_loader(param, loaded_weight, *args, **kwargs)

    return load


def stored_widths(layer: Layer) -> list[int]:
    """The rows of each weight as the checkpoint stores it: NVFP4 takes one global scale per
    stored weight (docs/numerics.md, NVFP4), as `mxplus quantize` does offline."""
    if getattr(layer, STORED_FUSED_ATTR, False):
        return [sum(layer.logical_widths)]
    return list(layer.logical_widths)


@register_weight_loader_v2_supported_method
class MxplusLinearMethod(LinearMethodBase):
    """W4A4 linear of one vllm-mxplus scheme (weights and activations in block FP4)."""

    def __init__(self, quant_config: LayerQuantConfig):
        self.quant_config = quant_config
        self.scheme = quant_config.scheme  # with its macro block

    def create_weights(
        self,
        layer: Layer,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        s = self.scheme
        check_row_parallel(
            getattr(layer, "prefix", "linear"),
            ("row-parallel K per partition", "K"),
            input_size_per_partition,
            input_size,
            s,
        )
        weight_loader = extra_weight_attrs["weight_loader"]  # vLLM always passes it
        layer.logical_widths = list(output_partition_sizes)
        layer.input_size_per_partition = input_size_per_partition
        layer.output_size_per_partition = sum(output_partition_sizes)
        layer.orig_dtype = params_dtype
        if self.quant_config.is_checkpoint_quantized:
            create_quantized_params(
                layer,
                s.weight_format,
                list(output_partition_sizes),
                input_size_per_partition,
                input_size,
                weight_loader,
                self.quant_config.packed_modules_mapping,
                s.macro_block,
            )
        else:
            weight = ModelWeightParameter(
                data=torch.empty(
                    sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype
                ),
                input_dim=1,
                output_dim=0,
                weight_loader=recording_stored_tensors(layer, weight_loader),
            )
            layer.register_parameter("weight", weight)

    @staticmethod
    def _where(layer: Layer) -> str:
        """The layer's name in messages: its vLLM prefix."""
        return getattr(layer, "prefix", "") or "linear"

    def _loaded_qweight(self, layer: Layer) -> QuantizedTensor:
        fmt = self.scheme.weight_format
        check_all_loaded(layer, fmt, self.quant_config.packed_modules_mapping)
        n, k = layer.output_size_per_partition, layer.input_size_per_partition
        g = None
        if self.scheme.weight.has_global_scale:
            per_shard = layer.weight_global_scale.data.to(torch.float32)
            g = torch.repeat_interleave(
                per_shard, torch.tensor(layer.logical_widths, device=per_shard.device)
            )[:, None]
        stored = {
            sfx: getattr(layer, sfx).data for sfx in weight_suffixes(fmt) if sfx != SUFFIX_GLOBAL
        }
        return quantized_from_stored(
            stored, self.scheme.weight, (n, k), self.scheme.macro_block, g, self._where(layer)
        )

    def _quantize_loaded(self, layer: Layer) -> QuantizedTensor:
        w = layer.weight.data
        fmt = self.scheme.weight_format
        if self.scheme.weight.has_global_scale:
            return quantize_nvfp4_fused(w, stored_widths(layer), getattr(layer, "tp_size", 1))
        # Every other format is per row: fused shards quantize exactly as separate weights.
        return quantize(w, fmt, macro_block=self.scheme.macro_block)

    def process_weights_after_loading(self, layer: Layer) -> None:
        if self.quant_config.is_checkpoint_quantized:
            qweight = self._loaded_qweight(layer)
            device = layer.weight_packed.device
        else:
            qweight = self._quantize_loaded(layer)
            device = layer.weight.device
        if weight_read_by_attention(layer):  # MLA kv_b_proj: weight-only (integration/mla.py)
            install_dequantized_weight(layer, qweight)
            warn_cpu_rotary(device.type)
            return
        spec = LinearSpec(
            self.scheme,
            n=layer.output_size_per_partition,
            k=layer.input_size_per_partition,
            out_dtype=layer.orig_dtype,
            device_type=device.type,
        )
        platform, capability = current_platform_of(device)
        layer.mxplus_dispatch = LinearDispatch(
            spec, select(spec, platform, capability, self._where(layer))
        )
        layer.mxplus_row_amax_reduce = (
            spec.activation_per_row
            and getattr(layer, "tp_size", 1) > 1
            and layer.input_size_per_partition != getattr(layer, "input_size", spec.k)
        )
        layer.mxplus_dispatch.process_weights_after_loading(layer, qweight)
        for name in ("weight", *ALL_SUFFIXES):
            if name in layer._parameters:
                delattr(layer, name)

    def apply(
        self,
        layer: Layer,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if is_weight_only(layer):
            return apply_weight_only(layer, x, bias)
        g = None
        if layer.mxplus_row_amax_reduce:
            # NVFP4 activations on a row-parallel shard: the per-token global scale must come
            # from the whole row (all ranks), as without TP (docs/numerics.md, NVFP4).
            g = tp_row_max(nvfp4_row_global_scale(x), getattr(layer, "tp_size", 1))
        return layer.mxplus_dispatch.apply(layer, x, bias, g)
