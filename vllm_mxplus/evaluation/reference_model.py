"""In-process reference of a quantized checkpoint: transformers + the plugin's reference numerics.

Used by the calibration studies under eval/gptq/ (perplexity per scheme x method, the vLLM
serve check and its flip control) and by their tests: the bf16 model with every quantized
linear replaced by ``backends.reference.linear.reference_linear`` (the stored weight
dequantized to fp32, activations fake-quantized per token with the scheme's activation format,
fp32 GEMM; docs/numerics.md), which is what vLLM's reference backend computes on CPU, up to
GEMM accumulation order.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch

from vllm_mxplus.backends.reference.linear import reference_linear
from vllm_mxplus.calibration import smoothing
from vllm_mxplus.checkpoint import load
from vllm_mxplus.evaluation import act_options
from vllm_mxplus.formats import MACRO_BLOCK, fake_quantize, get_format, get_scheme
from vllm_mxplus.quant_rules import stays_unquantized

# Greedy prompts of the vLLM serve check (eval/gptq/gptq_serve_check.py) and its flip control.
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
]
LOGPROB_ATOL = 1e-4  # nats, before the first flip (as tests/integration/test_vllm_generate.py)


# short names of vllm_mxplus.calibration.smoothing.FOLDS, by their first consumer
FOLD_NAMES = {
    "self_attn.q_proj": "qkv",
    "mlp.gate_proj": "gate_up",
    "mlp.down_proj": "down",
    "self_attn.o_proj": "o",
}


@contextlib.contextmanager
def only_folds(names: list[str] | None) -> Iterator[None]:
    """Smoothing with only the named folds (None: all) while the block runs."""
    if names is None:
        yield
        return
    every = {FOLD_NAMES[f.consumers[0]]: f for f in smoothing.FOLDS}
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise ValueError(f"unknown fold(s) {unknown}; folds: {', '.join(every)}")
    saved = smoothing.FOLDS
    smoothing.FOLDS = tuple(f for n, f in every.items() if n in names)  # type: ignore[assignment]
    try:
        yield
    finally:
        smoothing.FOLDS = saved


def quantized_model(
    src: Path,
    ckpt: Path | None,
    scheme: str | None,
    dtype: torch.dtype = torch.bfloat16,
    act: str | None = None,
) -> torch.nn.Module:
    """The bf16 model with every quantized linear on the reference numerics: weights from
    `ckpt` (or, for a hadB option, rotated and quantized RTN here), activations with the
    scheme's format or the `act` option (vllm_mxplus.evaluation.act_options; for wmbN the checkpoint was
    written with --macro-block N)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype).eval()
    if scheme is None or scheme == "bf16":
        return model
    sch = get_scheme(scheme)
    afmt = sch.activation_format
    per_row = get_format(afmt).has_global_scale
    mods = dict(model.named_modules())
    rot_b = act_options.rotation_block(act)
    if act:
        act_options.check_scheme(act, afmt)
    act_q = act_options.activation_quantizer(act) if act else None
    if rot_b is None:
        assert ckpt is not None
        weights = {n: q.dequantize(torch.float32) for n, q in load(ckpt).items()}
        load_kept_tensors(model, ckpt)
        rot = {}
    else:  # rotated offline, RTN with the scheme's weight format
        names = [
            n
            for n, m in mods.items()
            if isinstance(m, torch.nn.Linear)
            and n.startswith("model.")
            and not stays_unquantized(n)
        ]
        rot = {n: act_options.block_rotation(mods[n].in_features, rot_b) for n in names}
        weights = {
            n: fake_quantize(mods[n].weight.float() @ rot[n], sch.weight_format) for n in names
        }
    for name, w in weights.items():
        lin = mods[name]
        r = rot.get(name)

        def forward(
            x: torch.Tensor,
            _w: torch.Tensor = w,
            _b=lin.bias,
            _r=r,  # noqa: ANN001
        ) -> torch.Tensor:
            if _r is not None:
                x = x.float() @ _r
            if act_q is None:
                return reference_linear(
                    x, _w, _b, afmt, per_row=per_row, out_dtype=dtype, macro_block=MACRO_BLOCK
                )
            b = None if _b is None else _b.float()
            return torch.nn.functional.linear(act_q(x), _w, b).to(dtype)

        lin.forward = forward
        lin.weight = None  # the bf16 weight is not what the served model computes with
    return model


def load_kept_tensors(model: torch.nn.Module, ckpt: Path) -> int:
    """Copy the checkpoint's unquantized tensors (norms, embeddings, lm_head, biases) into
    `model`: with --smooth they differ from the source model's. Returns how many."""
    from safetensors import safe_open

    params = dict(model.named_parameters())
    n = 0
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118  (safe_open is not iterable)
                p = params.get(name)
                if p is not None:
                    t = fh.get_tensor(name)
                    if t.shape != p.shape:
                        raise ValueError(
                            f"{path}: {name} is {tuple(t.shape)}, model has {tuple(p.shape)}"
                        )
                    p.data.copy_(t)
                    n += 1
    if n == 0:
        raise ValueError(f"{ckpt}: no unquantized tensor matched the model's parameters")
    return n


def perplexity(model: torch.nn.Module, tok, docs: list[str]) -> dict:  # noqa: ANN001
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    nll = 0.0
    n_tok = n_words = 0
    with torch.no_grad():
        for text in docs:
            ids = [prefix] + tok(text, add_special_tokens=False)["input_ids"]
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0, :-1].float()
            nll += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            n_tok += len(ids) - 1
            n_words += len(text.split())
    return {
        "word_ppl": math.exp(nll / n_words),
        "token_ppl": math.exp(nll / n_tok),
        "tokens": n_tok,
        "words": n_words,
    }
