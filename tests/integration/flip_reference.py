"""Rounding-sensitivity variants of the fp32 fake-quant reference (hf_reference.py).

W4A4 activation quantization is discontinuous: two fp32 computations of the same model that
differ only in summation order (vLLM's kernels against transformers') may put an activation on
either side of a 4-bit rounding boundary and then differ by far more than fp32 rounding. To
tell such a flip from an error, the reference is run in equally valid variants that differ
from it by float rounding alone, and vLLM's difference is compared with theirs:

- "fp32": hf_reference.fake_quant_model as the grid runs it.
- "fp64": every op in float64 (norms, attention, rotary, GEMMs, logits); the quantization
  points are the plugin's: each activation is rounded to fp32 and quantized with
  vllm_mxplus.formats (as the plugin does), the dequantized fp32 weight and activation
  multiplied in float64 (both exact in float64).
- "perm<seed>": fp32, but every quantized linear sums over K in another order (K permuted at
  random, the same permutation for activation and weight, after quantization: the same
  products, another fp32 summation order).

`quant_code_changes` counts the activation codes that differ between two
variants on the same tokens: the activations that crossed a 4-bit boundary.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F

from vllm_mxplus.backends.reference.linear import fake_quant_activation
from vllm_mxplus.backends.reference.modules import FakeQuantLinear
from vllm_mxplus.formats import quantize


def _forward_fp64(self: FakeQuantLinear, x: torch.Tensor) -> torch.Tensor:
    xq = fake_quant_activation(
        x.to(torch.float32), self.activation_format, self.per_row, self.macro_block
    )
    w = self.weight_fp32.to(torch.float64)
    b = None if self.bias is None else self.bias.to(torch.float64)
    return F.linear(xq.to(torch.float64), w, b).to(x.dtype)


def _forward_perm(self: FakeQuantLinear, x: torch.Tensor) -> torch.Tensor:
    xq = fake_quant_activation(x, self.activation_format, self.per_row, self.macro_block)
    p = self.k_perm
    b = None if self.bias is None else self.bias.to(torch.float32)
    return F.linear(xq[..., p], self.weight_fp32[:, p], b).to(x.dtype)


def load_variant(model_dir: str, scheme: str, variant: str) -> torch.nn.Module:
    """The fake-quant reference model of `model_dir` / `scheme` in one variant (see above)."""
    from hf_reference import fake_quant_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    fake_quant_model(model, scheme)
    fq = [m for m in model.modules() if isinstance(m, FakeQuantLinear)]
    if variant == "fp64":
        model.to(torch.float64)
        for m in fq:  # weight_fp32 holds exact fp32 values; keep it fp32
            m.weight_fp32 = m.weight_fp32.to(torch.float32)
            m.forward = _forward_fp64.__get__(m)
    elif variant.startswith("perm"):
        gen = torch.Generator().manual_seed(int(variant[4:]))
        for m in fq:
            m.k_perm = torch.randperm(m.in_features, generator=gen)
            m.forward = _forward_perm.__get__(m)
    elif variant != "fp32":
        raise ValueError(variant)
    return model


def teacher_forced_logprobs(
    model: torch.nn.Module, prompt: list[int], continuation: list[int]
) -> torch.Tensor:
    """[len(continuation), vocab] float64 log-softmax at each continuation position."""
    full = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logits = model(full).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.to(torch.float64), -1)


def activation_codes(x: torch.Tensor, fmt: str, per_row: bool, macro_block: int) -> torch.Tensor:
    """The 4-bit element codes of x's quantization (one uint8 per element): block scales and
    global scales move continuously with float rounding, a code changes only when an element
    crosses a rounding boundary (or its block's scale steps)."""
    q = quantize(x.to(torch.float32), fmt, per_row=per_row, macro_block=macro_block)
    c = q.codes
    return torch.stack([c & 0xF, c >> 4], -1).flatten(-2)


@contextmanager
def recording_activation_codes(model: torch.nn.Module):
    """Record every FakeQuantLinear's activation codes (activation_codes) in call order."""
    seen: list[tuple[str, torch.Tensor]] = []
    hooks = []
    for name, m in model.named_modules():
        if isinstance(m, FakeQuantLinear):

            def hook(mod, args, name=name):
                fmt, mb = mod.activation_format, mod.macro_block
                seen.append((name, activation_codes(args[0], fmt, mod.per_row, mb)))

            hooks.append(m.register_forward_pre_hook(hook))
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def quant_code_changes(
    a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]
) -> dict[str, int]:
    """Per linear name: how many activation codes differ between two records."""
    out: dict[str, int] = {}
    for (na, qa), (nb, qb) in zip(a, b, strict=True):
        assert na == nb
        out[na] = out.get(na, 0) + int((qa != qb).sum())
    return out


def greedy_with_logprobs(
    model: torch.nn.Module, prompt: list[int], n_tokens: int
) -> tuple[list[int], list[float]]:
    """Greedy continuation (one full forward per step, no cache) and its tokens' logprobs."""
    seq, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n_tokens):
            lp = torch.log_softmax(model(torch.tensor([seq])).logits[0, -1].double(), -1)
            t = int(lp.argmax())
            seq.append(t)
            lps.append(lp[t].item())
    return seq[len(prompt) :], lps


def wrong_weight_model(model_dir: str, scheme: str, wrong: str) -> torch.nn.Module:
    """The fp32 reference with a deliberately wrong weight, as a broken engine would have it:
    "scale2": layer 0's o_proj weight doubled (a scale off by one exponent step);
    "shard-global-scale": NVFP4 with one global scale per LOGICAL part (q, k, v / gate, up)
    of every fused weight the checkpoint stores as one tensor, instead of one per stored
    weight (docs/numerics.md, NVFP4; the Phi-3 grid cell's earlier error)."""
    from hf_reference import fake_quant_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    originals = {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    fake_quant_model(model, scheme)
    if wrong == "scale2":
        m = model.model.layers[0].self_attn.o_proj
        m.weight_fp32 = m.weight_fp32 * 2
        return model
    if wrong != "shard-global-scale":
        raise ValueError(wrong)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    widths = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
    for name, m in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(m, FakeQuantLinear) and last in widths:
            parts = originals[name].split(widths[last], dim=0)
            m.weight_fp32 = torch.cat(
                [
                    quantize(p, m.weight_format, macro_block=m.macro_block).dequantize(
                        torch.float32
                    )
                    for p in parts
                ]
            )
    return model
