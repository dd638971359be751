"""Shared helpers and fixtures of tests/integration (imported by conftest.py and the tests;
a uniquely named module, because `from conftest import ...` can resolve to another
directory's conftest).

Every engine the generation tests need runs in one `vllm_mxplus.evaluation.vllm_jobs` process
(engines built one after another), because process start-up dominates on a 2-core CI box.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from repo_scripts import load_repo_script

from vllm_mxplus.formats import MACRO_BLOCK, SCHEMES

HERE = Path(__file__).parent
VLLM_JOBS = "vllm_mxplus.evaluation.vllm_jobs"  # the job driver (python -m)
PROMPTS = ["the capital of france is", "hello world", "one two three four five"]
MAX_TOKENS = 32
# Pre-quantized checkpoints tested through vLLM: one per tensor set of the layout (E8M0
# block 32; MX+ block-max index; E8M0 block 16 + MBS bytes; NVFP4 e4m3 + global scales).
# mxfp4-16-oas and mxfp4-mbs-s store the same tensor sets as mxfp4-ocp (block 16) / mxfp4-mbs.
PRE_SCHEMES = ["mxfp4-ocp", "mxplus", "mxfp4-mbs", "nvfp4"]
SMOOTH = {"smooth": 0.5, "nsamples": 4, "seqlen": 24}  # `mxplus quantize --smooth` job
MB32 = 32  # `mxplus quantize --macro-block 32` job


def smoothed_copy(src: str, dst: Path, calib: Path) -> Path:
    """src with the smoothing of `mxplus quantize --smooth` folded in, saved unquantized:
    the model the transformers reference runs for the smoothed checkpoint."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from vllm_mxplus.calibration.data import calibration_tokens
    from vllm_mxplus.calibration.smoothing import input_absmax, smooth_model

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tokens = calibration_tokens(src, calib, SMOOTH["nsamples"], SMOOTH["seqlen"])
    dtypes = {n: torch.bfloat16 for n, _ in model.named_parameters()}  # the tiny models' dtype
    smooth_model(model, input_absmax(model, tokens, "cpu"), SMOOTH["smooth"], dtypes)
    model.to(torch.bfloat16).save_pretrained(dst, safe_serialization=True)
    for f in Path(src).glob("*token*"):
        shutil.copy2(f, dst / f.name)
    return dst


def build_models(root: Path) -> dict[str, str]:
    """Build every checkpoint the integration tests use; returns name -> directory."""
    from tiny_models import POISON, WORDS, build_tiny_llama, prequantize, tamper_checkpoint

    m: dict[str, str] = {}
    m["tiny256"] = str(build_tiny_llama(root / "tiny256", poison=True))
    # hidden 320 / intermediate 576: partial macro blocks (K % 128 = 64) in every linear.
    m["tiny320"] = str(
        build_tiny_llama(
            root / "tiny320", hidden=320, intermediate=576, heads=5, kv_heads=1, seed=1
        )
    )
    # pre-quantized checkpoints: the offline quantizer's own code path (`mxplus quantize`)
    for scheme in PRE_SCHEMES:
        m[f"tiny256-{scheme}"] = str(prequantize(m["tiny256"], root / f"q256-{scheme}", scheme))
    m["tiny320-mxfp4-mbs"] = str(prequantize(m["tiny320"], root / "q320-mbs", "mxfp4-mbs"))
    # --smooth: the checkpoint, and the smoothed bf16 model the reference runs
    calib = root / "calib.txt"
    calib.write_text(" ".join(w for w in WORDS * 4 if w != POISON))
    m["tiny256-sq"] = str(
        prequantize(m["tiny256"], root / "q256-sq", "mxfp4-mbs", calib=calib, **SMOOTH)
    )
    m["tiny256-smoothed"] = str(smoothed_copy(m["tiny256"], root / "tiny256-smoothed", calib))
    # --macro-block 32: MBS bytes per 32 elements of weights and activations
    m["tiny256-mb32"] = str(
        prequantize(m["tiny256"], root / "q256-mb32", "mxfp4-mbs", macro_block=MB32)
    )
    m["bad-missing"] = str(
        tamper_checkpoint(
            prequantize(m["tiny256"], root / "bad-missing", "mxfp4-mbs"),
            drop=["model.layers.0.self_attn.k_proj.weight_scale"],
        )
    )
    m["bad-shape"] = str(
        tamper_checkpoint(
            prequantize(m["tiny256"], root / "bad-shape", "mxfp4-mbs"),
            reshape={"model.layers.1.mlp.down_proj.weight_scale": [256, 7]},
        )
    )
    return m


# W4A4 makes greedy decoding of a random tiny model chaotic (docs/numerics.md, QSNR): vLLM and
# transformers differ by fp32 accumulation order (~1e-6 nats on the chosen tokens), and now
# and then that noise moves one activation across a 4-bit rounding boundary (a "flip"), after
# which logprobs jump by ~0.1 nats and the sequences may part. So the rule is:
# - before the first flip, tokens are identical and |dlogprob| <= LOGPROB_ATOL;
# - at least half the prompts have no flip at all: every token identical.
# A real bug (wrong scale, misplaced shard, wrong format) breaks every prompt at step 0; one
# in the decode path alone (M = 1) breaks every prompt at step 1. How many prompts flip is a
# property of the host's fp32 GEMM order: the tiny Mistral of the model matrix flips 1 of 4
# on an Intel Xeon and 2 of 4 on an AMD EPYC Zen 3 (both at a step > 0, tokens unchanged,
# logprobs 0.06 and 0.13 nats apart), at this commit and before.
LOGPROB_ATOL = 1e-4  # nats; observed <= 2.4e-6 before a flip


def greedy_mismatch(
    res: dict, ref_tokens: list[list[int]], ref_lps: list[list[float]], n_tokens: int
) -> str | None:
    """None when a driver result's greedy tokens and logprobs (every prompt, n_tokens each)
    pass the flip rule above against the reference's; else why not."""
    identical = 0
    for i, (toks, lps) in enumerate(zip(res["tokens"], res["logprobs"])):
        if len(toks) != n_tokens:
            return f"prompt {i}: {len(toks)} tokens, expected {n_tokens}"
        flip = next(
            (
                j
                for j in range(n_tokens)
                if toks[j] != ref_tokens[i][j] or abs(lps[j] - ref_lps[i][j]) > LOGPROB_ATOL
            ),
            n_tokens,
        )
        if flip == 0:
            return (
                f"prompt {i} differs at the first token: {toks[0]} vs {ref_tokens[i][0]}, "
                f"logprob {lps[0]:.6f} vs {ref_lps[i][0]:.6f}"
            )
        identical += flip == n_tokens
    if 2 * identical < len(ref_tokens):
        return f"only {identical}/{len(ref_tokens)} prompts token-identical to the reference"
    return None


def load_script(name: str) -> ModuleType:
    """scripts/NAME.py as a module (see repo_scripts.load_repo_script)."""
    return load_repo_script(f"scripts/{name}.py")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    return build_models(tmp_path_factory.mktemp("models"))


def run_driver(
    jobs: list[dict],
    workdir: Path,
    env: dict,
    tp: bool = False,
    timeout: int = 900,
    multiprocess: bool = False,
) -> tuple[dict, str]:
    """Run vllm_mxplus.evaluation.vllm_jobs on jobs; returns (results by id, combined log text).
    tp: one core per rank; multiprocess: vLLM's default layout (engine core in a spawned
    child); otherwise every engine runs in the driver process, one after another."""
    jobs_file, out_file, log_file = (workdir / n for n in ("jobs.json", "out.json", "log.txt"))
    jobs_file.write_text(json.dumps(jobs))
    env = dict(env)
    if tp:
        env["VLLM_CPU_OMP_THREADS_BIND"] = (
            "0|1"  # one core per rank (vLLM CPU needs one NUMA/core binding per rank)
        )
    elif multiprocess:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engines in-process, one after another
    with open(log_file, "w") as log:
        subprocess.run(
            [sys.executable, "-m", VLLM_JOBS, str(jobs_file), str(out_file)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            check=False,
        )
    results = json.loads(out_file.read_text()) if out_file.exists() else {}
    return results, log_file.read_text(errors="replace")


def gen_job(job_id: str, model: str, quantization: str | None, tp: int = 1, **keys: Any) -> dict:
    """A greedy fp32 driver job over PROMPTS; `keys`: other job keys or replacements (see
    vllm_mxplus.evaluation.vllm_jobs), e.g. prompts=..., max_tokens=..., hf_overrides=..."""
    return {
        "id": job_id,
        "model": model,
        "quantization": quantization,
        "dtype": "float32",
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "tp": tp,
        **keys,
    }


@pytest.fixture(scope="session")
def driver_run(tiny_models, tmp_path_factory, subprocess_env) -> tuple[dict, str]:
    """All single-process engines of test_vllm_generate.py, in one driver process."""
    m = tiny_models
    jobs = []
    for scheme in SCHEMES:
        jobs.append(gen_job(f"online-{scheme}", m["tiny256"], scheme))
    for scheme in PRE_SCHEMES:
        jobs.append(gen_job(f"pre-{scheme}", m[f"tiny256-{scheme}"], None))
    jobs.append(gen_job("compiled-mxfp4-mbs", m["tiny256"], "mxfp4-mbs", eager=False))
    jobs.append(gen_job("online320-mxfp4-mbs", m["tiny320"], "mxfp4-mbs"))
    jobs.append(gen_job("pre320-mxfp4-mbs", m["tiny320-mxfp4-mbs"], None))
    jobs.append(gen_job("pre-sq-mxfp4-mbs", m["tiny256-sq"], None))
    jobs.append(gen_job("pre-mb32-mxfp4-mbs", m["tiny256-mb32"], None))
    # online quantization at macro block 32, the option passed as vLLM users pass a
    # quantization method's options: a quantization_config through --hf-overrides
    opts = {"quant_method": "mxfp4-mbs", "macro_block_size": MB32}
    jobs.append(
        gen_job(
            "online-mb32-mxfp4-mbs",
            m["tiny256"],
            "mxfp4-mbs",
            hf_overrides={"quantization_config": opts},
        )
    )
    jobs.append(
        gen_job(
            "bad-option",
            m["tiny256"],
            "mxfp4-mbs",
            hf_overrides={"quantization_config": {**opts, "macro_block": 64}},
        )
    )
    jobs.append(gen_job("bad-missing", m["bad-missing"], None))
    jobs.append(gen_job("bad-shape", m["bad-shape"], None))
    jobs.append(gen_job("bad-flag", m["tiny256-mxfp4-mbs"], "nvfp4"))
    jobs.append(gen_job("bad-name", m["tiny256"], "mxfp4-bogus"))
    return run_driver(jobs, tmp_path_factory.mktemp("driver"), subprocess_env)


_HF_CACHE: dict = {}


def hf_reference(
    model_dir: str, scheme: str, macro_block: int = MACRO_BLOCK
) -> tuple[list[list[int]], list[list[float]]]:
    """Cached transformers greedy reference with FakeQuantLinear modules (fp32)."""
    from hf_reference import hf_greedy

    key = (model_dir, scheme, macro_block)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = hf_greedy(model_dir, scheme, PROMPTS, MAX_TOKENS, macro_block=macro_block)
    return _HF_CACHE[key]
