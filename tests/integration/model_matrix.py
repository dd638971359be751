"""The architecture coverage matrix: build, run and judge, shared by the test and the script.

One tiny random checkpoint per architecture of `tiny_models.ARCHS` (bf16 on disk), served
by vLLM in fp32 with `--quantization mxfp4-mbs` (online) and from an `mxplus quantize`
checkpoint (pre-quantized, no flag); every engine runs in ONE driver process (vllm_driver.py)
because engine start-up dominates on a 2-core box. Each run is judged against the
transformers fake-quant reference (hf_reference.py) with the rule of `integration_harness.greedy_mismatch`;
MLA architectures (mla_judge.MLA_ARCHS) run with mla_judge.ENGINE_OPTIONS and are judged by
mla_judge.judge_mla (float64 reference) instead. One prompt is longer than every sliding window.
This is the CI subset; every other scheme, and bf16, are matrix_grid.py's (slow).

The results go to docs/model_matrix.json (committed); scripts/supported_models.py renders
the README "Supported models" table from it.

gpt-oss: transformers' GptOssExperts are fake-quantized by hf_gpt_oss.py, online and for
`mxplus quantize` checkpoints (whose [E, K, N] expert stacks are quantized transposed:
checkpoint/rules.py, served by integration/gpt_oss_model.py).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from hf_gpt_oss import gpt_oss_experts_fake_quant
from integration_harness import greedy_mismatch, run_driver
from mla_judge import ENGINE_OPTIONS, MLA_ARCHS, judge_mla
from tiny_models import ARCHS, build_tiny, prequantize, word_ids

REPO = Path(__file__).resolve().parents[2]
MATRIX_JSON = REPO / "docs" / "model_matrix.json"
SCHEME = "mxfp4-mbs"
# Token ids: transformers forces its own tokenizer class for some model types (Qwen2's
# byte-level BPE), which cannot encode the word-level test vocabulary.
# The widest sliding window of the matrix's architectures (gemma2 / gemma3 / gpt_oss: 16).
MAX_SLIDING_WINDOW = max(a.config.get("sliding_window") or 0 for a in ARCHS.values())
# Longer than every sliding window, so the windowed layers drop keys while they prefill and
# decode (a plugin or model error that only shows past the window shows here).
LONG_PROMPT = word_ids(
    "the river of paris is blue and the sky of france is green . one two three four five "
    "six seven eight nine ten : who was the star of the world ? the moon"
)
PROMPTS = [
    word_ids("the capital of france is"),
    word_ids("hello world"),
    word_ids("one two three four five"),
    LONG_PROMPT,
]
TOKENS = 12
KINDS = ("online", "prequantized")

# Architectures also served WITHOUT quantization and judged like the quantized runs: where
# even that fails, the quantized comparison cannot judge the plugin, and the row says
# "reference-differs" with the unquantized numbers. MLA_ARCHS (DeepSeek-V2) are served with
# mla_judge.ENGINE_OPTIONS and judged against mla_reference.py (mla_judge.py says why).
CONTROL = ("deepseek_v2",)

# Outcomes other than "ok" that the matrix expects, with a phrase of the error. Anything
# else that is not "ok" fails the test.
EXPECTED: dict[tuple[str, str], tuple[str, str]] = {}
# What a passing row should say beyond "yes".
OK_NOTES: dict[tuple[str, str], str] = {}


def build_all(root: Path, archs: list[str]) -> dict[str, dict[str, str]]:
    """arch -> {"src": bf16 checkpoint, "prequantized": `mxplus quantize` output}."""
    out = {}
    for i, arch in enumerate(archs):
        src = build_tiny(arch, root / arch, seed=i)
        out[arch] = {
            "src": str(src),
            "prequantized": str(prequantize(src, root / f"{arch}-{SCHEME}", SCHEME)),
        }
    return out


def jobs_for(models: dict[str, dict[str, str]]) -> list[dict]:
    jobs = []
    for arch, m in models.items():
        options = ENGINE_OPTIONS if arch in MLA_ARCHS else {}
        for kind in KINDS:
            jobs.append(
                {
                    "id": f"{kind}-{arch}",
                    "dtype": "float32",
                    "prompts": PROMPTS,
                    "max_tokens": TOKENS,
                    "model": m["src"] if kind == "online" else m["prequantized"],
                    "quantization": SCHEME if kind == "online" else None,
                    **options,
                }
            )
        if arch in CONTROL:
            jobs.append(
                {
                    "id": f"control-{arch}",
                    "dtype": "float32",
                    "prompts": PROMPTS,
                    "max_tokens": TOKENS,
                    "model": m["src"],
                    "quantization": None,
                    **options,
                }
            )
    return jobs


def judge(res: dict, ref: tuple[list[list[int]], list[list[float]]]) -> tuple[str, str]:
    """("ok", "") or (status, reason). The rule of `integration_harness.greedy_mismatch`:
    tokens identical and |dlogprob| <= LOGPROB_ATOL up to a rare 4-bit rounding flip, which
    leaves at least half the prompts token-identical and never comes at the first token (a real
    bug breaks every prompt there)."""
    if res.get("error"):
        return _classify_error(res["error"]), _short(res["error"])
    why = greedy_mismatch(res, *ref, TOKENS)
    return ("ok", "") if why is None else ("mismatch", why)


def _classify_error(err: str) -> str:
    return "refused" if "vllm-mxplus" in err or "mxplus" in err.split(":", 1)[0] else "error"


def _short(err: str) -> str:
    """First line, without temporary paths (the committed matrix must be reproducible)."""
    line = err.strip().splitlines()[0]
    return re.sub(r"/\S*/", "", line)[:300]


def reference(src: str) -> tuple[list[list[int]], list[list[float]]]:
    """transformers with the scheme's fake quantization (gpt-oss's experts too)."""
    from hf_reference import hf_greedy

    with gpt_oss_experts_fake_quant():
        return hf_greedy(src, SCHEME, PROMPTS, TOKENS)


def run_matrix(root: Path, env: dict, archs: list[str] | None = None) -> dict[str, Any]:
    """Build, serve and judge every architecture; returns the matrix document."""
    from hf_reference import hf_greedy

    archs = list(archs or ARCHS)
    t0 = time.time()
    models = build_all(root / "models", archs)
    results, log = run_driver(jobs_for(models), root, env, timeout=1800)
    t_vllm = time.time() - t0
    doc: dict[str, Any] = {"scheme": SCHEME, "prompts": len(PROMPTS), "tokens": TOKENS, "archs": {}}
    for arch in archs:
        a = ARCHS[arch]
        row: dict[str, Any] = {
            "architecture": a.model_cls,
            "what": a.what,
            "hidden_size": a.config["hidden_size"],
        }
        control = ""
        if arch in CONTROL:
            res = results.get(f"control-{arch}", {"error": "no result (driver crashed)"})
            if res.get("error"):
                status, why = judge(res, ([], []))
            elif arch in MLA_ARCHS:
                status, why = judge_mla(res, models[arch]["src"], None, PROMPTS, TOKENS)
            else:
                status, why = judge(res, hf_greedy(models[arch]["src"], None, PROMPTS, TOKENS))
            row["unquantized"] = status
            if status != "ok":
                control = f"vLLM and transformers differ without quantization: {why}"
        ref: tuple[list[list[int]], list[list[float]]] | None = None
        for kind in KINDS:
            res = results.get(f"{kind}-{arch}", {"error": "no result (driver crashed)"})
            if res.get("error"):
                status, why = judge(res, ([], []))
            elif arch in MLA_ARCHS:  # the bf16 source for the prequantized kind too
                status, why = judge_mla(res, models[arch]["src"], SCHEME, PROMPTS, TOKENS)
            else:
                ref = ref or reference(models[arch]["src"])
                status, why = judge(res, ref)
            if control and not res.get("error"):
                status, why = "reference-differs", control
            if status == "ok":
                why = OK_NOTES.get((arch, kind), "")
            row[kind] = status
            if why:
                row[f"{kind}_note"] = why
        doc["archs"][arch] = row
    doc["seconds"] = {"build_and_vllm": round(t_vllm, 1), "total": round(time.time() - t0, 1)}
    (root / "log.txt").write_text(log)
    return doc


def expected_status(arch: str, kind: str) -> tuple[str, str]:
    return EXPECTED.get((arch, kind), ("ok", ""))


# Sections of docs/model_matrix.json written by the slow grid (matrix_grid.py), kept as they
# are when the CI matrix rewrites the rest.
GRID_SECTIONS = ("grid", "bf16")


def write_matrix(doc: dict[str, Any], path: Path = MATRIX_JSON) -> None:
    """The committed form: statuses and notes, no timings (they vary run to run); the grid's
    sections of the committed file stay."""
    old = json.loads(path.read_text()) if path.exists() else {}
    keep = {k: v for k, v in doc.items() if k != "seconds" and k not in GRID_SECTIONS}
    keep.update({k: old[k] for k in GRID_SECTIONS if k in old})
    path.write_text(json.dumps(keep, indent=2) + "\n")


def update_sections(sections: dict[str, Any], path: Path = MATRIX_JSON) -> None:
    """Replace the grid's sections (GRID_SECTIONS) of the committed file, nothing else."""
    doc = json.loads(path.read_text())
    doc.update({k: sections[k] for k in GRID_SECTIONS})
    path.write_text(json.dumps(doc, indent=2) + "\n")
