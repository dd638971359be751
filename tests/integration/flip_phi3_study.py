"""The Phi-3 nvfp4 grid cell's figures (docs/models.md, "The Phi-3 nvfp4 flip"): a rounding
flip of the fp32 reference, told apart from an error. A study script, not a test:

    OMP_NUM_THREADS=1 .venv/bin/python tests/integration/flip_phi3_study.py [--vllm-json F]

builds the grid's Phi-3 checkpoint (seed of matrix_grid.run_grid), serves it with vLLM nvfp4
online in fp32 (1-2 min; or reads a driver result saved by an earlier run, --vllm-json) and
prints: the first-token top-3 of prompt 3 under the fp32 reference and its rounding variants
(flip_reference.py); whose greedy tokens equal vLLM's; vLLM's logprobs against each variant's
(teacher forcing); the first activation code the fp32 and float64 references quantize
differently, and how far its block scale lies from an E4M3 rounding midpoint; the flip
rule's figures (matrix_grid.flip_evidence) for vLLM and for broken engines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from flip_reference import (  # noqa: E402
    greedy_with_logprobs,
    load_variant,
    recording_activation_codes,
    teacher_forced_logprobs,
    wrong_weight_model,
)
from matrix_grid import flip_evidence, flip_mismatch  # noqa: E402
from model_matrix import PROMPTS, TOKENS  # noqa: E402
from tiny_models import ARCHS, build_tiny  # noqa: E402

from vllm_mxplus.formats.constants import E2M1_MAX  # noqa: E402

SCHEME = "nvfp4"
VARIANTS = ("fp32", "fp64", *(f"perm{i}" for i in range(6)))


def serve(models: dict[str, str], root: Path) -> dict:
    from integration_harness import run_driver

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    job = {"dtype": "float32", "prompts": PROMPTS, "max_tokens": TOKENS, "quantization": SCHEME}
    jobs = [{**job, "id": a, "model": m} for a, m in models.items()]
    results, _ = run_driver(jobs, root, env, timeout=1800)
    return results


def boundary(md: str) -> None:
    """The first activation code where the fp32 and float64 references part (prompt 3)."""
    recs = {}
    for v in ("fp32", "fp64"):
        model = load_variant(md, SCHEME, v)
        inputs: list[torch.Tensor] = []
        first = next(m for n, m in model.named_modules() if n.endswith("o_proj"))
        first.register_forward_pre_hook(lambda mod, a, rec=inputs: rec.append(a[0][0]))
        with recording_activation_codes(model) as seen, torch.no_grad():
            model(torch.tensor([PROMPTS[3]]))
        recs[v] = (list(seen), inputs)
    total = sum(int((a != b).sum()) for (_, a), (_, b) in zip(recs["fp32"][0], recs["fp64"][0]))
    print(f"activation codes that differ, fp32 vs fp64 reference, prompt 3: {total}")
    for (name, a), (_, b) in zip(recs["fp32"][0], recs["fp64"][0]):
        diff = (a != b)[0].nonzero()
        if len(diff):
            print(f"first: {name}, {len(diff)} code(s), token(s) {diff[:, 0].unique().tolist()}")
            break
    if not name.endswith("layers.0.self_attn.o_proj"):
        return
    tok, el = diff[0].tolist()
    for v in ("fp32", "fp64"):
        x = recs[v][1][0][tok].double()  # the input row as each reference computed it
        g = x.abs().max() / (6 * 448)
        s = x[el // 16 * 16 : el // 16 * 16 + 16].abs().max() / E2M1_MAX / g
        lo = s.float().to(torch.float8_e4m3fn).double()
        step = 2.0 ** (torch.floor(torch.log2(lo)) - 3)  # E4M3: 3 mantissa bits
        mid = lo + step / 2 if s > lo else lo - step / 2
        print(
            f"{v}: block {el // 16} scale amax_b/6/g = {s.item():.9f}, E4M3 {lo.item()} / "
            f"midpoint {mid.item()}: {(s - mid).item() / mid.item():+.2e} relative"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-json", help="a driver result (ids phi3, llama) from an earlier run")
    ap.add_argument("--save-vllm-json", help="where to save the driver result")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="flip-phi3-"))
    order = list(ARCHS)
    models = {a: str(build_tiny(a, root / a, seed=order.index(a))) for a in ("phi3", "llama")}
    md = models["phi3"]
    results = (
        json.loads(Path(args.vllm_json).read_text()) if args.vllm_json else serve(models, root)
    )
    if args.save_vllm_json:
        Path(args.save_vllm_json).write_text(json.dumps(results))
    res = results["phi3"]
    print("vLLM nvfp4 prompt 3:", res["tokens"][3], f"first logprob {res['logprobs'][3][0]:.6f}")
    for v in VARIANTS:
        model = load_variant(md, SCHEME, v)
        lp0 = teacher_forced_logprobs(model, PROMPTS[3], [0])[0]
        top = lp0.topk(3)
        greedy = [greedy_with_logprobs(model, p, TOKENS)[0] for p in PROMPTS]
        dlp = max(
            (
                teacher_forced_logprobs(model, p, t)[torch.arange(TOKENS), torch.tensor(t)]
                - torch.tensor(lp, dtype=torch.float64)
            )
            .abs()
            .max()
            .item()
            for p, t, lp in zip(PROMPTS, res["tokens"], res["logprobs"])
        )
        print(
            f"{v:6s} prompt 3 first-token top-3 {top.indices.tolist()} "
            f"{[round(x, 6) for x in top.values.tolist()]}; greedy == vLLM per prompt "
            f"{[g == t for g, t in zip(greedy, res['tokens'])]}; "
            f"max |vLLM logprob - teacher-forced| {dlp:.2e}"
        )
    boundary(md)
    engines = {"vLLM nvfp4": res, "another model (llama's vLLM nvfp4)": results["llama"]}
    for wrong in ("scale2", "shard-global-scale"):
        runs = [
            greedy_with_logprobs(wrong_weight_model(md, SCHEME, wrong), p, TOKENS) for p in PROMPTS
        ]
        engines[f"wrong weight: {wrong}"] = {
            "tokens": [t for t, _ in runs],
            "logprobs": [lp for _, lp in runs],
        }
    for name, r in engines.items():
        ev = flip_evidence(md, SCHEME, r["tokens"])
        gaps = [
            (i, j, round(g, 4))
            for i, gg in enumerate(ev["gaps"])
            for j, g in enumerate(gg)
            if g > 0
        ]
        print(
            f"flip rule, {name}: S per prompt {[f'{s:.2e}' for s in ev['sensitivity']]}; "
            f"gaps > 0 (prompt, token, nats) {gaps[:6]}{' ...' if len(gaps) > 6 else ''}; "
            f"-> {flip_mismatch(r, ev) or 'passes'}"
        )


if __name__ == "__main__":
    main()
