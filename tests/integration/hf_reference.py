"""The transformers reference: greedy tokens and their logprobs with FakeQuantLinear modules."""

from __future__ import annotations

import torch

from vllm_mxplus.ops.fake_quant import apply_fake_quant


def hf_greedy(model_dir: str, scheme: str | None, prompts: list[str], max_tokens: int,
              dtype: torch.dtype = torch.float32) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy continuation of each prompt (no batching) and the chosen tokens' logprobs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if scheme is not None:
        apply_fake_quant(model, scheme)
    tokens, logprobs = [], []
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            # vLLM adds no BOS for this tokenizer either (no post-processor): same ids.
            out = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=3)
            new = out.sequences[0, ids.shape[1]:].tolist()
            lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, new)]
            tokens.append(new)
            logprobs.append(lps)
    return tokens, logprobs


def hf_teacher_forced(model_dir: str, scheme: str | None, prompts: list[str],
                      continuations: list[list[int]], dtype: torch.dtype = torch.float32
                      ) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Feed prompt + given continuation in one forward; per continuation position return the
    reference's greedy token, the logprob of the given token and the top-2 logprob margin."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if scheme is not None:
        apply_fake_quant(model, scheme)
    greedy, logprobs, margins = [], [], []
    with torch.no_grad():
        for p, cont in zip(prompts, continuations):
            ids = tok(p, return_tensors="pt").input_ids
            full = torch.cat([ids, torch.tensor([cont])], dim=1)
            logits = model(full).logits[0, ids.shape[1] - 1: -1].float()
            lp = torch.log_softmax(logits, -1)
            top2 = lp.topk(2, dim=-1).values
            greedy.append(lp.argmax(-1).tolist())
            logprobs.append(lp[torch.arange(len(cont)), torch.tensor(cont)].tolist())
            margins.append((top2[:, 0] - top2[:, 1]).tolist())
    return greedy, logprobs, margins
