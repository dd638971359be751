"""The transformers reference: greedy tokens and their logprobs with FakeQuantLinear modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_mxplus.backends.reference.modules import FakeQuantLinear, apply_fake_quant
from vllm_mxplus.formats import MACRO_BLOCK, get_scheme
from vllm_mxplus.integration.mla import WEIGHT_READ_BY_ATTENTION

PromptLike = str | list[int]  # text, or token ids (no BOS added)


class WeightOnlyLinear(torch.nn.Module):
    """A FakeQuantLinear's weight with an unquantized input: what the plugin computes for a
    linear whose weight attention reads directly (integration/mla.py, MLA's kv_b_proj)."""

    def __init__(self, fq: FakeQuantLinear):
        super().__init__()
        self.weight_fp32, self.bias = fq.weight_fp32, fq.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else self.bias.to(torch.float32)
        return F.linear(x.to(torch.float32), self.weight_fp32, b).to(x.dtype)


def fake_quant_model(
    model: torch.nn.Module, scheme: str | None, macro_block: int = MACRO_BLOCK
) -> torch.nn.Module:
    """The plugin's numerics on a transformers model: W4A4 fake-quant linears and experts,
    weight-only for the linears attention reads directly."""
    if scheme is None:
        return model
    for name in apply_fake_quant(model, get_scheme(scheme, macro_block)):
        if name.rsplit(".", 1)[-1] in WEIGHT_READ_BY_ATTENTION:
            parent, _, child = name.rpartition(".")
            mod = model.get_submodule(parent)
            setattr(mod, child, WeightOnlyLinear(getattr(mod, child)))
    return model


def _ids(tok, prompt: PromptLike) -> torch.Tensor:
    if isinstance(prompt, str):
        return tok(prompt, return_tensors="pt").input_ids
    return torch.tensor([prompt])


def hf_greedy(
    model_dir: str,
    scheme: str | None,
    prompts: list[PromptLike],
    max_tokens: int,
    dtype: torch.dtype = torch.float32,
    macro_block: int = MACRO_BLOCK,
) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy continuation of each prompt (no batching) and the chosen tokens' logprobs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    fake_quant_model(model, scheme, macro_block)
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in prompts:
            ids = _ids(tok, p)
            # vLLM adds no BOS for this tokenizer either (no post-processor): same ids.
            # vLLM's ignore_eos keeps generating but may PICK the EOS token; min_new_tokens
            # would forbid it here instead, so EOS is unset (no stop, no suppression).
            out = model.generate(
                ids,
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=3,
            )
            new = out.sequences[0, ids.shape[1] :].tolist()
            lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)]
            tokens.append(new)
            logprobs.append(lps)
    return tokens, logprobs


def hf_teacher_forced(
    model_dir: str,
    scheme: str | None,
    prompts: list[str],
    continuations: list[list[int]],
    dtype: torch.dtype = torch.float32,
) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Feed prompt + given continuation in one forward; per continuation position return the
    reference's greedy token, the logprob of the given token and the top-2 logprob margin."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    fake_quant_model(model, scheme)
    greedy, logprobs, margins = [], [], []
    with torch.no_grad():
        for p, cont in zip(prompts, continuations):
            ids = _ids(tok, p)
            full = torch.cat([ids, torch.tensor([cont])], dim=1)
            logits = model(full).logits[0, ids.shape[1] - 1 : -1].float()
            lp = torch.log_softmax(logits, -1)
            top2 = lp.topk(2, dim=-1).values
            greedy.append(lp.argmax(-1).tolist())
            logprobs.append(lp[torch.arange(len(cont)), torch.tensor(cont)].tolist())
            margins.append((top2[:, 0] - top2[:, 1]).tolist())
    return greedy, logprobs, margins
