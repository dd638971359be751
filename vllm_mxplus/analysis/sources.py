"""Where the analysed tensors come from: a checkpoint's linear weights, the inputs of every
linear layer captured while a transformers model reads a text, or synthetic tensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from vllm_mxplus.calibration.smoothing import input_absmax, smooth_model
from vllm_mxplus.checkpoint.rules import module_of
from vllm_mxplus.quant_rules import stays_unquantized


def is_linear_weight(name: str, shape: tuple[int, ...]) -> bool:
    """A 2-D Linear `*.weight` that the schemes quantize: not an embedding, lm_head or MoE
    router (vllm_mxplus.quant_rules, as `mxplus quantize` and the plugin decide), not a norm."""
    if len(shape) != 2:
        return False
    module = module_of(name, len(shape))
    return (
        module is not None
        and not stays_unquantized(module)
        and "norm" not in module.rsplit(".", 1)[-1]
    )


def _weight_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir}: no *.safetensors files (only safetensors checkpoints are read)"
        )
    return files


def checkpoint_linear_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every linear weight of a local safetensors checkpoint, one at a time."""
    from safetensors import safe_open

    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not iterable)
                shape = tuple(f.get_slice(name).get_shape())
                if is_linear_weight(name, shape):
                    yield name, f.get_tensor(name)


def count_linear_weights(model_dir: Path) -> int:
    from safetensors import safe_open

    n = 0
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            n += sum(is_linear_weight(k, tuple(f.get_slice(k).get_shape())) for k in f.keys())  # noqa: SIM118
    return n


def capture_linear_inputs(
    model_dir: Path, text: str, tokens: int, max_rows: int, smooth: float | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run a transformers model on `tokens` tokens of text and capture, for every nn.Linear
    the schemes quantize (not lm_head or a MoE router), up to `max_rows` input rows:
    ({module name: x [rows, K]}, {}). With `smooth` (alpha), the model is first smoothed
    as `mxplus quantize --smooth` does (statistics from the same tokens), and the second
    dict holds the rewritten tensors by name (the linear weights among them replace the
    checkpoint's in the measurement)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    dtype = _checkpoint_dtype(model_dir)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model.eval()
    # ~4 characters a token in English: tokenizing a prefix is enough and much faster
    ids = tok(text[: tokens * 16], return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] == 0:
        raise ValueError("the text gives no tokens")
    smoothed: dict[str, torch.Tensor] = {}
    if smooth is not None:
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
        changed = smooth_model(model, input_absmax(model, ids, "cpu"), smooth, dtypes)
        params = dict(model.named_parameters())
        smoothed = {n: params[n].detach() for n in changed}  # run() takes the linear weights
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and not stays_unquantized(name):

            def hook(m, args, name=name):
                x = args[0].detach().reshape(-1, args[0].shape[-1])[:max_rows]
                captured[name] = x.clone()

            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return captured, smoothed


def _checkpoint_dtype(model_dir: Path) -> torch.dtype:
    cfg = json.loads((model_dir / "config.json").read_text())
    name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    return getattr(torch, str(name), torch.float32)


def synthetic_tensors(
    seed: int = 0, n: int = 4, k: int = 1024, n_out: int = 1024
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """LLM-like synthetic layers: Gaussian weights; activations with heavy-tailed channel
    outliers (a few channels 20-50x larger, as in LLM.int8 / SmoothQuant observations).
    Returns ([(weight name, w)], {module name: x})."""
    g = torch.Generator().manual_seed(seed)
    weights, inputs = [], {}
    for i in range(n):
        w = (torch.randn(n_out, k, generator=g) * 0.02).bfloat16()
        x = torch.randn(256, k, generator=g)
        hot = torch.randperm(k, generator=g)[: max(1, k // 100)]
        x[:, hot] *= 20 + 30 * torch.rand(hot.numel(), generator=g)
        weights.append((f"synthetic.{i}.weight", w))
        inputs[f"synthetic.{i}"] = x.bfloat16()
    return weights, inputs
