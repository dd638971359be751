"""Wall and CPU seconds of the calibrated methods, with the current torch thread count.

  python eval/gptq/gptq_time.py model rtn-aware mxfp4-mbs-h      # all of SmolLM2, 8 x 256 tokens
  python eval/gptq/gptq_time.py layers rtn-aware mxfp4-mbs-h     # 2 random SmolLM2-shaped layers

`model` runs quantize_checkpoint on SmolLM2 (what `mxplus quantize --method ...` runs);
`layers` runs calibrate_and_quantize on a randomly initialised 2-layer model of SmolLM2's
shapes with random tokens (no download, ~10 CPU-seconds). Run with OMP_NUM_THREADS=1 / 2 to
compare thread counts; the load average is printed since the machine may be shared.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

import torch


def main() -> int:
    what, method, scheme = sys.argv[1:4]
    t, c = time.time(), time.process_time()
    if what == "model":
        from vllm_mxplus.assets.smollm2 import smollm2_dir
        from vllm_mxplus.checkpoint import quantize_checkpoint

        with tempfile.TemporaryDirectory() as tmp:
            quantize_checkpoint(
                smollm2_dir(),
                f"{tmp}/out",
                scheme,
                method=method,
                nsamples=8,
                seqlen=256,
                progress=False,
                device="cpu",
            )
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        from vllm_mxplus.assets.smollm2 import EXPECTED as SMOLLM2
        from vllm_mxplus.calibration.rtn_aware import calibrate_and_quantize
        from vllm_mxplus.formats import MACRO_BLOCK

        cfg = LlamaConfig(**{**SMOLLM2, "num_hidden_layers": 2}, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).float().eval()
        tokens = torch.randint(0, SMOLLM2["vocab_size"], (8, 256))
        targets = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        t, c = time.time(), time.process_time()
        calibrate_and_quantize(
            model, tokens, scheme, method, targets, progress=False, macro_block=MACRO_BLOCK
        )
    print(
        f"{what} {scheme} {method}, {torch.get_num_threads()} threads: wall "
        f"{time.time() - t:.1f} s, CPU {time.process_time() - c:.1f} s, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
