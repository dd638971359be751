"""A source is checked against its own config.json before any work (source_check.py): a
missing, wrong-shape or integer-typed weight the plan would quantize, and a config lacking a
size, are refused up front, naming the tensor or key; nothing is written to DST."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ckpt_helpers import cli_args, make_custom, source_tensors

import vllm_mxplus.checkpoint.quantizer as quantizer_mod
from vllm_mxplus.checkpoint.cli_quantize import EXIT_FAILURE, run
from vllm_mxplus.checkpoint.errors import CheckpointError
from vllm_mxplus.checkpoint.quantizer import quantize_checkpoint

DOWN = "model.layers.0.mlp.down_proj.weight"
Q = "model.layers.0.self_attn.q_proj.weight"


def _edited(llama_dir: Path, dst: Path, *, tensors=None, config=None) -> Path:  # noqa: ANN001
    """A copy of the tiny llama with tensors / config.json entries replaced (None: removed)."""
    t = source_tensors(llama_dir)
    for name, value in (tensors or {}).items():
        if value is None:
            del t[name]
        else:
            t[name] = value
    cfg = json.loads((llama_dir / "config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            del cfg[key]
        else:
            cfg[key] = value
    return make_custom(dst, t, cfg)


def _refused(src: Path, dst: Path, pattern: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(CheckpointError, match=pattern):
        quantize_checkpoint(src, dst, "mxfp4-mbs", progress=False)
    assert not dst.exists()
    assert run(cli_args(str(src), str(dst), "--no-progress")) == EXIT_FAILURE
    err = capsys.readouterr().err
    assert err.startswith("mxplus quantize: error: ") and err.count("\n") == 1, err
    assert not dst.exists()


@pytest.fixture
def no_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail if the quantizer reaches its writer: the check must come before any tensor is read
    in full."""

    def boom(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("a tensor was read before the source check refused the source")

    monkeypatch.setattr(quantizer_mod, "write_all", boom)


def test_missing_linear_weight(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, no_reads: None
) -> None:
    src = _edited(llama_dir, tmp_path / "src", tensors={DOWN: None})
    _refused(
        src, tmp_path / "q", rf"tensor '{DOWN}' \(\[64, 100\]\).*in no safetensors file", capsys
    )


def test_wrong_shape(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, no_reads: None
) -> None:
    """The weights of another model under this config: intermediate 100 on disk, 128 in
    config.json; the first tensor it changes is named with both shapes."""
    src = _edited(llama_dir, tmp_path / "src", config={"intermediate_size": 128})
    _refused(
        src,
        tmp_path / "q",
        r"tensor 'model\.layers\.0\.mlp\.(down|gate|up)_proj\.weight' has shape \[\d+, \d+\], "
        r"but .*config\.json makes it \[\d+, \d+\]",
        capsys,
    )


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32])
def test_integer_weight(
    llama_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    no_reads: None,
    dtype: torch.dtype,
) -> None:
    """An integer `.weight` (an already-quantized export with its quantization_config gone)."""
    codes = torch.randint(0, 100, (64, 64), dtype=dtype)
    src = _edited(llama_dir, tmp_path / "src", tensors={Q: codes})
    _refused(src, tmp_path / "q", rf"tensor '{Q}' is [IU]\d+ \(integer\).*--ignore", capsys)


def test_integer_weight_of_unknown_architecture(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """No skeleton for a model_type transformers does not know: the dtype rule still holds."""
    t = {"a.weight": torch.randn(8, 32), "b.weight": torch.randint(0, 9, (8, 32), dtype=torch.int8)}
    src = make_custom(tmp_path / "src", t)
    _refused(src, tmp_path / "q", r"tensor 'b\.weight' is I8 \(integer\)", capsys)


@pytest.mark.parametrize("key", ["hidden_size", "num_hidden_layers", "intermediate_size"])
def test_config_lacking_a_size(
    llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture, no_reads: None, key: str
) -> None:
    """transformers would fill a missing size with its default (Llama: hidden 4096)."""
    src = _edited(llama_dir, tmp_path / "src", config={key: None})
    _refused(src, tmp_path / "q", rf"config\.json: no integer '{key}'", capsys)


def test_ignored_integer_weight_is_kept(llama_dir: Path, tmp_path: Path) -> None:
    """A module the plan keeps (--ignore) may hold anything; it is copied byte for byte."""
    codes = torch.randint(-100, 100, (64, 64), dtype=torch.int8)
    src = _edited(llama_dir, tmp_path / "src", tensors={Q: codes})
    dst = tmp_path / "q"
    quantize_checkpoint(src, dst, "mxfp4-mbs", progress=False, ignore=["q_proj"])
    assert torch.equal(source_tensors(dst)[Q], codes)


def test_matching_source_passes(llama_dir: Path, tmp_path: Path) -> None:
    """The untouched tiny llama (the check's baseline: every one of the refusals above is this
    source with one thing changed)."""
    report = quantize_checkpoint(llama_dir, tmp_path / "q", "mxfp4-mbs", progress=False)
    assert report.n_quantized == 7
