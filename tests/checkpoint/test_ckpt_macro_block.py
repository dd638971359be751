"""`mxplus quantize --macro-block N`: MBS bytes per N elements, recorded and read back, with
every --method (rtn, rtn-aware, gptq; with or without --smooth)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_helpers import cli_args, source_tensors
from test_ckpt_calibrated import _requantized_codes
from test_ckpt_roundtrip import assert_bitwise_equal

import vllm_mxplus.calibration.rtn_aware as calibration
from vllm_mxplus.backends.reference.linear import fake_quant_activation
from vllm_mxplus.calibration.gptq import gptq
from vllm_mxplus.checkpoint import CheckpointError, load, open_checkpoint, quantize_checkpoint
from vllm_mxplus.checkpoint.cli_quantize import run
from vllm_mxplus.errors import UsageError
from vllm_mxplus.formats import MACRO_BLOCK, QuantizedTensor, fake_quantize, get_scheme, quantize
from vllm_mxplus.formats.e2m1 import unpack_fp4


@pytest.mark.parametrize("scheme", ["mxfp4-mbs", "mxfp4-mbs-s"])
@pytest.mark.parametrize("macro", [16, 32, 64])
def test_weights_quantize_with_the_given_macro_block(
    llama_dir: Path, tmp_path: Path, scheme: str, macro: int
) -> None:
    dst = tmp_path / "q"
    quantize_checkpoint(llama_dir, dst, scheme, macro_block=macro, progress=False)
    qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qcfg["macro_block_size"] == macro
    assert open_checkpoint(dst).macro_block == macro
    fmt = get_scheme(scheme).weight_format
    source = source_tensors(llama_dir)
    got = load(dst)
    for module, q in got.items():
        w = source[f"{module}.weight"]
        assert q.macro_block == macro and q.mbs.shape[-1] == -(-w.shape[-1] // macro)
        assert_bitwise_equal(q.dequantize(), fake_quantize(w, fmt, macro_block=macro), module)
    # a different macro block gives other bytes (the option is not ignored)
    w = source["model.layers.0.mlp.down_proj.weight"]
    assert not fake_quantize(w, fmt, macro_block=macro).equal(fake_quantize(w, fmt))


@pytest.mark.parametrize(
    ("scheme", "macro", "method", "needle"),
    [
        ("mxfp4-mbs", 24, "rtn", "--macro-block 24: a macro block must be a positive multiple"),
        ("mxfp4-mbs", 0, "rtn", "--macro-block 0"),
        ("nvfp4", 32, "rtn", "--macro-block 32: scheme nvfp4 has no macro blocks"),
        ("mxfp4-mbs", 24, "gptq", "--macro-block 24: a macro block must be a positive multiple"),
        ("mxfp4-mbs-s", 8, "rtn-aware", "--macro-block 8: a macro block must be a positive"),
    ],
)
def test_bad_macro_blocks_are_refused_by_name(
    llama_dir: Path, tmp_path: Path, scheme: str, macro: int, method: str, needle: str
) -> None:
    dst = tmp_path / "q"
    with pytest.raises(UsageError, match=needle):
        quantize_checkpoint(
            llama_dir, dst, scheme, macro_block=macro, method=method, progress=False
        )
    assert not dst.exists()


def test_cli_option(llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    dst = tmp_path / "q"
    args = cli_args(str(llama_dir), str(dst), "--macro-block", "24", "--no-progress")
    assert run(args) == 2
    assert "--macro-block 24" in capsys.readouterr().err and not dst.exists()
    args = cli_args(str(llama_dir), str(dst), "--macro-block", "32", "--no-progress")
    assert run(args) == 0
    assert open_checkpoint(dst).macro_block == 32


def test_reader_refuses_a_bad_recorded_macro_block(llama_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "q"
    quantize_checkpoint(llama_dir, dst, "mxfp4-mbs", macro_block=32, progress=False)
    cfg_path = dst / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"]["macro_block_size"] = 128  # the bytes are per 32
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="weight_mbs' has shape"):
        open_checkpoint(dst)
    cfg["quantization_config"]["macro_block_size"] = 40
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quantization_config.macro_block_size 40"):
        open_checkpoint(dst)


# --- the calibrated methods at a macro block N -------------------------------------------


@pytest.mark.parametrize(
    ("scheme", "method", "smooth"),
    [
        ("mxfp4-mbs-h", "gptq", None),
        ("mxfp4-mbs-h", "gptq", 0.5),
        ("mxfp4-mbs-h", "rtn-aware", 0.5),
        ("mxfp4-mbs-s", "gptq", None),
        ("mxfp4-mbs-s", "rtn-aware", None),
    ],
)
def test_calibrated_methods_at_macro_block_32(
    llama_dir: Path,
    tmp_path: Path,
    random_tokens: None,
    monkeypatch: pytest.MonkeyPatch,
    scheme: str,
    method: str,
    smooth: float | None,
) -> None:
    """The checkpoint records N; every weight has one MBS byte per N elements and is an exact
    encoding at N (re-quantized with its own parameters it comes back unchanged); the
    calibration quantized the layers' activations as served, at N."""
    seen: list[tuple[str, int]] = []

    def spy(x, fmt, per_row, macro_block):  # noqa: ANN001, ANN202
        seen.append((fmt, macro_block))
        return fake_quant_activation(x, fmt, per_row, macro_block)

    monkeypatch.setattr(calibration, "fake_quant_activation", spy)
    macro, dst = 32, tmp_path / "q"
    quantize_checkpoint(
        llama_dir,
        dst,
        scheme,
        method=method,
        smooth=smooth,
        nsamples=4,
        seqlen=16,
        macro_block=macro,
        progress=False,
    )
    afmt = get_scheme(scheme).activation_format
    assert seen and set(seen) == {(afmt, macro)}
    qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qcfg["macro_block_size"] == macro
    assert qcfg["calibration"]["method"] == method
    assert qcfg["calibration"].get("smoothing") == (None if smooth is None else {"alpha": smooth})
    assert open_checkpoint(dst).macro_block == macro
    got = load(dst)
    assert len(got) == 7
    for module, q in got.items():
        k = q.shape[-1]
        assert q.fmt == get_scheme(scheme).weight_format
        assert q.macro_block == macro and q.mbs.shape[-1] == -(-k // macro), module
        assert torch.equal(_requantized_codes(q, k), unpack_fp4(q.codes, k)), module


def test_calibrated_macro_block_differs_from_128(
    llama_dir: Path, tmp_path: Path, random_tokens: None
) -> None:
    """The option is not ignored by the calibrated methods: the bytes are per 32, and the
    GPTQ weights differ from those of a run at 128."""
    out = {}
    for macro in (32, MACRO_BLOCK):
        dst = tmp_path / f"q{macro}"
        quantize_checkpoint(
            llama_dir,
            dst,
            "mxfp4-mbs-h",
            method="gptq",
            nsamples=4,
            seqlen=16,
            macro_block=macro,
            progress=False,
        )
        out[macro] = load(dst)
    differ = sum(
        int(not torch.equal(out[32][m].dequantize(), out[MACRO_BLOCK][m].dequantize()))
        for m in out[32]
    )
    assert differ >= 4, f"only {differ} of 7 weights changed with the macro block"


def test_gptq_layer_output_error_at_most_rtn_on_tiny_model(llama_dir: Path) -> None:
    """The tiny llama's linears, on their own inputs quantized as served at N = 32 (the
    scheme's activation format): GPTQ at N = 32 has at most RTN's output error at N = 32
    (RTN = formats.quantize(w, fmt, macro_block=32)); K = 64 and K = 100 (a partial macro
    block)."""
    from transformers import AutoModelForCausalLM

    macro = 32
    s = get_scheme("mxfp4-mbs-h")
    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    inputs: dict[str, list[torch.Tensor]] = {}
    hooks = [
        mod.register_forward_pre_hook(
            lambda _m, args, name=name: inputs.setdefault(name, []).append(args[0])
        )
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and ".layers." in name
    ]
    tokens = torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=tokens, use_cache=False)
    for h in hooks:
        h.remove()
    assert len(inputs) == 7
    for name, xs in inputs.items():
        x = torch.cat(xs).reshape(-1, xs[0].shape[-1])
        x = fake_quantize(x, s.activation_format, macro_block=macro)
        w = model.get_submodule(name).weight.detach().float()
        ref = x.double() @ w.double().T

        def out_err(q: QuantizedTensor) -> float:
            return float((ref - x.double() @ q.dequantize().double().T).square().sum())  # noqa: B023

        e_rtn = out_err(quantize(w, s.weight_format, macro_block=macro))
        e_gptq = out_err(gptq(w, x.T @ x, s.weight_format, macro_block=macro))
        assert e_gptq <= e_rtn, f"{name}: GPTQ {e_gptq:.4g} > RTN {e_rtn:.4g} at N={macro}"


@pytest.mark.parametrize("extra", [[], ["--smooth", "0.5"]], ids=["plain", "smooth"])
def test_cli_gptq_macro_block_round_trip(
    llama_dir: Path,
    tmp_path: Path,
    random_tokens: None,
    capsys: pytest.CaptureFixture,
    extra: list[str],
) -> None:
    dst = tmp_path / "q"
    argv = ["--method", "gptq", "--macro-block", "32", "--nsamples", "2", "--seqlen", "8"]
    assert run(cli_args(str(llama_dir), str(dst), *argv, *extra, "--no-progress")) == 0, (
        capsys.readouterr().err
    )
    qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qcfg["macro_block_size"] == 32 and qcfg["calibration"]["method"] == "gptq"
    assert open_checkpoint(dst).macro_block == 32
    got = load(dst)
    assert len(got) == 7 and all(q.macro_block == 32 for q in got.values())
