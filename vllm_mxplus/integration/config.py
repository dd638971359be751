"""vLLM QuantizationConfig: one registered class per scheme (the vLLM name = the scheme name).

How vLLM 0.32 reaches us:
- `--quantization NAME` on a bf16/fp16 checkpoint: `get_config_filenames()` is empty, so
  vLLM calls `cls()` -> online mode, weights quantized after loading.
- a checkpoint whose config.json has `quantization_config.quant_method == NAME`: vLLM picks
  NAME with no flag and calls `cls.from_config(that dict)` -> pre-quantized mode.
- online mode with options: vLLM users pass a quantization method's options as a
  `quantization_config` through `--hf-overrides` (vLLM reads it as the model's own), e.g.
  `--hf-overrides '{"quantization_config": {"quant_method": "mxfp4-mbs",
  "macro_block_size": 64}}'`. A dict without our `producer` entry is such an options dict
  (`ONLINE_OPTIONS`): `from_config` takes it as online mode with those options.
  `"ignore": [PATTERN, ...]` keeps the matching layers unquantized, with the patterns and the
  matcher of `mxplus quantize --ignore` (`checkpoint.rules.IgnoreMatcher`), matched against
  vLLM's module names: each linear (a fused one, e.g. qkv_proj, also by its parts' names, all
  or none of them) and each MoE layer's experts as one module (`model.layers.0.mlp.experts`:
  `"re:.*experts.*"` keeps every layer's experts in the model dtype).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

from vllm_mxplus.checkpoint.layout import (
    check_quantization_config,
    checkpoint_macro_block,
    is_mxplus_quantization_config,
)
from vllm_mxplus.checkpoint.rules import IgnoreMatcher
from vllm_mxplus.formats import SCHEMES, Scheme, get_scheme
from vllm_mxplus.integration.fused_moe import MxplusFusedMoEMethod
from vllm_mxplus.integration.linear import MxplusLinearMethod
from vllm_mxplus.integration.lm_head import MxplusLMHeadMethod
from vllm_mxplus.quant_rules import stays_unquantized

logger = logging.getLogger(__name__)

# The keys of an online options dict (`--hf-overrides '{"quantization_config": {...}}'`).
ONLINE_OPTIONS = ("quant_method", "macro_block_size", "modules_to_not_convert", "ignore")
# A checkpoint's modules_to_not_convert entries that keep a MoE layer's whole expert stacks
# (transformers' fused `experts.gate_up_proj` / `experts.down_proj`, as `mxplus quantize
# --ignore` keeps gpt-oss's; after vLLM's name mapper `experts.w13_weight` /
# `experts.w2_weight`): one of each pair under the layer's prefix keeps the layer unquantized.
KEPT_EXPERT_STACKS = (("gate_up_proj", "w13_weight"), ("down_proj", "w2_weight"))


class MxplusConfig(QuantizationConfig):
    """Base of the per-scheme configs; subclasses only set `scheme_name`."""

    scheme_name: ClassVar[str] = ""

    def __init__(
        self,
        is_checkpoint_quantized: bool = False,
        modules_to_not_convert: list[str] | None = None,
        macro_block: int | None = None,
        ignore: list[str] | None = None,
    ) -> None:
        super().__init__()
        if not self.scheme_name:
            raise TypeError("use a per-scheme subclass (get_quantization_config(NAME))")
        # The one scheme value of this model, made here once and passed whole; macro_block
        # None: the scheme's default (only a checkpoint or an options dict sets another).
        self.scheme: Scheme = get_scheme(self.scheme_name, macro_block)
        self.is_checkpoint_quantized = is_checkpoint_quantized
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.ignore = IgnoreMatcher(list(ignore or []))  # online option `ignore`

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(scheme={self.scheme}, "
            f"checkpoint_quantized={self.is_checkpoint_quantized}, "
            f"modules_to_not_convert={self.modules_to_not_convert}, "
            f"ignore={self.ignore.patterns})"
        )

    @classmethod
    def get_name(cls) -> str:  # type: ignore[override]  # vLLM's Literal lists its built-ins
        return cls.scheme_name

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # every backend gates itself at selection (backends/selection.py)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # no side file: config.json's quantization_config is the whole story

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MxplusConfig:
        """A pre-quantized checkpoint's `quantization_config` (checkpoint/layout.py)."""
        method = config.get("quant_method")
        if method != cls.scheme_name:
            if method in SCHEMES:
                fix = (
                    f"This checkpoint is already quantized with {method!r}: drop "
                    f"--quantization (vLLM detects a pre-quantized checkpoint from "
                    f"config.json) or pass --quantization {method}."
                )
            else:
                fix = (
                    f"This checkpoint is not a vllm-mxplus checkpoint: serve it without "
                    f"--quantization {cls.scheme_name}, or quantize its bf16/fp16 original "
                    f"(`--quantization {cls.scheme_name}` or `mxplus quantize`)."
                )
            raise ValueError(
                f"config.json: quantization_config.quant_method is {method!r}, but the "
                f"{cls.scheme_name!r} loader was selected (--quantization "
                f"{cls.scheme_name}). {fix}"
            )
        if not is_mxplus_quantization_config(config):
            return cls._online_with_options(config)
        check_quantization_config(config)
        macro = checkpoint_macro_block(config)
        return cls(
            is_checkpoint_quantized=True,
            modules_to_not_convert=config.get("modules_to_not_convert") or [],
            macro_block=int(macro),
        )

    @classmethod
    def _online_with_options(cls, config: dict[str, Any]) -> MxplusConfig:
        """Online mode (weights quantized at load) with the options of a `quantization_config`
        that no vllm-mxplus quantizer wrote (e.g. from `--hf-overrides`)."""
        where = "quantization_config (--hf-overrides or config.json)"
        unknown = sorted(set(config) - set(ONLINE_OPTIONS))
        if unknown:
            raise ValueError(
                f"{where}: {', '.join(map(repr, unknown))} "
                f"{'is not an option' if len(unknown) == 1 else 'are not options'} of "
                f"--quantization {cls.scheme_name} (options: {', '.join(ONLINE_OPTIONS[1:])}); "
                f"a checkpoint quantized by `mxplus quantize` carries a 'producer' entry"
            )
        macro = config.get("macro_block_size")
        lists = {k: config.get(k) or [] for k in ("modules_to_not_convert", "ignore")}
        for key, names in lists.items():
            if not isinstance(names, list) or not all(isinstance(p, str) for p in names):
                raise ValueError(f"{where}: {key} must be a list of strings")
        try:
            IgnoreMatcher(lists["ignore"])
        except ValueError as e:  # names the pattern; here the option is `ignore`
            raise ValueError(f"{where}: ignore: {e}") from None
        scheme = get_scheme(cls.scheme_name)
        if macro is not None:
            scheme.with_macro_block(macro, f"{where}: macro_block_size")
        logger.info(
            "vllm-mxplus %s: online quantization with options %s",
            cls.scheme_name,
            {k: v for k, v in config.items() if k != "quant_method"},
        )
        return cls(
            modules_to_not_convert=lists["modules_to_not_convert"],
            macro_block=macro,
            ignore=lists["ignore"],
        )

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.modules_to_not_convert:
            self.modules_to_not_convert = hf_to_vllm_mapper.apply_list(self.modules_to_not_convert)

    def is_skipped(self, prefix: str) -> bool:
        """lm_head, embeddings and MoE routers (vllm_mxplus.quant_rules, as the offline
        quantizer decides), the layers the `ignore` patterns match and the checkpoint's
        modules_to_not_convert stay unquantized."""
        if stays_unquantized(prefix) or self._ignored(prefix):
            return True
        return is_layer_skipped(
            prefix, self.modules_to_not_convert, self.packed_modules_mapping, match_mode="suffix"
        )

    def _ignored(self, prefix: str) -> bool:
        """Whether the `ignore` patterns keep the layer `prefix`: its own name matches, or (a
        fused linear) the names of all its parts; some parts only is an error."""
        if self.ignore.match(prefix):
            return True
        parent, _, last = prefix.rpartition(".")
        parts = [
            f"{parent}.{p}" if parent else p for p in self.packed_modules_mapping.get(last, [])
        ]
        hits = [p for p in parts if self.ignore.match(p)]
        if hits and len(hits) < len(parts):
            raise ValueError(
                f"{prefix}: the quantization option ignore={self.ignore.patterns} matches "
                f"{', '.join(hits)} but not {', '.join(p for p in parts if p not in hits)}; "
                f"vLLM runs them as one fused layer: ignore all of its parts or none"
            )
        return bool(hits)

    def experts_kept(self, prefix: str) -> bool:
        """Whether the MoE layer `prefix` stays unquantized: is_skipped, or a checkpoint that
        keeps its whole expert stacks (KEPT_EXPERT_STACKS)."""
        if self.is_skipped(prefix):
            return True
        under = {
            m[len(prefix) + 1 :] for m in self.modules_to_not_convert if m.startswith(prefix + ".")
        }
        return all(any(name in under for name in pair) for pair in KEPT_EXPERT_STACKS)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            if self.is_skipped(prefix):
                return UnquantizedLinearMethod()
            return MxplusLinearMethod(self)
        from vllm.model_executor.layers.fused_moe import RoutedExperts

        if isinstance(layer, RoutedExperts):
            if self.experts_kept(prefix):
                from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
                    UnquantizedFusedMoEMethod,
                )

                return UnquantizedFusedMoEMethod(layer.moe_config)
            return MxplusFusedMoEMethod(self, layer.moe_config)
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        if isinstance(layer, ParallelLMHead):
            # unquantized (paper §5.1); an fp32 GEMM on CPUs without bf16 (lm_head.py)
            return MxplusLMHeadMethod()
        return None  # embeddings, norms, attention: unquantized (paper §5.1)


def _class_name(scheme: str) -> str:
    return (
        "Mxplus" + "".join(p.capitalize() for p in scheme.replace("-", "_").split("_")) + "Config"
    )


CONFIG_CLASSES: dict[str, type[MxplusConfig]] = {
    name: type(_class_name(name), (MxplusConfig,), {"scheme_name": name, "__module__": __name__})
    for name in SCHEMES
}
# Module attributes too: vLLM pickles the config class into its engine processes.
globals().update({cls.__name__: cls for cls in CONFIG_CLASSES.values()})
