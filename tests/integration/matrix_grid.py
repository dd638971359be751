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

The fp32 flip rule. An fp32 cell that fails the token-for-token rule is judged again, because
activation quantization is discontinuous: the fp32 reference itself, computed in another
equally valid float order, may put one activation (or one block scale) on the other side of a
4-bit rounding boundary and then move its logprobs by far more than fp32 rounding, enough to
swap two near-tied tokens. The reference's rounding sensitivity is measured per prompt: its
variants of flip_reference.py (`FLIP_VARIANTS`: float64, and fp32 summing each GEMM over K in
random orders) are fed the engine's continuation with the fp32 reference (teacher forcing),
and S_i = the largest |logprob(variant) - logprob(fp32)|, over the variants and positions of
prompt i, of the engine's token and of the fp32 reference's best token. If every variant moves
both logprobs by at most S_i, a variant can rank the engine's token first only where the fp32
reference puts it at most 2 * S_i below its best; so the rule: at every position of prompt i,
gap (the fp32 reference's best logprob minus the engine's token's) <= 2 * S_i + LOGPROB_ATOL,
|engine logprob - fp32 reference logprob of that token| <= S_i + LOGPROB_ATOL, and
S_i <= FLIP_MAX_SENSITIVITY (a reference that rounding alone moves further cannot judge). On
a prompt where the reference is not near a boundary (S_i ~ 1e-6 nats) this is the
token-for-token rule. docs/models.md gives the figures: Phi-3 nvfp4, prompt 3: S = 0.23
nats, gaps 0.03-0.11 nats; every variant there agrees with vLLM token for token (vLLM's
logprobs within 2.3e-6 nats of theirs); broken engines (another model's continuation, a
doubled weight, per-part NVFP4 global scales on the fused weights) fail at the first token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hf_gpt_oss import gpt_oss_experts_fake_quant
from integration_harness import LOGPROB_ATOL, run_driver
from mla_judge import ENGINE_OPTIONS, MLA_ARCHS, judge_mla
from model_matrix import PROMPTS, SCHEME, TOKENS, judge
from tiny_models import ARCHS, build_tiny

# Every vLLM `--quantization` name but the CI matrix's own (mxfp4-mbs = mxfp4-mbs-h).
GRID_SCHEMES = ("mxfp4-ocp", "mxplus", "mxfp4-16-oas", "mxfp4-mbs-s", "nvfp4")
GRID_ARCHS = ("llama", "qwen3", "gemma3", "phi3", "qwen3_moe", "deepseek_v2")
# bf16: every architecture judged by the transformers reference (gpt-oss's with its experts
# fake-quantized too: hf_gpt_oss.py; MLA's reference is vLLM's formulation in float64, not a
# transformers model: not here).
BF16_ARCHS = ("llama", "qwen3", "gemma2", "gemma3", "phi3", "qwen3_moe", "gpt_oss")
# nats: (reference's best logprob - logprob of bf16's token), at any position / on average.
BF16_MAX_GAP = 2.0
BF16_MEAN_GAP = 0.5
# The fp32 flip rule (above): the reference's rounding variants, and the most the reference
# may move under float rounding alone (nats) for a cell to be judged by it.
FLIP_VARIANTS = ("fp64", "perm0", "perm1", "perm2")
FLIP_MAX_SENSITIVITY = 0.5
# Outcomes the grid expects other than a plain "ok", with a phrase of the note; anything else
# fails.
EXPECTED_GRID = {
    # Phi-3 (qkv_proj / gate_up_proj fused in the checkpoint) with nvfp4 online: the 35-token
    # prompt parts at its first token (vLLM 79, the fp32 reference 189, 0.11 nats apart). A
    # rounding flip of the REFERENCE: one E4M3 block scale of layer 0's o_proj input (token
    # 11) lies within 3e-7 of an E4M3 rounding midpoint (200, between 192 and 208), and
    # transformers' fp32 order rounds it to the other side than float64 and fp32 in other K
    # orders do; those agree with vLLM token for token (docs/models.md, "The Phi-3 nvfp4
    # flip"). Judged "ok" by the flip rule.
    ("phi3", "nvfp4"): ("ok", "rounding flip"),
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


def flip_evidence(model_dir: str, scheme: str, continuations: list[list[int]]) -> dict[str, list]:
    """The fp32 flip rule's measurements for an engine's PROMPTS continuations: per prompt the
    teacher-forced fp32 reference's gaps and logprobs of the chosen tokens, and its rounding
    sensitivity S_i over FLIP_VARIANTS (the module docstring)."""
    from flip_reference import load_variant, teacher_forced_logprobs

    base = load_variant(model_dir, scheme, "fp32")
    lp32 = [teacher_forced_logprobs(base, p, c) for p, c in zip(PROMPTS, continuations)]
    picks = [torch.stack([torch.tensor(c), lp.argmax(-1)], 1) for c, lp in zip(continuations, lp32)]
    sens = [0.0] * len(PROMPTS)
    for variant in FLIP_VARIANTS:
        model = load_variant(model_dir, scheme, variant)
        for i, (p, c) in enumerate(zip(PROMPTS, continuations)):
            d = (teacher_forced_logprobs(model, p, c) - lp32[i]).abs().gather(1, picks[i])
            sens[i] = max(sens[i], d.max().item())
    rows = [torch.arange(len(c)) for c in continuations]
    chosen = [lp[r, torch.tensor(c)] for lp, r, c in zip(lp32, rows, continuations)]
    return {
        "gaps": [(lp.max(-1).values - ch).tolist() for lp, ch in zip(lp32, chosen)],
        "logprobs": [ch.tolist() for ch in chosen],
        "sensitivity": sens,
    }


def flip_mismatch(res: dict, ev: dict[str, list]) -> str | None:
    """None when the engine's result passes the fp32 flip rule (the module docstring) with
    flip_evidence's measurements `ev`; else why not."""
    for i, (toks, lps) in enumerate(zip(res["tokens"], res["logprobs"])):
        if len(toks) != TOKENS:
            return f"prompt {i}: {len(toks)} tokens, expected {TOKENS}"
        s = ev["sensitivity"][i]
        if s > FLIP_MAX_SENSITIVITY:
            return (
                f"prompt {i}: float rounding alone moves the reference by {s:.3f} nats "
                f"(judged up to {FLIP_MAX_SENSITIVITY})"
            )
        for j in range(TOKENS):
            gap, dlp = ev["gaps"][i][j], abs(lps[j] - ev["logprobs"][i][j])
            if gap > 2 * s + LOGPROB_ATOL:
                return (
                    f"prompt {i} token {j}: chose {toks[j]}, {gap:.4f} nats below the fp32 "
                    f"reference's best, beyond its rounding sensitivity (2 x {s:.2e})"
                )
            if dlp > s + LOGPROB_ATOL:
                return (
                    f"prompt {i} token {j}: logprob {dlp:.4f} nats off the fp32 reference's, "
                    f"beyond its rounding sensitivity ({s:.2e})"
                )
    return None


def flip_note(why: str, ev: dict[str, list]) -> str:
    """The note of a cell judged "ok" by the flip rule: where it parted, and the figures."""
    s = max(ev["sensitivity"])
    worst = max(x for g in ev["gaps"] for x in g)
    return (
        f"rounding flip of the fp32 reference ({why}): largest gap {worst:.2f} nats <= 2 x its "
        f"rounding sensitivity S = {s:.2f}"
    )


def judge_fp32(res: dict, model_dir: str, scheme: str) -> tuple[str, str]:
    """The token-for-token rule (model_matrix.judge), then the fp32 flip rule where it fails."""
    from hf_reference import hf_greedy

    status, why = judge(res, hf_greedy(model_dir, scheme, PROMPTS, TOKENS))
    if status != "mismatch":
        return status, why
    ev = flip_evidence(model_dir, scheme, res["tokens"])
    flip = flip_mismatch(res, ev)
    if flip is None:
        return "ok", flip_note(why, ev)
    return "mismatch", f"{why}; not a rounding flip: {flip}"


def mean_gap(gaps: list[list[float]]) -> float:
    flat = [x for g in gaps for x in g]
    return sum(flat) / len(flat)


def broken_engines(models: dict[str, str], results: dict, arch: str, scheme: str) -> dict:
    """Results a broken engine serving `arch` with `scheme` would give: another model's
    (the same scheme's cell of another architecture) and the fp32 reference's greedy with a
    deliberately wrong weight (flip_reference.wrong_weight_model)."""
    from flip_reference import greedy_with_logprobs, wrong_weight_model

    others = [a for a in GRID_ARCHS if a != arch and a not in MLA_ARCHS]
    out = {
        f"another model ({other})": res
        for other in others[:1]
        if not (res := results.get(f"grid-{scheme}-{other}", {"error": "no result"})).get("error")
    }
    for wrong in ("scale2", "shard-global-scale"):
        model = wrong_weight_model(models[arch], scheme, wrong)
        runs = [greedy_with_logprobs(model, p, TOKENS) for p in PROMPTS]
        out[wrong] = {"tokens": [t for t, _ in runs], "logprobs": [lp for _, lp in runs]}
    return out


def flip_controls(models: dict[str, str], results: dict) -> dict[str, dict[str, str | None]]:
    """For every cell EXPECTED_GRID judges by the flip rule: the rule on broken_engines'
    results (each must fail: a reason, not None)."""
    out = {}
    for (arch, scheme), (status, phrase) in EXPECTED_GRID.items():
        if status != "ok" or "rounding flip" not in phrase:
            continue
        engines = broken_engines(models, results, arch, scheme)
        out[f"{arch} {scheme}"] = {
            name: flip_mismatch(res, flip_evidence(models[arch], scheme, res["tokens"]))
            for name, res in engines.items()
        }
    return out


def expected_grid(arch: str, scheme: str) -> tuple[str, str]:
    return EXPECTED_GRID.get((arch, scheme), ("ok", ""))


def run_grid(root: Path, env: dict) -> dict[str, Any]:
    """Build, serve and judge the grid and the bf16 runs; returns {"grid": ..., "bf16": ...,
    "flip_controls": ...} (the last: flip_controls, not written to the committed file)."""
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
                status, why = judge_fp32(res, models[arch], scheme)
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
        with gpt_oss_experts_fake_quant():  # gpt-oss's experts; other models unchanged
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
        "flip_controls": flip_controls(models, results),
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
