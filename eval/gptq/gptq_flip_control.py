"""How often the in-process reference "flips" against itself: the same checkpoint with every
quantized linear's GEMM in float64 instead of fp32 (a ~1e-7 relative perturbation), teacher-
forced on the fp32 model's greedy tokens for the prompts of eval/gptq/gptq_serve_check.py. A flip:
the argmax differs or the chosen token's logprob moves by more than 1e-4 nats.

  python eval/gptq/gptq_flip_control.py /tmp/gptq-serve-check/mxfp4-mbs-h-rtn [--scheme mxfp4-mbs-h]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch


def main() -> int:
    from transformers import AutoTokenizer

    from vllm_mxplus.assets.smollm2 import smollm2_dir
    from vllm_mxplus.backends.reference import linear as reference
    from vllm_mxplus.evaluation.reference_model import LOGPROB_ATOL, PROMPTS, quantized_model

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("ckpt")
    ap.add_argument("--scheme", default="mxfp4-mbs-h")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    src = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(str(src))
    model = quantized_model(src, Path(args.ckpt), args.scheme, torch.float32)
    fp = torch.nn.functional

    class _Float64Linear:  # reference_linear looks up F.linear at call time
        def __getattr__(self, name: str):  # noqa: ANN204
            if name != "linear":
                return getattr(fp, name)
            return lambda x, w, b=None: fp.linear(
                x.double(), w.double(), None if b is None else b.double()
            ).float()

    agree = total = 0
    flips = []
    try:
        with torch.no_grad():
            for p in PROMPTS:
                ids = tok(p, return_tensors="pt").input_ids
                flip = None
                for j in range(args.max_tokens):
                    reference.F = fp
                    l32 = model(input_ids=ids).logits[0, -1].float()
                    reference.F = _Float64Linear()
                    l64 = model(input_ids=ids).logits[0, -1].float()
                    t = int(l32.argmax())
                    d = abs(float(torch.log_softmax(l32, -1)[t] - torch.log_softmax(l64, -1)[t]))
                    same = int(l64.argmax()) == t
                    if flip is None and (not same or d > LOGPROB_ATOL):
                        flip = j
                    agree += same
                    total += 1
                    ids = torch.cat([ids, torch.tensor([[t]])], 1)
                flips.append(flip)
    finally:
        reference.F = fp
    print(
        f"{Path(args.ckpt).name}: reference fp32 GEMM vs float64 GEMM: argmax equal at "
        f"{agree}/{total} steps; first flip per prompt {flips}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
