"""Judging MLA (DeepSeek-V2-class) models numerically: engine options, reference and rule.

The transformers reference cannot judge MLA on vLLM 0.32's CPU build because vLLM itself is
off there: its CPU `rotary_embedding` op misrotates MLA's multi-head q_pe (`RoPE_NATIVE`),
which moved first-token logprobs by up to 0.07 nats without quantization and flipped tokens
with it. Engines judged here run with vLLM's torch rotary instead (`ENGINE_OPTIONS`), and are
compared with mla_reference.py (float64, vLLM's MLA formulation, the plugin's quantization
points) by the rule every integration test uses (`integration_harness.greedy_mismatch`):
tokens identical and |dlogprob| <= LOGPROB_ATOL until a rare 4-bit rounding flip, which may
part one prompt at most and never at the first token.

Why LOGPROB_ATOL (1e-4 nats) holds for MLA: the reference is float64 and quantizes the same
fp32 values, so before a flip the two differ by vLLM's fp32 rounding alone; the unquantized
control measures that rounding on the same model (`rounding_floor`), and the tests require it
to stay below LOGPROB_ATOL / ROUNDING_HEADROOM. A plugin error in MLA (kv_b_proj's input
quantized, the weight absorbed from another W_hat, a wrong format) moves the first token of
every prompt by far more (test_mla_judged.py measures the kv_b_proj case).
"""

from __future__ import annotations

from pathlib import Path

from integration_harness import LOGPROB_ATOL, greedy_mismatch
from mla_reference import mla_greedy

from vllm_mxplus.formats import MACRO_BLOCK
from vllm_mxplus.integration.mla import CPU_ROPE_FIX

# Architectures of tiny_models.ARCHS judged by this module instead of transformers.
MLA_ARCHS = ("deepseek_v2",)
# vLLM 0.32's CPU `rotary_embedding` op rotates a 3-D query [tokens, heads, rope_dim] as
# tokens x heads rows of ONE head each, row t*heads + h at positions[t*heads + h] (past the
# step's own positions for most rows), while the 1-head key is rotated right. DeepSeek-V2's
# MLA passes exactly such a query (`q[..., qk_nope_head_dim:]`, vllm/model_executor/layers/
# mla.py), so on CPU almost every head's q_pe is rotated at a wrong position, with or without
# quantization. The judged engines run with that op off: vLLM's own torch rotary
# (`forward_native`), in compilation_config.custom_ops syntax.
RoPE_NATIVE = {"custom_ops": ["all", CPU_ROPE_FIX]}
# vLLM's reference CPU MLA backend (`CPU_MLA`: any dtype, block size 16), named so that the
# judged engines are the same on every CPU: on a CPU with AMX tiles (torch.cpu.
# _is_amx_tile_supported, i.e. cpuinfo's amx_tile) vLLM 0.32 otherwise picks its AMX MLA
# backend (vllm/v1/attention/backends/mla/amx_mla.py), which takes bf16 only and refuses these
# fp32 engines at load ("expect weight to be bfloat16, float16, int8, ..."), unquantized too.
REFERENCE_MLA_BACKEND = {"backend": "CPU_MLA"}
# Job keys every judged MLA engine gets (vllm_jobs forwards them to vllm.LLM).
ENGINE_OPTIONS = {"compilation_config": RoPE_NATIVE, "attention_config": REFERENCE_MLA_BACKEND}
# The unquantized control's fp32-vs-float64 gap must leave this factor below LOGPROB_ATOL.
ROUNDING_HEADROOM = 10.0


def mla_job(
    job_id: str,
    model: str | Path,
    quantization: str | None,
    prompts: list[list[int]],
    max_tokens: int,
) -> dict:
    """A driver job (vllm_jobs keys) for an MLA engine: fp32, the judged engine options."""
    return {
        "id": job_id,
        "model": str(model),
        "quantization": quantization,
        "dtype": "float32",
        "prompts": prompts,
        "max_tokens": max_tokens,
        **ENGINE_OPTIONS,
    }


def rounding_floor(res: dict, ref: tuple[list[list[int]], list[list[float]]]) -> float:
    """Largest |dlogprob| between a result and a reference over the positions before their
    tokens first differ (every prompt): for the unquantized control, vLLM's fp32 rounding."""
    worst = 0.0
    for toks, lps, rtoks, rlps in zip(res["tokens"], res["logprobs"], *ref):
        for t, lp, rt, rlp in zip(toks, lps, rtoks, rlps):
            worst = max(worst, abs(lp - rlp))
            if t != rt:
                break
    return worst


def judge_mla(
    res: dict,
    model_dir: str | Path,
    scheme: str | None,
    prompts: list[list[int]],
    max_tokens: int,
    macro_block: int = MACRO_BLOCK,
) -> tuple[str, str]:
    """("ok", "") or (status, why) for a driver result of an MLA engine run with
    ENGINE_OPTIONS on the bf16 checkpoint model_dir (online `--quantization scheme`, a
    `mxplus quantize` checkpoint of it, or unquantized: scheme None), against the float64
    reference; statuses as model_matrix.judge ("error" for a failed engine)."""
    if res.get("error"):
        return "error", res["error"].strip().splitlines()[0][:300]
    ref = mla_greedy(model_dir, scheme, prompts, max_tokens, macro_block)
    why = greedy_mismatch(res, *ref, max_tokens)
    return ("ok", "") if why is None else ("mismatch", why)


__all__ = [
    "ENGINE_OPTIONS",
    "LOGPROB_ATOL",
    "MLA_ARCHS",
    "ROUNDING_HEADROOM",
    "judge_mla",
    "mla_job",
    "rounding_floor",
]
