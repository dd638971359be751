"""Which source tensors are quantized: name and shape rules, and `--ignore` patterns.

A tensor is quantized when it is the weight of a Linear layer (or a stack of MoE expert
Linears) and no rule keeps it:
  * 2-D `NAME.weight` or 3-D `NAME.weight` [E, N, K] (stacked experts), floating point;
  * 3-D fused expert parameters without the `.weight` suffix, as transformers >= 5 saves them
    (`...experts.gate_up_proj`, `...experts.down_proj`, [E, N, K]); the module name is then
    the parameter name itself;
kept in high precision:
  * lm_head, embeddings and MoE routers (`vllm_mxplus.quant_rules`, the one rule for every
    path);
  * modules matching an `--ignore` pattern;
  * 1-D tensors (norms, biases) and anything not floating point.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from vllm_mxplus.quant_rules import unquantized_reason

QUANTIZABLE_DTYPES = ("BF16", "F16", "F32")
FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_proj", "up_proj", "w1", "w2", "w3")
# Model types whose 3-D expert stacks are stored [E, K, N] (x @ W), not [E, N, K]: each expert
# is quantized transposed, along its reduction dim K, and stored [E, N, K] like every other
# quantized weight (vLLM's gpt-oss loader gets them from integration/gpt_oss_model.py).
TRANSPOSED_EXPERT_MODEL_TYPES = ("gpt_oss",)
REGEX_PREFIX = "re:"
# vLLM fuses these siblings into one layer, which must be all quantized or all not (and, for
# nvfp4 in compressed-tensors, shares one global scale).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class IgnoreMatcher:
    """`--ignore` patterns on module names.

    `re:EXPR` is a regular expression (re.search); anything else is an fnmatch glob matched
    against the full module name or any dotted suffix of it, so `down_proj` and
    `layers.0.*` work as well as `model.layers.*.mlp.down_proj`.
    """

    patterns: list[str] = field(default_factory=list)
    used: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._compiled: list[tuple[str, re.Pattern[str] | None]] = []
        for p in self.patterns:
            if p.startswith(REGEX_PREFIX):
                try:
                    self._compiled.append((p, re.compile(p[len(REGEX_PREFIX) :])))
                except re.error as e:
                    raise ValueError(f"--ignore {p!r}: invalid regular expression ({e})") from None
            else:
                self._compiled.append((p, None))

    def match(self, module: str) -> str | None:
        """The first pattern matching module (and remember it was used), else None."""
        for p, rx in self._compiled:
            hit = (
                (rx.search(module) is not None)
                if rx is not None
                else (fnmatch.fnmatchcase(module, p) or fnmatch.fnmatchcase(module, "*." + p))
            )
            if hit:
                self.used.add(p)
                return p
        return None

    def unused(self) -> list[str]:
        return [p for p in self.patterns if p not in self.used]


@dataclass(frozen=True)
class Decision:
    """What happens to one source tensor. module: its Linear's name when weight-like."""

    quantize: bool
    module: str | None
    reason: str
    transposed: bool = False  # a source stack [E, K, N], quantized as [E, N, K]

    def weight_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The logical shape of the quantized weight ([..., N, K]) of a source tensor."""
        return (*shape[:-2], shape[-1], shape[-2]) if self.transposed else tuple(shape)


def module_of(name: str, ndim: int) -> str | None:
    """The Linear module a weight-like tensor belongs to, or None for other tensors."""
    if name.endswith(".weight") and ndim in (2, 3):
        return name[: -len(".weight")]
    last = name.rsplit(".", 1)[-1]
    if ndim == 3 and ".experts." in f".{name}" and last in FUSED_EXPERT_PARAMS:
        return name
    return None


def classify(
    name: str,
    dtype: str,
    shape: tuple[int, ...],
    ignore: IgnoreMatcher,
    model_type: str | None = None,
) -> Decision:
    """Decide whether the source tensor `name` is quantized (see the module docstring)."""
    module = module_of(name, len(shape))
    if module is None:
        return Decision(False, None, "not a Linear weight")
    kept = unquantized_reason(module)
    if kept is not None:
        return Decision(False, module, kept)
    pattern = ignore.match(module)
    if pattern is not None:
        return Decision(False, module, f"--ignore {pattern}")
    if dtype not in QUANTIZABLE_DTYPES:
        return Decision(False, module, f"dtype {dtype} is not bf16/fp16/fp32")
    if 0 in shape:
        return Decision(False, module, "empty tensor")
    if len(shape) == 3 and model_type in TRANSPOSED_EXPERT_MODEL_TYPES:
        return Decision(
            True, module, f"quantized ({model_type} experts [E, K, N], transposed)", True
        )
    return Decision(True, module, "quantized")
