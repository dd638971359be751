"""gpt-oss served from an `mxplus quantize` checkpoint with its experts quantized.

vLLM 0.32's gpt-oss loader (`GptOssModel.load_weights`) routes expert tensors by name for its
own formats only (bf16 stacks, its MXFP4 `_blocks`, one expert's packed codes and scales);
the plugin's other per-expert tensors (MBS macro scales, NVFP4 global scales, MX+ block-max
indices) would be dropped there. So `register_all` registers this subclass for the
architecture. It is vLLM's class unchanged except for one case: a pre-quantized vllm-mxplus
checkpoint, whose expert stacks `....mlp.experts.{gate_up_proj,down_proj}.SUFFIX` [E, N, .]
(checkpoint/rules.py: gpt-oss's [E, K, N] stacks quantized transposed) are handed to the
experts layer's own parameter loaders one expert at a time, with the shard ids vLLM's gpt-oss
experts use (`gpt_oss_w13`: gate/up interleaved along N, `gpt_oss_w2`), where
integration/fused_moe.py takes each rank's part; everything else goes to vLLM's loader.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
from vllm.model_executor.models.utils import is_pp_missing_parameter

from vllm_mxplus.checkpoint.layout import weight_suffixes
from vllm_mxplus.integration.config import MxplusConfig

EXPERT_STACK = re.compile(
    r"^(?P<layer>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)\.(?P<suffix>weight_\w+)$"
)
# checkpoint projection -> (the layer's parameter stem, vLLM's gpt-oss shard id)
SHARDS = {"gate_up_proj": ("w13", "gpt_oss_w13"), "down_proj": ("w2", "gpt_oss_w2")}


class MxplusGptOssForCausalLM(GptOssForCausalLM):
    """vLLM's gpt-oss; quantized expert stacks of a vllm-mxplus checkpoint load per expert."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        qc = self.vllm_config.quant_config
        if not (isinstance(qc, MxplusConfig) and qc.is_checkpoint_quantized):
            return super().load_weights(weights)
        suffixes = set(weight_suffixes(qc.scheme.weight_format))
        params = dict(self.named_parameters())
        ours: set[str] = set()

        def others() -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in weights:
                m = EXPERT_STACK.match(name)
                if m is None or m["suffix"] not in suffixes:
                    yield name, t
                    continue
                stem, shard = SHARDS[m["proj"]]
                candidates = [
                    f"{m['layer']}.routed_experts.{stem}_{m['suffix']}",
                    f"{m['layer']}.{stem}_{m['suffix']}",
                ]
                pname = next((c for c in candidates if c in params), None)
                if pname is None:
                    if is_pp_missing_parameter(candidates[0], self):
                        continue
                    raise ValueError(
                        f"checkpoint tensor {name}: the model has no parameter "
                        f"{candidates[0]} (are its experts kept in high precision here?)"
                    )
                if t.dim() < 2:
                    raise ValueError(
                        f"checkpoint tensor {name} has shape {list(t.shape)}, expected a "
                        "stack of experts [E, ...]"
                    )
                param = params[pname]
                load = param.weight_loader  # type: ignore[attr-defined]  # set by create_weights
                for e in range(t.shape[0]):
                    load(param, t[e], pname, shard, e, return_success=True)
                ours.add(pname)

        loaded = super().load_weights(others())
        return loaded | ours
