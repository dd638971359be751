"""The lm_head's fp32 GEMM on CPUs without native bf16 (vllm_mxplus/integration/lm_head.py).

The unit tests build vLLM layers (`disable_tp`, no engine); the last test serves a tiny
model through vLLM with VLLM_MXPLUS_CPU_LM_HEAD_FP32=0 and =1.

The numerics. x and W hold bf16 (or fp16) values; the reference is the float64 product
`ref = x @ W.T (+ b)`, exact to far below what is measured. bf16 x bf16 (8-bit significands)
and fp16 x fp16 (11-bit) products are exact in fp32 (24-bit significand), so the fp32 GEMM
only rounds its additions: summing n exact terms in fp32, in any order, gives
    |y32 - ref| <= gamma_(n-1) * S,   gamma_m = m u / (1 - m u),   u = 2^-24,
with S = |x| @ |W|.T (+ |b|) (Higham, Accuracy and Stability of Numerical Algorithms, 4.2).
The tests use BOUND = SAFETY * n * u * S (n = K terms, K + 1 with a bias; SAFETY = 2 covers
the 1/(1 - n u) factor and leaves headroom). Observed errors are ~sqrt(K) u S, far below.

Rounded to bf16, y32 and the reference round to the same value unless a bf16 rounding
boundary lies within BOUND of the reference ("uncertain" entries): every other entry of the
method's bf16 output must be exactly `bf16(ref)`. vLLM's own bf16 GEMM also accumulates in
fp32, so its output can differ from ours only at uncertain entries. BOUND is a worst case
(observed errors are ~1e-3 of it), so most entries of a GEMM with K = 576 are "uncertain";
the count of actual differences is held to the typical error instead: entry i differs only
if a boundary of the bf16 grid (spacing s_i there) falls between the two fp32 results, with
probability about (|e_i| + |e'_i|) / s_i; with ours measured (e_i) and vLLM's of the same
order, the expected count is sum(2 |e_i| / s_i), and the test allows 4x that plus 8.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

U32 = 2.0**-24  # fp32 unit roundoff
SAFETY = 2.0
N_VOCAB, K_HIDDEN = 1000, 576  # vocab padded to 1024 by vLLM; SmolLM2's hidden size
ENV = "VLLM_MXPLUS_CPU_LM_HEAD_FP32"
MANTISSA_BITS = {torch.bfloat16: 8, torch.float16: 11}  # significand bits incl. the leading 1


@pytest.fixture(scope="module")
def configs():
    import vllm_mxplus

    vllm_mxplus.register()
    from vllm_mxplus.integration.config import CONFIG_CLASSES

    return CONFIG_CLASSES


def _lm_head(qc, dtype=torch.bfloat16, bias=False, seed=0):
    """A ParallelLMHead (no TP) with random weights of `dtype` (and bias) loaded."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    layer = ParallelLMHead(
        N_VOCAB,
        K_HIDDEN,
        bias=bias,
        params_dtype=dtype,
        quant_config=qc,
        prefix="lm_head",
        disable_tp=True,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=g).to(dtype))
        if bias:
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=g).to(dtype))
    return layer


def _loaded(layer):
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _round_to(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 `v` rounded once, to nearest even, to `dtype`'s significand (normal range; the
    values here are far from its limits), as float64. (torch's float64 -> bf16 conversion may
    round twice, through fp32.)"""
    m, e = torch.frexp(v)  # v = m * 2^e, 0.5 <= |m| < 1
    bits = MANTISSA_BITS[dtype]
    return torch.ldexp(torch.round(torch.ldexp(m, torch.tensor(bits))), e - bits)


def _reference(layer, x: torch.Tensor, bias: torch.Tensor | None):
    """(ref, BOUND) in float64 for the layer's weight rows (see the module docstring)."""
    w = layer.weight.detach().double()
    x64 = x.double()
    ref, s = x64 @ w.T, x64.abs() @ w.abs().T
    n_terms = x.shape[-1]
    if bias is not None:
        ref, s, n_terms = ref + bias.double(), s + bias.double().abs(), n_terms + 1
    return ref, SAFETY * n_terms * U32 * s


def _inputs(m: int, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, K_HIDDEN, generator=g).to(dtype)


def _force(monkeypatch, value: str | None):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)


# --- (a) numerics ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_accumulation_within_bound(configs, monkeypatch, dtype, bias):
    """fp32 activations holding `dtype` values: the method's output is the fp32 GEMM itself,
    within BOUND of the float64 product of the same values."""
    from vllm_mxplus.integration.lm_head import FP32_ATTR

    _force(monkeypatch, "1")
    layer = _loaded(_lm_head(configs["mxfp4-mbs"](), dtype, bias))
    assert getattr(layer, FP32_ATTR) is not None
    x = _inputs(8, dtype).float()
    b = layer.bias.detach() if bias else None
    y = layer.quant_method.apply(layer, x, bias=b)
    assert y.dtype == torch.float32 and y.shape == (8, layer.weight.shape[0])
    ref, bound = _reference(layer, x, b)
    err = (y.double() - ref).abs()
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"
    assert (err > 0).any()  # a real fp32 GEMM, not a float64 one


@pytest.mark.parametrize("m", [2, 16])
def test_bf16_logits_match_reference_and_vllm(configs, monkeypatch, m):
    """bf16 in, bf16 out: within the rounded BOUND window of the reference, exactly bf16(ref)
    wherever no rounding boundary lies within BOUND, and equal to vLLM's own bf16 method's
    output except at a few such entries (module docstring)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from vllm_mxplus.integration.lm_head import MxplusLMHeadMethod

    _force(monkeypatch, "1")
    ours = _loaded(_lm_head(configs["mxfp4-mbs"]()))
    theirs = _loaded(_lm_head(None))
    assert type(ours.quant_method) is MxplusLMHeadMethod
    assert type(theirs.quant_method) is UnquantizedEmbeddingMethod
    assert torch.equal(ours.weight, theirs.weight)
    x = _inputs(m, torch.bfloat16)
    y = ours.quant_method.apply(ours, x)
    v = theirs.quant_method.apply(theirs, x)
    assert y.dtype == v.dtype == torch.bfloat16 and y.shape == v.shape
    ref, bound = _reference(ours, x, None)
    lo, hi = _round_to(ref - bound, torch.bfloat16), _round_to(ref + bound, torch.bfloat16)
    certain = lo == hi
    y64, v64 = y.double(), v.double()
    assert bool(((lo <= y64) & (y64 <= hi)).all())  # rounding is monotone
    assert torch.equal(y64[certain], _round_to(ref, torch.bfloat16)[certain])
    differ = y64 != v64
    assert not bool((differ & certain).any()), "vLLM and ours differ where both must be exact"
    # How many may differ: entry i differs only if a bf16 rounding boundary lies between the
    # two fp32 results, each off the reference by an fp32 accumulation error. Ours is
    # measured (the same GEMM on the fp32 values of x); vLLM's is of the same order (fp32 sums
    # of the same exact products), so P(differ_i) <~ 2 |e_i| / spacing_i; allow 4x + 8.
    y32 = ours.quant_method.apply(ours, x.float())
    assert torch.equal(y, y32.to(torch.bfloat16))  # the fp32 GEMM, rounded once
    e = (y32.double() - ref).abs()
    spacing = torch.ldexp(torch.ones_like(ref), torch.frexp(ref)[1] - MANTISSA_BITS[y.dtype])
    expected = float((2 * e / spacing).sum())
    assert int(differ.sum()) <= 4 * expected + 8, (int(differ.sum()), expected)


def test_single_row_is_vllms_gemm(configs, monkeypatch):
    """Fewer than MIN_ROWS rows (single-stream decode): vLLM's GEMM, bit for bit."""
    from vllm_mxplus.integration.lm_head import MIN_ROWS

    _force(monkeypatch, "1")
    ours = _loaded(_lm_head(configs["mxfp4-mbs"]()))
    theirs = _loaded(_lm_head(None))
    for shape in [(MIN_ROWS - 1, K_HIDDEN), (K_HIDDEN,)]:
        x = _inputs(1, torch.bfloat16).reshape(shape)
        y = ours.quant_method.apply(ours, x)
        assert torch.equal(y, theirs.quant_method.apply(theirs, x))
        assert y.shape == (*shape[:-1], ours.weight.shape[0])


# --- (b) the setting ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "native", "chosen"),
    [
        (None, False, True),  # auto (unset): fp32 exactly when the CPU lacks native bf16
        (None, True, False),
        ("auto", False, True),
        ("AUTO", True, False),
        ("1", True, True),  # forced either way, whatever the CPU
        ("0", False, False),
    ],
)
def test_setting_chooses(configs, monkeypatch, caplog, value, native, chosen):
    from vllm_mxplus import log_once as log_once_module
    from vllm_mxplus.integration import lm_head

    _force(monkeypatch, value)
    monkeypatch.setattr(lm_head, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(log_once_module, "_SEEN", set())  # log afresh in every case
    with caplog.at_level(logging.INFO, logger="vllm_mxplus"):
        layer = _loaded(_lm_head(configs["mxfp4-mbs"]()))
    gemm = getattr(layer, lm_head.FP32_ATTR)
    assert (gemm is not None) == chosen
    logged = [r.getMessage() for r in caplog.records if "lm_head" in r.getMessage()]
    assert len(logged) == 1, logged
    if chosen:
        mib = layer.weight.numel() * 4 / 2**20
        assert f"{mib:.1f} MiB more memory" in logged[0]
        assert (gemm.n, gemm.k) == tuple(layer.weight.shape)
    else:
        assert "vLLM's bfloat16 GEMM" in logged[0]


@pytest.mark.parametrize("bad", ["2", "yes please", "fp32"])
def test_bad_value_names_the_variable(configs, monkeypatch, bad):
    from vllm_mxplus import settings

    _force(monkeypatch, bad)
    with pytest.raises(ValueError, match=rf"{ENV}=.*expected auto, 0 or 1"):
        settings.cpu_lm_head_fp32()
    with pytest.raises(ValueError, match=ENV):
        _loaded(_lm_head(configs["mxfp4-mbs"]()))


def test_only_half_precision_cpu_weights(configs, monkeypatch):
    """An fp32 model's lm_head is vLLM's path even when forced."""
    from vllm_mxplus.integration.lm_head import FP32_ATTR

    _force(monkeypatch, "1")
    layer = _loaded(_lm_head(configs["mxfp4-mbs"](), torch.float32))
    assert getattr(layer, FP32_ATTR) is None


def test_cpuinfo_probe():
    from vllm_mxplus.integration.lm_head import cpu_has_native_bf16, native_bf16_from_cpuinfo

    icx = "processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni avx512_bitalg\n"
    spr = "flags\t\t: avx512f avx512_bf16 amx_tile amx_bf16 amx_int8\n"
    cpx = "flags\t\t: avx512f avx512_vnni avx512_bf16\n"
    arm = "Features\t: fp asimd sve bf16 i8mm\n"
    assert native_bf16_from_cpuinfo(icx) is False
    assert native_bf16_from_cpuinfo(spr) is True
    assert native_bf16_from_cpuinfo(cpx) is True
    assert native_bf16_from_cpuinfo(arm) is True
    assert native_bf16_from_cpuinfo("processor\t: 0\n") is None
    if os.uname().machine == "x86_64":  # agrees with torch's own probes here
        torch_says = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        assert cpu_has_native_bf16() == torch_says


# --- (c) embeddings are untouched ---------------------------------------------------------


def test_plain_embedding_is_vllms(configs):
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    qc = configs["mxfp4-mbs"]()
    emb = VocabParallelEmbedding(
        N_VOCAB, K_HIDDEN, params_dtype=torch.bfloat16, quant_config=qc,
        prefix="model.embed_tokens", disable_tp=True,
    )  # fmt: skip
    assert qc.get_quant_method(emb, "model.embed_tokens") is None
    assert type(emb.quant_method) is UnquantizedEmbeddingMethod


def test_tied_embedding_keeps_its_weight_and_lookups(configs, monkeypatch):
    """lm_head tied to embed_tokens (vLLM's tie_weights): after loading, the embedding's
    parameter is the same bf16 tensor, its lookups unchanged; the fp32 copy is separate."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    from vllm_mxplus.integration.lm_head import FP32_ATTR, MxplusLMHeadMethod

    _force(monkeypatch, "1")
    qc = configs["mxfp4-mbs"]()
    emb = VocabParallelEmbedding(
        N_VOCAB, K_HIDDEN, params_dtype=torch.bfloat16, quant_config=qc,
        prefix="model.embed_tokens", disable_tp=True,
    )  # fmt: skip
    with torch.no_grad():
        emb.weight.copy_(torch.randn(emb.weight.shape).bfloat16())
    head = _lm_head(qc).tie_weights(emb)
    assert MxplusLMHeadMethod.embedding is UnquantizedEmbeddingMethod.embedding
    param, before = emb.weight, emb.weight.detach().clone()
    ids = torch.tensor([0, 5, 999, 3])
    looked_up = emb(ids)
    for layer in (emb, head):  # as vLLM's loader does, module by module
        _loaded(layer)
    assert head.weight is emb.weight is param and param.dtype == torch.bfloat16
    assert torch.equal(param, before)
    assert torch.equal(emb(ids), looked_up) and torch.equal(looked_up, before[ids])
    assert getattr(head, FP32_ATTR) is not None and not hasattr(emb, FP32_ATTR)
    assert [n for n, _ in head.named_parameters()] == ["weight"]  # no new parameter


# --- (d) served end to end --------------------------------------------------------------

_DRIVER = textwrap.dedent(
    """
    import json, os, sys
    from vllm_mxplus.evaluation.vllm_jobs import run_job
    from vllm_mxplus.integration import lm_head

    calls = [0]  # fp32 GEMM calls (the engines run in this process)
    fp32_gemm = lm_head.Fp32Gemm.__call__

    def counted(self, x32, b32):
        calls[0] += 1
        return fp32_gemm(self, x32, b32)

    lm_head.Fp32Gemm.__call__ = counted
    jobs, out = json.loads(sys.argv[1]), {}
    for job in jobs:  # one process, engines one after another; the setting is read at load
        os.environ["VLLM_MXPLUS_CPU_LM_HEAD_FP32"] = job.pop("lm_head_fp32")
        calls[0] = 0
        out[job["id"]] = dict(run_job(job), fp32_calls=calls[0])
        with open(sys.argv[2], "w") as f:
            json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)  # as vllm_jobs: vLLM 0.32 CPU may abort at interpreter teardown
    """
)


@pytest.mark.vllm
def test_served_tokens_same_with_fp32_lm_head(tmp_path, subprocess_env):
    """A tiny bf16 Llama with tied embeddings, online mxfp4-mbs, greedy: the same tokens and
    nearly the same logprobs with the setting 0 and 1, and the log says which GEMM served.
    Eight prompts, so decode steps have 8 rows (>= MIN_ROWS)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_models import build_tiny_llama

    model = build_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    prompts = [[1 + 37 * i + j for j in range(6 + i)] for i in range(8)]
    job = dict(model=str(model), quantization="mxfp4-mbs", dtype="bfloat16",
               prompts=prompts, max_tokens=6)  # fmt: skip
    jobs = [dict(job, id=f"fp32-{v}", lm_head_fp32=v) for v in ("0", "1")]
    out_file = tmp_path / "out.json"
    env = {**subprocess_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, json.dumps(jobs), str(out_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    log = proc.stdout + proc.stderr
    assert out_file.exists(), log[-3000:]
    res = json.loads(out_file.read_text())
    off, on = res["fp32-0"], res["fp32-1"]
    for r in (off, on):
        assert r.get("error") is None, r.get("trace", r.get("error"))
    assert "lm_head (512, 256): vLLM's bfloat16 GEMM" in log, log[-3000:]
    assert "lm_head (512, 256): fp32 GEMM" in log, log[-3000:]
    assert off["fp32_calls"] == 0
    assert on["fp32_calls"] >= 5  # the decode steps (8 rows each) ran the fp32 GEMM
    assert on["tokens"] == off["tokens"]
    # bf16 logits either way, each off by at most one bf16 step d between the two (module
    # docstring); a chosen token's logprob z_c - logsumexp(z) then moves by <= 2 d. This
    # tiny model's logits are well inside |z| < 16, where d <= 2^-4.
    for a, b in zip(on["logprobs"], off["logprobs"]):
        assert max(abs(p - q) for p, q in zip(a, b)) <= 2 * 2.0**-4
