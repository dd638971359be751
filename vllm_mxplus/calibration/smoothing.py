"""SmoothQuant-style smoothing folded offline into the model: `mxplus quantize --smooth ALPHA`.

For each group of linears that reads one activation X (K channels), a per-channel factor

    s_k = max|X_k|^alpha / max|W_:,k|^(1 - alpha)

(max over calibration tokens, and over the output rows of every linear in the group) moves
quantization difficulty from the activation to the weight: the group's weights are
multiplied column-wise by s and the operation that produces X is divided by s, so the
unquantized model computes the same function (up to the rounding of the rewritten tensors in
their stored dtype). Nothing changes at serving time: the checkpoint holds the rewritten
tensors in the usual layout, and its quantization_config records the smoothing (provenance).

Folds, per decoder layer of a Llama-like model (input-side pairs with nothing in between but
an elementwise product or a per-head linear map):

- input_layernorm.weight / s  ->  q_proj, k_proj, v_proj columns * s
- post_attention_layernorm.weight / s  ->  gate_proj, up_proj columns * s
- up_proj rows / s (down_proj's input is act(gate) * up)  ->  down_proj columns * s
- v_proj rows / s (o_proj's input is softmax(...) @ V per head)  ->  o_proj columns * s, with
  s shared by the query heads that read one KV head (grouped-query attention)

Statistics come from the unquantized model (as in SmoothQuant) on the calibration tokens.
RMSNorms whose scale is (1 + weight) (Gemma) would need another fold: such model types are
refused, as is any layer that lacks one of the modules above.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from vllm_mxplus.calibration.smooth_option import check_alpha
from vllm_mxplus.errors import UsageError

#: model types whose norms multiply by `weight` and whose layers have the modules folded here
SMOOTH_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
EPS = 1e-5  # floor of the statistics and factors (an all-zero channel keeps s = EPS-bound)
BATCH = 4  # calibration samples per forward call


@dataclass(frozen=True)
class Fold:
    """One smoothing site: `producer` tensors are divided by s (`rows`: along dim 0, else
    the last dim), `consumers` are linears whose columns are multiplied by s."""

    producer: tuple[str, ...]
    rows: bool
    consumers: tuple[str, ...]
    heads: bool = False  # o_proj: s shared across the query heads of one KV head

    @property
    def stats(self) -> str:
        """The linear whose input statistics set s (every consumer reads the same input)."""
        return self.consumers[0]


FOLDS = (
    Fold(("input_layernorm",), False, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    Fold(("post_attention_layernorm",), False, ("mlp.gate_proj", "mlp.up_proj")),
    Fold(("mlp.up_proj",), True, ("mlp.down_proj",)),
    Fold(("self_attn.v_proj",), True, ("self_attn.o_proj",), heads=True),
)


def _layers(model: nn.Module) -> nn.ModuleList:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SMOOTH_MODEL_TYPES:
        raise UsageError(
            f"--smooth: model type {model_type!r} is not supported (folds are defined for "
            f"{', '.join(SMOOTH_MODEL_TYPES)}); quantize without --smooth"
        )
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise UsageError("--smooth: the model has no model.layers; quantize without --smooth")
    return layers


@contextmanager
def _hooks(mods: dict[str, nn.Module], amax: dict[str, torch.Tensor]) -> Iterator[None]:
    def hook(name: str):  # noqa: ANN202
        def fn(_mod: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            m = x.reshape(-1, x.shape[-1]).abs().amax(0).to("cpu", torch.float32)
            amax[name] = torch.maximum(amax[name], m) if name in amax else m

        return fn

    handles = [mod.register_forward_pre_hook(hook(n)) for n, mod in mods.items()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def input_absmax(model: nn.Module, tokens: torch.Tensor, device: str) -> dict[str, torch.Tensor]:
    """max |x_k| over the calibration tokens of the input of every linear a fold reads,
    by module name relative to its decoder layer index: {"3.mlp.down_proj": [K], ...}."""
    layers = _layers(model)
    mods = {
        f"{i}.{f.stats}": layer.get_submodule(f.stats)
        for i, layer in enumerate(layers)
        for f in FOLDS
        if _has(layer, f)
    }
    amax: dict[str, torch.Tensor] = {}
    with torch.no_grad(), _hooks(mods, amax):
        for b in tokens.split(BATCH):
            model(input_ids=b.to(device), use_cache=False)
    return amax


def _has(layer: nn.Module, fold: Fold) -> bool:
    try:
        for name in (*fold.producer, *fold.consumers):
            layer.get_submodule(name)
    except AttributeError:
        return False
    return True


def _factor(a: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    return (a.clamp(min=EPS) ** alpha / w.clamp(min=EPS) ** (1.0 - alpha)).clamp(min=EPS)


def smooth_model(
    model: nn.Module,
    amax: dict[str, torch.Tensor],
    alpha: float,
    dtypes: Mapping[str, torch.dtype],
) -> list[str]:
    """Fold the factors into `model` in place; returns the names of the rewritten tensors.

    Each rewritten tensor is rounded to its dtype in the checkpoint (`dtypes`, by tensor
    name), so that calibration and the quantizer see what the checkpoint will hold."""
    check_alpha(alpha)
    layers = _layers(model)
    cfg: Any = model.config
    n_heads: int = cfg.num_attention_heads
    n_kv: int = getattr(cfg, "num_key_value_heads", None) or n_heads
    head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
    prefix = "model.layers"
    changed: list[str] = []

    def rewrite(name: str, t: torch.Tensor, value: torch.Tensor) -> None:
        if name not in dtypes:
            raise UsageError(f"--smooth: {name} is not a tensor of the source checkpoint")
        stored = value.to(dtypes[name])
        if not torch.isfinite(stored).all():
            raise UsageError(
                f"--smooth {alpha}: {name} would not be finite in {dtypes[name]} after "
                "smoothing (an extreme channel); try a smaller ALPHA or quantize without --smooth"
            )
        t.copy_(stored.to(t.dtype))
        changed.append(name)

    with torch.no_grad():
        for i, layer in enumerate(layers):
            for fold in FOLDS:
                if not _has(layer, fold):
                    raise UsageError(
                        f"--smooth: {prefix}.{i} lacks one of {fold.producer + fold.consumers}"
                    )
                consumers = [cast(nn.Linear, layer.get_submodule(c)) for c in fold.consumers]
                w_amax = torch.cat([c.weight.abs().float() for c in consumers], 0).amax(0).cpu()
                a_amax = amax[f"{i}.{fold.stats}"]
                if fold.heads:  # channel h*head_dim + d reads KV head h // g: share s
                    g = n_heads // n_kv
                    a_kv = a_amax.reshape(n_kv, g, head_dim).amax(1)
                    s_kv = _factor(a_kv, w_amax.reshape(n_kv, g, head_dim).amax(1), alpha)
                    s = s_kv.repeat_interleave(g, 0).reshape(-1)
                    producer_s = s_kv.reshape(-1)
                else:
                    s = producer_s = _factor(a_amax, w_amax, alpha)
                for pname in fold.producer:
                    mod = layer.get_submodule(pname)
                    for attr in ("weight", "bias"):
                        t: torch.Tensor | None = getattr(mod, attr, None)
                        if t is None:
                            continue
                        f = producer_s.to(t.device)
                        if fold.rows and attr == "weight":
                            f = f[:, None]
                        rewrite(f"{prefix}.{i}.{pname}.{attr}", t, t.float() / f)
                for cname, c in zip(fold.consumers, consumers):
                    w = c.weight
                    rewrite(f"{prefix}.{i}.{cname}.weight", w, w.float() * s.to(w.device))
    return list(dict.fromkeys(changed))
