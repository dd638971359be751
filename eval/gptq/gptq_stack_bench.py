"""GPTQ of one SmolLM2 layer's 7 linears: each weight alone vs siblings sharing H stacked (q/k/v,
gate/up), CPU seconds, and a check that both give the same encodings bit for bit. H comes from
2048 random correlated inputs (no calibration run needed).

  python eval/gptq/gptq_stack_bench.py mxfp4-mbs-d [LAYER]
"""

import glob
import sys
import time

import torch
from safetensors.torch import load_file

from vllm_mxplus.assets.smollm2 import smollm2_dir
from vllm_mxplus.calibration.gptq import gptq, prepare_hessian, split_rows
from vllm_mxplus.formats import MACRO_BLOCK

sd = load_file(glob.glob(str(smollm2_dir()) + "/*.safetensors")[0])
fmt = sys.argv[1]
L = sys.argv[2] if len(sys.argv) > 2 else "5"
pre = f"model.layers.{L}."
groups = [
    ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    ["self_attn.o_proj"],
    ["mlp.gate_proj", "mlp.up_proj"],
    ["mlp.down_proj"],
]
g = torch.Generator().manual_seed(0)
tsep = tfus = 0.0
for grp in groups:
    ws = [sd[pre + n + ".weight"].float() for n in grp]
    k = ws[0].shape[1]
    x = torch.randn(2048, k, generator=g) @ (torch.randn(k, k, generator=g) * 0.1 + torch.eye(k))
    h = (x.T @ x).double()
    prep = prepare_hessian(h, k)
    t = time.process_time()
    sep = [gptq(w, h, fmt, prepared=prep, macro_block=MACRO_BLOCK) for w in ws]
    tsep += time.process_time() - t
    t = time.process_time()
    fus = (
        split_rows(
            gptq(torch.cat(ws, 0), h, fmt, prepared=prep, macro_block=MACRO_BLOCK),
            [w.shape[0] for w in ws],
        )
        if len(ws) > 1
        else [gptq(ws[0], h, fmt, prepared=prep, macro_block=MACRO_BLOCK)]
    )
    tfus += time.process_time() - t
    for a, b in zip(sep, fus):
        for f in ("codes", "scales", "mbs", "block_max_index"):
            x1, y1 = getattr(a, f), getattr(b, f)
            assert (x1 is None and y1 is None) or torch.equal(x1, y1), (grp, f)
print(
    f"{fmt} layer {L}: GPTQ of the 7 linears, CPU s: separate {tsep:.1f}, stacked siblings {tfus:.1f}; bit-identical"
)
