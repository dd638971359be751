"""`mxplus quantize --macro-block N`: MBS bytes per N elements, recorded and read back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ckpt_helpers import cli_args, source_tensors
from test_ckpt_roundtrip import assert_bitwise_equal

from vllm_mxplus.checkpoint import CheckpointError, load, open_checkpoint, quantize_checkpoint
from vllm_mxplus.checkpoint.cli_quantize import run
from vllm_mxplus.checkpoint.errors import UsageError
from vllm_mxplus.formats import fake_quantize, get_scheme


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
