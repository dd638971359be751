"""The vLLM FusedMoE method: every expert's w13 / w2 in the scheme's weight format (paper §5.1).

vLLM 0.32 interface (`FusedMoEMethodBase`, non-monolithic): `RoutedExperts.__init__` calls
`create_weights(layer, num_experts=local experts, hidden_size, intermediate_size_per_partition,
params_dtype, weight_loader=layer.weight_loader, ...)`; the checkpoint's per-expert tensors
`...experts.{e}.{gate,up,down}_proj.SUFFIX` reach `layer.weight_loader(param, t, weight_name,
shard_id in w1/w3/w2, expert_id)` via the expert mapping (`experts.w13_SUFFIX`,
`experts.w2_SUFFIX`); the MoERunner routes (vLLM's own top-k, renormalization and scaling
factor) and calls `apply(layer, x, topk_weights, topk_ids, ...)`; it runs shared experts and
the TP all-reduce itself (`moe_kernel` is None: the output is not reduced here).

Two load paths, as for linears (linear.py):
- online: `w13_weight` [E, 2I, H] / `w2_weight` [E, H, I] in the model dtype, quantized per
  expert after loading (gate, up and down are separate logical weights: nvfp4 takes one
  global scale each, reduced over TP ranks).
- pre-quantized: `w13_weight_packed`, `w13_weight_scale`, ... with a leading expert dim; the
  uint8 / e4m3 tensors load through vLLM's own MoE loader (N-sharded for w13, K-sharded for
  w2), the nvfp4 global scales as per-tensor scales [E, 2] / [E].
Execution: the expert backend comes from a per-platform priority list
(`backends/selection.py`: the `cpu-packed` C++ kernels on the CPU, the grouped Triton GEMM on
CUDA, else the fp32 reference), given the layer's expert activation and whether it has expert
biases (`ExpertSpec.activation`, `has_bias`), since not every backend implements all of them.

Activations: the gated ones on w13's halves (silu, gelu, gelu_tanh) and gpt-oss's swigluoai
(gate / up interleaved along w13's rows, clamped; alpha and limit from the layer's
swiglu_alpha / swiglu_limit, else vLLM's defaults). Expert biases (gpt-oss: w13_bias [E, 2I]
N-sharded, w2_bias [E, H] on TP rank 0 only, both loaded by vLLM) stay in the model dtype
and are added in fp32 after each expert GEMM. Other activations are refused at load, naming
the layer and how to keep its experts unquantized (`ignore` in the quantization options).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import (
    FusedMoEMethodBase,
)
from vllm.model_executor.layers.fused_moe.routed_experts import (
    FusedMoeWeightScaleSupported,
)
from vllm.model_executor.utils import set_weight_attrs

from vllm_mxplus.backends import (
    ExpertBackend,
    ExpertWeights,
    current_platform_of,
    pick,
    select,
)
from vllm_mxplus.backends.base import Activation, ExpertSpec
from vllm_mxplus.backends.expert_layer import (
    EXPERT_ACTIVATIONS,
    expert_activation,
)
from vllm_mxplus.backends.reference.linear import nvfp4_row_global_scale
from vllm_mxplus.checkpoint.layout import (
    SUFFIX_GLOBAL,
    StoredTensor,
    quantized_from_stored,
    stored_tensors,
    weight_suffixes,
)
from vllm_mxplus.formats import QuantizedTensor, logical_amax, quantize, quantize_nvfp4_logical
from vllm_mxplus.integration.params import (
    Layer,
    LayerQuantConfig,
    check_row_parallel,
    check_stored_tensor,
    tp_max,
    tp_row_max,
)

# vLLM's MoE shard ids -> the checkpoint's projection names
SHARD_PROJS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# gpt-oss's whole-expert shard ids (integration/gpt_oss_model.py) -> its projection names
GPT_OSS_SHARDS = {"gpt_oss_w13": "gate_up_proj", "gpt_oss_w2": "down_proj"}
ALL_SHARD_PROJS = {**SHARD_PROJS, **GPT_OSS_SHARDS}


class MxplusFusedMoEMethod(FusedMoEMethodBase):
    """W4A4 routed experts of one vllm-mxplus scheme (reference execution)."""

    def __init__(self, quant_config: LayerQuantConfig, moe: Any):
        super().__init__(moe)
        self.quant_config = quant_config
        self.scheme = quant_config.scheme  # with its macro block
        self.fmt = self.scheme.weight_format
        self.act_fn: Activation | None = None  # create_weights: from the layer

    # -- weights ---------------------------------------------------------------------------

    def create_weights(
        self,
        layer: Layer,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs,
    ) -> None:
        # Refused at load, naming the layer: never wrong numbers.
        act = self.moe.activation.value
        self.act_fn = expert_activation(
            act, getattr(layer, "swiglu_alpha", None), getattr(layer, "swiglu_limit", None)
        )
        if self.act_fn is None:
            raise NotImplementedError(
                f"{layer.layer_name}: vllm-mxplus MoE does not support the expert activation "
                f"{act!r} (supported: {', '.join(EXPERT_ACTIVATIONS)}); "
                f"{self._keep_experts_hint()}"
            )
        if getattr(layer, "apply_router_weight_on_input", False):
            raise NotImplementedError(
                f"{layer.layer_name}: vllm-mxplus MoE does not support "
                f"apply_router_weight_on_input; {self._keep_experts_hint()}"
            )
        i_part = intermediate_size_per_partition
        i_full = self.moe.intermediate_size
        # the down projection is K-sharded
        check_row_parallel(
            layer.layer_name,
            ("expert intermediate size per TP partition", "moe_intermediate_size"),
            i_part,
            i_full,
            self.scheme,
        )
        layer.mxplus_dims = {
            "w13": (2 * i_part, hidden_size, hidden_size),
            "w2": (hidden_size, i_part, i_full),
        }
        layer.orig_dtype = params_dtype
        if self.moe.has_bias:  # as vLLM's unquantized method: loaded by the model's loader
            for stem, width in (("w13", 2 * i_part), ("w2", hidden_size)):
                b = torch.nn.Parameter(
                    torch.zeros(num_experts, width, dtype=params_dtype), requires_grad=False
                )
                layer.register_parameter(f"{stem}_bias", b)
                set_weight_attrs(b, extra_weight_attrs)
        loader = extra_weight_attrs["weight_loader"]
        if not self.quant_config.is_checkpoint_quantized:
            for stem, (n, k, _) in layer.mxplus_dims.items():
                p = torch.nn.Parameter(
                    torch.empty(num_experts, n, k, dtype=params_dtype), requires_grad=False
                )
                layer.register_parameter(f"{stem}_weight", p)
                set_weight_attrs(p, extra_weight_attrs)
            return
        layer.mxplus_loaded = {}
        for stem, (n, k, k_full) in layer.mxplus_dims.items():
            for tspec in stored_tensors(self.fmt, self.scheme.macro_block):
                if tspec.k_per_col == 0:  # nvfp4: one fp32 global scale per logical weight
                    shape = (num_experts, 2) if stem == "w13" else (num_experts,)
                    data = torch.zeros(shape, dtype=tspec.dtype)
                    method = FusedMoeWeightScaleSupported.TENSOR.value
                else:
                    data = torch.zeros(num_experts, n, tspec.cols(k), dtype=tspec.dtype)
                    method = FusedMoeWeightScaleSupported.GROUP.value
                p = torch.nn.Parameter(data, requires_grad=False)
                layer.register_parameter(f"{stem}_{tspec.suffix}", p)
                set_weight_attrs(
                    p,
                    {
                        **extra_weight_attrs,
                        "quant_method": method,
                        "weight_loader": self._checked_loader(layer, stem, tspec, k_full, loader),
                    },
                )

    def _keep_experts_hint(self) -> str:
        """How to serve the model anyway: the online option `ignore` (integration/config.py)."""
        options = {"quant_method": self.scheme.name, "ignore": ["re:.*experts.*"]}
        return (
            "serve this model without --quantization, or keep its experts unquantized: "
            f"--hf-overrides '{json.dumps({'quantization_config': options})}'"
        )

    @property
    def _w13_logical_weights(self) -> int:
        """Logical weights in each expert's w13: gate and up apart (2), or one interleaved
        gate_up tensor (gpt-oss, an activation that takes the whole row): one NVFP4 global
        scale each."""
        return 1 if getattr(self.act_fn, "takes_gate_up", False) else 2

    def _checked_loader(
        self, layer: Layer, stem: str, tspec: StoredTensor, k_full: int, inner: Callable
    ) -> Callable:
        """vLLM's MoE loader, after checking dtype and K-derived width; records arrivals."""

        def loader(
            param, loaded_weight, weight_name, shard_id, expert_id, return_success: bool = False
        ):
            proj = ALL_SHARD_PROJS.get(shard_id, shard_id)
            name = f"{layer.layer_name}.{expert_id}.{proj}.{tspec.suffix}"
            check_stored_tensor(name, loaded_weight, tspec, k_full, (2, 3))
            if shard_id in GPT_OSS_SHARDS:
                ok = self._load_gpt_oss_expert(
                    layer, param, loaded_weight, name, stem, tspec, expert_id
                )
                arrived = ("w1", "w3") if stem == "w13" else ("w2",)  # w13: gate and up at once
            else:
                ok = inner(
                    param, loaded_weight, weight_name, shard_id, expert_id, return_success=True
                )
                arrived = (shard_id,)
            if ok:
                got = layer.mxplus_loaded.setdefault(f"{stem}_{tspec.suffix}", set())
                got.update((expert_id, sh) for sh in arrived)
            return ok if return_success else None

        return loader

    @staticmethod
    def _load_gpt_oss_expert(
        layer: Layer,
        param: torch.Tensor,
        t: torch.Tensor,
        name: str,
        stem: str,
        tspec: StoredTensor,
        expert_id: int,
    ) -> bool:
        """One expert's whole tensor (integration/gpt_oss_model.py): w13 [2I, .] with gate and
        up interleaved along its rows (each rank keeps its contiguous rows, as vLLM's gpt-oss
        loader does), w2 [H, .] K-sharded (each rank keeps its columns), an NVFP4 global scale
        [1] for the expert's whole gate_up / down."""
        local = layer._map_global_expert_id_to_local_expert_id(expert_id)
        if local == -1:  # another rank's expert (expert parallelism)
            return False
        dst = param.data[local]
        if not tspec.k_per_col:
            dst.fill_(t.reshape(()).item())  # w13 holds it per shard [2]: one logical weight
            return True
        tp_rank, tp_size = layer.moe_config.moe_parallel_config.tp_rank, layer.moe_config.tp_size
        rows = dst.shape[0] * (tp_size if stem == "w13" else 1)
        if t.dim() != 2 or t.shape[0] != rows:
            raise ValueError(
                f"checkpoint tensor {name} has shape {list(t.shape)}, expected [{rows}, .]"
            )
        if stem == "w13":
            t = t.narrow(0, tp_rank * dst.shape[0], dst.shape[0])
        else:
            t = t.narrow(1, tp_rank * dst.shape[1], dst.shape[1])
        dst.copy_(t)
        return True

    def _check_all_loaded(self, layer: Layer) -> None:
        n_local = self.moe.num_local_experts
        for stem, shards in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            for tspec in stored_tensors(self.fmt, self.scheme.macro_block):
                got = layer.mxplus_loaded.get(f"{stem}_{tspec.suffix}", set())
                per_shard = {sh: {e for e, s in got if s == sh} for sh in shards}
                for sh, experts in per_shard.items():
                    if len(experts) < n_local:
                        proj = SHARD_PROJS[sh]
                        raise ValueError(
                            f"{layer.layer_name}: checkpoint tensors *.{proj}.{tspec.suffix} "
                            f"arrived for {len(experts)} of {n_local} local experts "
                            f"(format {self.fmt} stores "
                            f"{', '.join(weight_suffixes(self.fmt))})"
                        )

    def _loaded_rows(self, layer: Layer, stem: str) -> tuple[QuantizedTensor, int]:
        """All local experts at once: every tensor is per row, so [E, N, .] -> [E*N, .]."""
        n, k, _ = layer.mxplus_dims[stem]
        packed = getattr(layer, f"{stem}_weight_packed").data
        e = packed.shape[0]

        def rows(suffix: str) -> torch.Tensor:
            t = getattr(layer, f"{stem}_{suffix}").data
            return t.reshape(e * n, t.shape[-1])

        g = None
        if self.scheme.weight.has_global_scale:
            per_shard = getattr(layer, f"{stem}_{SUFFIX_GLOBAL}").data.reshape(e, -1)
            g = (
                per_shard.to(torch.float32)
                .repeat_interleave(n // per_shard.shape[1], dim=1)
                .reshape(e * n, 1)
            )
        stored = {sfx: rows(sfx) for sfx in weight_suffixes(self.fmt) if sfx != SUFFIX_GLOBAL}
        q = quantized_from_stored(
            stored, self.scheme.weight, (e * n, k), self.scheme.macro_block, g, layer.layer_name
        )
        return q, e

    def _quantized_rows(self, layer: Layer, stem: str) -> tuple[QuantizedTensor, int]:
        """Online: all experts' rows (w1 and w3 apart or not) quantize in one call exactly as
        separate weights. NVFP4: each logical weight (w1, w3, w2 of one expert) has its own
        global scale from its whole (unsharded) amax, given per row."""
        w = getattr(layer, f"{stem}_weight").data
        e, n, k = w.shape
        if not self.scheme.weight.has_global_scale:
            return quantize(w.reshape(e * n, k), self.fmt, macro_block=self.scheme.macro_block), e
        n_shards = self._w13_logical_weights if stem == "w13" else 1
        parts = w.reshape(e, n_shards, n // n_shards, k).to(torch.float32)
        amax = tp_max(logical_amax(parts).contiguous(), layer.moe_config.tp_size)
        widths = [n // n_shards] * (e * n_shards)
        return quantize_nvfp4_logical(w.reshape(e * n, k), amax.reshape(-1), widths), e

    def _dequantize_loaded(self, layer: Layer, stem: str) -> torch.Tensor:
        q, e = self._loaded_rows(layer, stem)
        return q.dequantize(torch.float32).reshape(e, *layer.mxplus_dims[stem][:2])

    def _quantize_loaded(self, layer: Layer, stem: str) -> torch.Tensor:
        e, n, k = getattr(layer, f"{stem}_weight").shape
        q, _ = self._quantized_rows(layer, stem)
        return q.dequantize(torch.float32).reshape(e, n, k)

    def process_weights_after_loading(self, layer: Layer) -> None:
        pre = self.quant_config.is_checkpoint_quantized
        if pre:
            self._check_all_loaded(layer)
        device = next(iter(layer.parameters())).device
        spec = ExpertSpec(
            self.scheme,
            device_type=device.type,
            activation=self.moe.activation.value,
            has_bias=self.moe.has_bias,
        )
        weights = ExpertWeights(
            quantized=lambda stem: (self._loaded_rows if pre else self._quantized_rows)(
                layer, stem
            ),
            dequantized=lambda stem: (self._dequantize_loaded if pre else self._quantize_loaded)(
                layer, stem
            ),
        )
        platform, capability = current_platform_of(device)
        layer.mxplus_row_global_scale = self._row_global_scale(layer)
        self.backends: list[ExpertBackend] = select(spec, platform, capability, layer.layer_name)
        for backend in self.backends:
            backend.process_weights_after_loading(layer, weights)
        for name in [
            n for n in list(layer._parameters) if n.startswith(("w13_weight", "w2_weight"))
        ]:
            delattr(layer, name)

    def get_fused_moe_quant_config(self, layer: Layer) -> None:
        return None  # no modular kernel: apply() computes the experts itself

    # -- execution -------------------------------------------------------------------------

    def apply(
        self,
        layer: Layer,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any | None = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Shared experts (if any) run in the MoERunner (moe_kernel is None: NO_OVERLAP order).
        backend = pick(self.backends, x.shape[0])
        assert isinstance(backend, ExpertBackend) and self.act_fn is not None  # create_weights
        return backend.apply(layer, x, topk_weights, topk_ids, self.act_fn)

    def _row_global_scale(self, layer: Layer) -> Callable | None:
        """NVFP4 under TP: the down projection's input rows are sharded, so their per-row global
        scales must come from the whole rows (the max over ranks): h [R, I_part] -> g [R, 1].
        None otherwise (each row's own scale). The expert backends read it from the layer."""
        tp = layer.moe_config.tp_size
        if not (self.scheme.activations_per_row and tp > 1):
            return None

        def row_g(h: torch.Tensor) -> torch.Tensor:
            return tp_row_max(nvfp4_row_global_scale(h), tp)

        return row_g
