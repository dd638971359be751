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
