"""Check that a calibrated checkpoint is served by vLLM unchanged.

Quantizes SmolLM2 with `--method rtn-aware|gptq` (small calibration: this checks the
serving path, not accuracy), generates greedily with vLLM (tests/integration/vllm_driver.py,
under `flock /tmp/mxplus-vllm.lock`; the checkpoint is detected with no --quantization flag)
and with the in-process transformers reference of the same checkpoint (eval/gptq_study.py),
and reports whether the tokens agree and the largest difference of the chosen tokens'
log-probabilities.

  python eval/gptq_serve_check.py --scheme mxfp4-mbs-h --method rtn-aware
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
]


def main() -> int:
    from vllm_mxplus.assets.smollm2 import smollm2_dir
    from vllm_mxplus.checkpoint import quantize_checkpoint

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--scheme", default="mxfp4-mbs-h")
    ap.add_argument("--method", default="rtn-aware")
    ap.add_argument("--nsamples", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", default="/tmp/gptq-serve-check")
    args = ap.parse_args()
    src = smollm2_dir()
    ckpt = Path(args.out) / f"{args.scheme}-{args.method}"
    if not (ckpt / "config.json").is_file():
        quantize_checkpoint(
            src,
            ckpt,
            args.scheme,
            method=args.method,
            force=True,
            nsamples=args.nsamples,
            seqlen=args.seqlen,
            progress=False,
        )
    jobs = [
        {
            "id": "calibrated",
            "model": str(ckpt),
            "quantization": None,
            "dtype": "bfloat16",
            "prompts": PROMPTS,
            "max_tokens": args.max_tokens,
        }
    ]
    with tempfile.TemporaryDirectory() as tmp:
        jf, of = Path(tmp) / "jobs.json", Path(tmp) / "out.json"
        jf.write_text(json.dumps(jobs))
        env = dict(
            os.environ,
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            VLLM_CPU_KVCACHE_SPACE="1",
            HF_HUB_OFFLINE="1",
        )
        cmd = [
            "flock",
            "/tmp/mxplus-vllm.lock",
            sys.executable,
            str(REPO / "tests" / "integration" / "vllm_driver.py"),
            str(jf),
            str(of),
        ]
        subprocess.run(cmd, env=env, check=False)
        served = json.loads(of.read_text())["calibrated"]
    if served.get("error"):
        print(f"vLLM failed to serve {ckpt}: {served['error']}")
        return 1

    sys.path.insert(0, str(HERE))
    from gptq_study import _quantized_model
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    model = _quantized_model(src, ckpt, args.scheme)
    agree, max_dlp = 0, 0.0
    for p, v_tokens, v_lps in zip(PROMPTS, served["tokens"], served["logprobs"]):
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            for t, lp in zip(v_tokens, v_lps):
                logits = model(input_ids=ids).logits[0, -1].float()
                ref_lp = float(torch.log_softmax(logits, -1)[t])
                max_dlp = max(max_dlp, abs(ref_lp - lp))
                ref_tok = int(logits.argmax())
                agree += int(ref_tok == t)
                ids = torch.cat([ids, torch.tensor([[t]])], 1)
        print(f"{p!r} -> vLLM {tok.decode(v_tokens)!r}")
    total = sum(len(t) for t in served["tokens"])
    print(
        f"{ckpt.name}: vLLM served it (load {served['load_s']:.0f} s); greedy tokens equal to "
        f"the transformers reference at {agree}/{total} steps; max |logprob difference| of "
        f"the chosen tokens {max_dlp:.4f}"
    )
    return 0 if agree == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
