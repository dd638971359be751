"""A source checked against its own config.json before any tensor is read in full.

`mxplus quantize` plans its output from the safetensors headers alone. Without a check, a
source whose linear weight is missing, has another shape than its config implies, or is
stored as integers (an already-quantized export without a quantization_config) is quantized
anyway, and the result fails in vLLM much later, or serves garbage. `check_source` refuses
such a source up front, naming the tensor:

* every weight the plan would quantize must be bf16/fp16/fp32 (an I8/U8/F8/... `.weight` of a
  Linear is refused, not silently copied);
* for a `model_type` transformers knows: the config must state the sizes its architecture
  needs (`REQUIRED_SIZES`, where that config class has them; transformers would otherwise
  fill in its defaults, e.g. Llama's hidden 4096); the model's skeleton is built from the
  config on the meta device (no memory) and every source tensor it also names must have its
  shape, every nn.Linear weight of the skeleton that the plan would quantize must be in the
  source.

Names are compared as stored. A source none of whose quantizable tensor names the skeleton
has (a naming convention transformers converts at load, e.g. per-expert MoE checkpoints) gets
the dtype rule only, logged. A `model_type` transformers does not know gets the dtype rule
only. Quantized sources (compressed-tensors, gpt-oss MXFP4) are checked after they are
dequantized (quantized_source.materialize), as the bf16 source they then are.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from vllm_mxplus.checkpoint.errors import CheckpointError
from vllm_mxplus.checkpoint.rules import QUANTIZABLE_DTYPES, IgnoreMatcher, module_of
from vllm_mxplus.checkpoint.source import SourceModel
from vllm_mxplus.quant_rules import unquantized_reason

logger = logging.getLogger(__name__)

# Sizes an architecture's layers are built from; required where its config class has them.
REQUIRED_SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "vocab_size",
)
INTEGER_PREFIXES = ("I", "U", "BOOL")  # safetensors I8, U8, I16, ..., BOOL


def would_quantize(name: str, shape: tuple[int, ...], matcher: IgnoreMatcher) -> str | None:
    """The Linear module of a source tensor the plan quantizes, whatever its dtype; None for
    one it keeps (not a Linear weight, lm_head / embeddings / routers, `--ignore`, empty)."""
    module = module_of(name, len(shape))
    if module is None or unquantized_reason(module) is not None or 0 in shape:
        return None
    if matcher.match(module) is not None:
        return None
    return module


def check_source(source: SourceModel, ignore: list[str], origin: Path | None = None) -> None:
    """Raise CheckpointError naming the first tensor (or config key) at fault; see the module
    docstring. Reads config.json and the headers only. origin: the directory to name in
    messages when `source` is a dequantized copy of it."""
    matcher = IgnoreMatcher(list(ignore))  # a copy: its "used" marks belong to the plan
    home = origin or source.path
    where = home / "config.json"
    for t in source.tensors:
        quantized = would_quantize(t.name, t.shape, matcher) is not None
        if quantized and t.dtype not in QUANTIZABLE_DTYPES:
            kind = "integer" if t.dtype.startswith(INTEGER_PREFIXES) else "non-bf16/fp16/fp32"
            raise CheckpointError(
                f"{home / t.path.name}: tensor {t.name!r} is {t.dtype} ({kind}), a Linear weight the "
                "quantizer would quantize: an already-quantized export? Quantize its bf16/fp16/"
                "fp32 original, or keep the module with --ignore"
            )
    skeleton = skeleton_shapes(source.config, where)
    if skeleton is None:
        return
    shapes, linears = skeleton
    planned = {
        t.name: t for t in source.tensors if would_quantize(t.name, t.shape, matcher) is not None
    }
    if planned and not any(n in shapes for n in planned):
        logger.warning(
            "%s: no quantizable tensor name of the source is a parameter of transformers' %s "
            "(e.g. %s): names not compared, dtypes checked",
            home,
            source.model_type,
            next(iter(planned)),
        )
        return
    for t in source.tensors:
        want = shapes.get(t.name)
        if want is not None and tuple(t.shape) != want:
            raise CheckpointError(
                f"{home / t.path.name}: tensor {t.name!r} has shape {list(t.shape)}, but {where} makes it "
                f"{list(want)}: the weights do not belong to this config"
            )
    names = {t.name for t in source.tensors}
    for name in linears:
        if name not in names and would_quantize(name, shapes[name], matcher) is not None:
            raise CheckpointError(
                f"{home}: tensor {name!r} ({list(shapes[name])}), a weight of "
                f"{where}'s model, is in no safetensors file: incomplete or mismatched source"
            )


def skeleton_shapes(
    config: dict[str, Any], where: Any
) -> tuple[dict[str, tuple[int, ...]], list[str]] | None:
    """(parameter shapes by name, names of the nn.Linear weights) of the model `config` builds,
    on the meta device; None when transformers does not know its model_type or architecture.
    Raises CheckpointError for a config that lacks a size its architecture needs."""
    cfg = hf_config(config, where)
    if cfg is None:
        return None
    model = meta_model(cfg, where)
    if model is None:
        return None
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    linears = [
        f"{n}.weight"
        for n, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, torch.nn.Linear)
    ]
    return shapes, linears


def hf_config(config: dict[str, Any], where: Any) -> Any | None:
    """transformers' config object for a config.json dict, after checking its sizes; None for
    a model_type transformers does not know (logged)."""
    from transformers import AutoConfig

    model_type = config.get("model_type")
    try:
        cls = type(AutoConfig.for_model(model_type)) if isinstance(model_type, str) else None
    except (ValueError, KeyError):
        cls = None
    if cls is None:
        logger.info(
            "%s: model_type %r is not a transformers architecture; tensors checked by dtype only",
            where,
            model_type,
        )
        return None
    check_sizes(config, cls, where)
    try:
        return cls.from_dict({k: v for k, v in config.items() if k != "quantization_config"})
    except Exception as e:  # transformers validates configs with many exception kinds
        raise CheckpointError(f"{where}: transformers rejects it ({e})") from None


def check_sizes(config: dict[str, Any], cls: type, where: Any) -> None:
    """Refuse a config lacking a REQUIRED_SIZES entry its config class has (directly, by an
    attribute_map alias, or in a nested text_config)."""
    default = cls()
    sub = getattr(default, "text_config", None)
    if sub is not None:  # a multimodal config: the language model's sizes are nested
        inner = config.get("text_config")
        scopes = [(inner if isinstance(inner, dict) else {}, sub)]
    else:
        scopes = [(config, default)]
    for raw, dflt in scopes:
        if dflt is None:
            continue
        aliases = getattr(dflt, "attribute_map", {}) or {}
        for key in REQUIRED_SIZES:
            if not hasattr(dflt, key):
                continue
            names = {key} | {a for a, target in aliases.items() if target == key}
            if not any(isinstance(raw.get(n), int) for n in names):
                raise CheckpointError(
                    f"{where}: no integer {key!r}, which model_type {config.get('model_type')!r}"
                    " needs to build its layers: a truncated or hand-written config? Use the "
                    "model's own config.json"
                )


def meta_model(cfg: Any, where: Any) -> torch.nn.Module | None:
    """The causal LM of a transformers config with every parameter on the meta device."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    except ValueError as e:  # no causal-LM class for this config
        logger.info("%s: no transformers causal LM to check against (%s)", where, e)
        return None
