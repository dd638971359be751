"""The slow part of the coverage matrix: every scheme online, and bf16 engines.

model_matrix.py judges every architecture with mxfp4-mbs in fp32 (the CI subset). This module
serves a subset of the architectures (`GRID_ARCHS`) online with every other scheme of
`GRID_SCHEMES` in fp32, judged like the matrix (transformers fake-quant reference, or the
float64 MLA reference for DeepSeek-V2, by `integration_harness.greedy_mismatch`), and the
architectures of `BF16_ARCHS` online with mxfp4-mbs in bf16, judged by `bf16_mismatch`. All
engines run in one driver process; the results go to the "grid" and "bf16" sections of
docs/model_matrix.json.

The bf16 rule. A bf16 engine rounds every activation to 8 significant bits before it is
quantized to 4 bits, so many more activations than in fp32 land on the other side of a 4-bit
rounding boundary, and greedy decoding may legitimately take another token where the fp32
model's best two are close; the token-for-token rule of the fp32 runs does not apply. The
rule: the bf16 engine's continuation is fed to the fp32 fake-quant reference (teacher
forcing); at each position the gap is the reference's best logprob minus the logprob of the
token bf16 chose (0 where they agree). Every gap must be <= `BF16_MAX_GAP` and their mean over
all prompts and positions <= `BF16_MEAN_GAP`. A near-tie may flip, an unlikely token may not:
a broken engine picks tokens the reference ranks far below its best. The bounds come from
measurements on these models (docs/models.md gives the figures): largest gap 0.64-1.18 nats
and mean 0.04-0.15 for the bf16 engines; the unquantized bf16 engines' gaps <= 0.012 (bf16
alone is near-exact; the 4-bit boundaries amplify it); another model's continuation fed to
the reference (what a broken engine produces) >= 3.1 nats at its worst position.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from integration_harness import run_driver
from mla_judge import ENGINE_OPTIONS, MLA_ARCHS, judge_mla
from model_matrix import PROMPTS, SCHEME, TOKENS, judge
from tiny_models import ARCHS, build_tiny

# Every vLLM `--quantization` name but the CI matrix's own (mxfp4-mbs = mxfp4-mbs-h).
GRID_SCHEMES = ("mxfp4-ocp", "mxplus", "mxfp4-16-oas", "mxfp4-mbs-s", "nvfp4")
GRID_ARCHS = ("llama", "qwen3", "gemma3", "phi3", "qwen3_moe", "deepseek_v2")
# bf16: every architecture judged by the transformers reference (MLA's reference is fp32 vLLM's
# formulation in float64, gpt-oss's experts need their own fake-quant: not here).
BF16_ARCHS = ("llama", "qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe")
# nats: (reference's best logprob - logprob of bf16's token), at any position / on average.
BF16_MAX_GAP = 2.0
BF16_MEAN_GAP = 0.5
# Outcomes other than "ok" the grid expects, with a phrase of the note; anything else fails.
EXPECTED_GRID = {
    # Open finding: Phi-3 (qkv_proj / gate_up_proj fused in the checkpoint) with nvfp4 online.
    # With one global scale per stored weight (integration/linear.py stored_widths, as the
    # reference and `mxplus quantize` take it) prompt 0 agrees where it parted before; the
    # 35-token prompt still flips at its first token between two tokens 0.05 nats apart. A
    # rounding flip or a remaining difference: not yet told apart (a float64 reference with
    # the plugin's quantization points, as MLA has, would).
    ("phi3", "nvfp4"): ("mismatch", "at the first token"),
}


def grid_jobs(models: dict[str, str]) -> list[dict]:
    """Driver jobs: GRID_SCHEMES x GRID_ARCHS online in fp32, BF16_ARCHS online in bf16."""
    jobs = []
    for arch in GRID_ARCHS:
        for scheme in GRID_SCHEMES:
            jobs.append(
                {
                    "id": f"grid-{scheme}-{arch}",
                    "dtype": "float32",
                    "prompts": PROMPTS,
                    "max_tokens": TOKENS,
                    "model": models[arch],
                    "quantization": scheme,
                    **(ENGINE_OPTIONS if arch in MLA_ARCHS else {}),
                }
            )
    for arch in BF16_ARCHS:
        jobs.append(
            {
                "id": f"bf16-{arch}",
                "dtype": "bfloat16",
                "prompts": PROMPTS,
                "max_tokens": TOKENS,
                "model": models[arch],
                "quantization": SCHEME,
            }
        )
    return jobs


def reference_gaps(
    model_dir: str, scheme: str, continuations: list[list[int]]
) -> list[list[float]]:
    """Teacher-forced fp32 fake-quant reference: per position of each PROMPTS continuation,
    its best logprob minus the logprob of the given token (0 where they agree)."""
    from hf_reference import fake_quant_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    fake_quant_model(model, scheme)
    gaps = []
    with torch.no_grad():
        for p, cont in zip(PROMPTS, continuations):
            ids = torch.tensor([p])  # PROMPTS are token ids
            full = torch.cat([ids, torch.tensor([cont])], dim=1)
            lp = torch.log_softmax(model(full).logits[0, ids.shape[1] - 1 : -1].float(), -1)
            chosen = lp[torch.arange(len(cont)), torch.tensor(cont)]
            gaps.append((lp.max(-1).values - chosen).tolist())
    return gaps


def bf16_mismatch(res: dict, gaps: list[list[float]]) -> str | None:
    """None when every prompt has TOKENS tokens, every gap is <= BF16_MAX_GAP and their mean
    <= BF16_MEAN_GAP; else why not."""
    for i, (toks, g) in enumerate(zip(res["tokens"], gaps)):
        if len(toks) != TOKENS:
            return f"prompt {i}: {len(toks)} tokens, expected {TOKENS}"
        worst = max(range(TOKENS), key=lambda j: g[j])
        if g[worst] > BF16_MAX_GAP:
            return (
                f"prompt {i} token {worst}: bf16 chose {toks[worst]}, {g[worst]:.3f} nats below "
                f"the fp32 reference's best (allowed {BF16_MAX_GAP})"
            )
    mean = mean_gap(gaps)
    if mean > BF16_MEAN_GAP:
        return f"mean gap to the fp32 reference's best {mean:.3f} nats (allowed {BF16_MEAN_GAP})"
    return None


def mean_gap(gaps: list[list[float]]) -> float:
    flat = [x for g in gaps for x in g]
    return sum(flat) / len(flat)


def expected_grid(arch: str, scheme: str) -> tuple[str, str]:
    return EXPECTED_GRID.get((arch, scheme), ("ok", ""))


def run_grid(root: Path, env: dict) -> dict[str, Any]:
    """Build, serve and judge the grid and the bf16 runs; returns {"grid": ..., "bf16": ...}."""
    from hf_reference import hf_greedy

    order = list(ARCHS)
    archs = sorted(set(GRID_ARCHS) | set(BF16_ARCHS), key=order.index)
    # the seeds of model_matrix.build_all: the same checkpoints as the CI matrix
    models = {a: str(build_tiny(a, root / "models" / a, seed=order.index(a))) for a in archs}
    results, log = run_driver(grid_jobs(models), root, env, timeout=3600)
    (root / "log.txt").write_text(log)
    missing = {"error": "no result (driver crashed)"}
    grid: dict[str, dict[str, str]] = {}
    for arch in GRID_ARCHS:
        row: dict[str, str] = {}
        for scheme in GRID_SCHEMES:
            res = results.get(f"grid-{scheme}-{arch}", missing)
            if res.get("error"):
                status, why = judge(res, ([], []))
            elif arch in MLA_ARCHS:
                status, why = judge_mla(res, models[arch], scheme, PROMPTS, TOKENS)
            else:
                status, why = judge(res, hf_greedy(models[arch], scheme, PROMPTS, TOKENS))
            row[scheme] = status
            if why:
                row[f"{scheme}_note"] = why
        grid[arch] = row
    bf16: dict[str, dict[str, Any]] = {}
    for arch in BF16_ARCHS:
        res = results.get(f"bf16-{arch}", missing)
        if res.get("error"):
            status, why = judge(res, ([], []))
            bf16[arch] = {"online": status, "online_note": why}
            continue
        gaps = reference_gaps(models[arch], SCHEME, res["tokens"])
        why = bf16_mismatch(res, gaps)
        bf16[arch] = {
            "online": "ok" if why is None else "mismatch",
            # measured figures (the docs quote them); rounded for a stable committed file
            "largest_gap": round(max(max(g) for g in gaps), 2),
            "mean_gap": round(mean_gap(gaps), 3),
            "tokens_off_fp32_greedy": sum(x > 0 for g in gaps for x in g),
            **({"online_note": why} if why else {}),
        }
    return {
        "grid": {
            "schemes": list(GRID_SCHEMES),
            "kind": "online",
            "dtype": "float32",
            "archs": grid,
        },
        "bf16": {
            "scheme": SCHEME,
            "max_gap_nats": BF16_MAX_GAP,
            "mean_gap_nats": BF16_MEAN_GAP,
            "archs": bf16,
        },
    }
