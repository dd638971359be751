"""`mxplus quantize --smooth ALPHA` (calibration/smoothing.py): the folds keep the model's
function, the checkpoint holds W*s and norm/s consistently, outlier channels get easier to
quantize, and bad requests are refused with the option named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_helpers import cli_args, make_llama, source_tensors

from vllm_mxplus.calibration.smoothing import input_absmax, smooth_model
from vllm_mxplus.checkpoint import load, quantize_checkpoint
from vllm_mxplus.checkpoint.cli_quantize import run
from vllm_mxplus.errors import UsageError
from vllm_mxplus.formats import fake_quantize, qsnr

ALPHA = 0.5


def _model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _tokens(n: int = 4, t: int = 16) -> torch.Tensor:
    return torch.randint(0, 96, (n, t), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def llama2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layers, grouped-query attention (2 query heads share 1 KV head)."""
    return make_llama(tmp_path_factory.mktemp("src") / "llama2", layers=2, seed=3)


def test_folds_keep_the_function(llama2: Path) -> None:
    model, ref = _model(llama2), _model(llama2)
    ids = _tokens()
    fp32 = {n: torch.float32 for n, _ in model.named_parameters()}
    changed = smooth_model(model, input_absmax(model, ids, "cpu"), ALPHA, fp32)
    # every fold site of both layers: 2 norms, q/k/v/gate/up/down/o, up and v rows
    assert len(changed) == 2 * 9
    params = dict(model.named_parameters())
    for name in changed:  # not a no-op
        assert not torch.equal(params[name], dict(ref.named_parameters())[name]), name
    with torch.no_grad():
        want, got = ref(input_ids=ids).logits, model(input_ids=ids).logits
    # the same function in exact arithmetic; fp32 rounding of the rescaled tensors only
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_checkpoint_holds_consistent_smoothed_tensors(
    llama_dir: Path, tmp_path: Path, random_tokens: None
) -> None:
    dst = tmp_path / "sq"
    quantize_checkpoint(llama_dir, dst, "mxfp4-mbs", smooth=ALPHA, nsamples=4, seqlen=16)
    calib = json.loads((dst / "config.json").read_text())["quantization_config"]["calibration"]
    assert calib["method"] == "rtn" and calib["smoothing"] == {"alpha": ALPHA}
    src, out, q = source_tensors(llama_dir), source_tensors(dst), load(dst)
    p = "model.layers.0."
    # (norm, a linear whose only fold is the norm's: v_proj and up_proj rows fold too)
    for norm, lin in (
        ("input_layernorm", "self_attn.q_proj"),
        ("post_attention_layernorm", "mlp.gate_proj"),
    ):
        norm_out = out[f"{p}{norm}.weight"]
        assert norm_out.dtype == src[f"{p}{norm}.weight"].dtype  # bf16 kept
        s = src[f"{p}{norm}.weight"].float() / norm_out.float()  # the factor, read back
        assert not torch.allclose(s, torch.ones_like(s), atol=1e-2)
        w_hat, w = q[p + lin].dequantize(), src[f"{p}{lin}.weight"].float()
        # the stored weight encodes W * s (as well as RTN encodes any weight), not W
        assert qsnr(w * s, w_hat) > 15.0, lin
        assert qsnr(w, w_hat) < 0.0, lin


def test_smoothing_helps_an_outlier_channel(llama2: Path) -> None:
    """An activation channel 64x the others (as LLMs have): smoothing moves it into the
    weights, and the first layer's W4A4 output error falls."""
    ids = _tokens(8)
    errs = []
    for smooth in (False, True):
        model = _model(llama2)
        with torch.no_grad():
            model.model.layers[0].input_layernorm.weight[5] *= 64.0
        if smooth:
            fp32 = {n: torch.float32 for n, _ in model.named_parameters()}
            smooth_model(model, input_absmax(model, ids, "cpu"), ALPHA, fp32)
        attn = model.model.layers[0].self_attn
        x = _linear_input(model, attn.q_proj, ids)
        w = attn.q_proj.weight
        exact = x @ w.T
        approx = fake_quantize(x, "mxfp4-mbs-s") @ fake_quantize(w, "mxfp4-mbs-d").T
        errs.append(float((approx - exact).square().sum() / exact.square().sum()))
    assert errs[1] < 0.8 * errs[0], errs


def _linear_input(
    model: torch.nn.Module, linear: torch.nn.Module, ids: torch.Tensor
) -> torch.Tensor:
    """The activation rows ``linear`` sees when ``model`` runs on ``ids``."""
    seen: list[torch.Tensor] = []
    h = linear.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        h.remove()
    return seen[0].reshape(-1, seen[0].shape[-1])


def test_refusals_name_the_option(llama_dir: Path, tmp_path: Path, capsys) -> None:  # noqa: ANN001
    assert run(cli_args(str(llama_dir), str(tmp_path / "a"), "--smooth", "1.5")) == 2
    assert "--smooth 1.5" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    model = _model(llama_dir)
    model.config.model_type = "gemma"  # its norms scale by (1 + weight): no fold defined
    with pytest.raises(UsageError, match="model type 'gemma' is not supported"):
        smooth_model(model, {}, ALPHA, {})


def test_a_fold_that_would_overflow_is_refused(llama_dir: Path) -> None:
    model = _model(llama_dir)
    ids = _tokens()
    amax = input_absmax(model, ids, "cpu")
    amax["0.self_attn.q_proj"][7] = 0.0  # a dead channel: s at its floor, norm / s huge
    fp16 = {n: torch.float16 for n, _ in model.named_parameters()}
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight[7] = 60000.0
    with pytest.raises(UsageError, match="input_layernorm.weight would not be finite"):
        smooth_model(model, amax, ALPHA, fp16)
