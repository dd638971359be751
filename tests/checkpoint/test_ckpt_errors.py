"""Bad sources, bad requests and corrupted checkpoints fail with one line naming the culprit."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from ckpt_helpers import cli_args, make_custom
from safetensors.torch import load_file, save_file

from vllm_mxplus.checkpoint import CheckpointError, UsageError, open_checkpoint, quantize_checkpoint
from vllm_mxplus.checkpoint.cli_quantize import EXIT_FAILURE, EXIT_USAGE, run


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _one_line_error(capsys: pytest.CaptureFixture) -> str:
    err = capsys.readouterr().err
    assert err.startswith("mxplus quantize: error: ") and err.count("\n") == 1, err
    return err


def test_truncated_source(llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = _copy(llama_dir, tmp_path / "src")
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: truncated safetensors file: "
        r"tensor '.*' ends at byte",
    ):
        quantize_checkpoint(src, tmp_path / "q", "mxfp4-ocp", progress=False)
    assert run(cli_args(str(src), str(tmp_path / "q"), "--no-progress")) == EXIT_FAILURE
    assert "model.safetensors: truncated" in _one_line_error(capsys)
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize(
    "damage", ["garbage-header", "empty-file", "huge-header-length", "bad-offsets"]
)
def test_corrupted_source(tmp_path: Path, damage: str) -> None:
    src = make_custom(
        tmp_path / "src", {"a.weight": torch.randn(8, 32), "b.weight": torch.randn(8, 32)}
    )
    f = src / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    if damage == "garbage-header":
        f.write_bytes(raw[:8] + b"\xff" * n + raw[8 + n :])
    elif damage == "empty-file":
        f.write_bytes(b"")
    elif damage == "huge-header-length":
        f.write_bytes(struct.pack("<Q", 1 << 40) + raw[8:])
    else:
        header = json.loads(raw[8 : 8 + n])
        header["b.weight"]["data_offsets"] = [0, 8 * 32 * 4]  # overlaps a.weight
        new = json.dumps(header).encode().ljust(n)
        f.write_bytes(raw[:8] + new + raw[8 + n :])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: (not a safetensors|corrupted)"):
        quantize_checkpoint(src, tmp_path / "q", "mxfp4-ocp", progress=False)


def test_missing_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = make_custom(tmp_path / "src", {"a.weight": torch.randn(8, 32)})
    (src / "config.json").unlink()
    assert run(cli_args(str(src), str(tmp_path / "q"), "--no-progress")) == EXIT_FAILURE
    assert "config.json: not found" in _one_line_error(capsys)


def test_no_weights_and_already_quantized(tmp_path: Path, llama_dir: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights"):
        quantize_checkpoint(empty, tmp_path / "q", "mxfp4-ocp", progress=False)
    quantize_checkpoint(llama_dir, tmp_path / "q1", "mxfp4-ocp", progress=False)
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(tmp_path / "q1", tmp_path / "q2", "mxfp4-ocp", progress=False)


def test_bad_usage_exit_2(llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:  # argparse rejects an unknown scheme
        cli_args(str(llama_dir), str(tmp_path / "q"), "--scheme", "mxfp5")
    assert e.value.code == EXIT_USAGE
    assert "invalid choice: 'mxfp5'" in capsys.readouterr().err
    with pytest.raises(UsageError, match="unknown scheme 'mxfp5'"):
        quantize_checkpoint(llama_dir, tmp_path / "q", "mxfp5")
    assert run(cli_args(str(tmp_path / "nowhere"), str(tmp_path / "q"))) == EXIT_USAGE
    assert "SRC is not a directory" in _one_line_error(capsys)
    assert run(cli_args(str(llama_dir), str(tmp_path / "q"), "--ignore", "re:(")) == EXIT_USAGE
    assert "--ignore 're:(': invalid regular expression" in _one_line_error(capsys)
    assert run(cli_args(str(llama_dir), str(tmp_path / "q"), "--device", "cuda:7")) == (
        0 if torch.cuda.is_available() else EXIT_USAGE
    )
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli_args(str(llama_dir), str(tmp_path / "q"), "--max-shard-size", "lots")


# --- reader validation: the quantized checkpoint itself is damaged -------------------------


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Path:
    dst = tmp_path_factory.mktemp("q") / "mbs_s"
    quantize_checkpoint(llama_dir, dst, "mxfp4-mbs-s", progress=False)
    return dst


def _rewrite(dst: Path, edit) -> None:
    f = dst / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(f), "pt") as h:
        meta = h.metadata()
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata=meta)


NAME = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize(
    "damage, message",
    [
        ("missing-scale", rf"missing tensor {NAME}\.weight_scale \(format mxfp4-mbs-s stores"),
        ("missing-mbs", rf"missing tensor {NAME}\.weight_mbs"),
        ("wrong-shape", rf"tensor '{NAME}\.weight_scale' has shape \[64, 6\], expected \[64, 7\]"),
        ("wrong-dtype", rf"tensor '{NAME}\.weight_mbs' has dtype I32, expected U8"),
        ("extra-tensor", rf"unexpected tensor '{NAME}\.weight_global_scale'"),
        ("orphan", r"tensor 'ghost\.weight_scale' has no ghost\.weight_packed"),
        ("both", rf"tensor '{NAME}\.weight' is stored both quantized and not"),
    ],
)
def test_reader_names_file_and_tensor(
    quantized_dir: Path, tmp_path: Path, damage: str, message: str
) -> None:
    dst = _copy(quantized_dir, tmp_path / "q")

    def edit(t: dict) -> None:
        if damage == "missing-scale":
            del t[f"{NAME}.weight_scale"]
        elif damage == "missing-mbs":
            del t[f"{NAME}.weight_mbs"]
        elif damage == "wrong-shape":
            t[f"{NAME}.weight_scale"] = t[f"{NAME}.weight_scale"][:, :6].contiguous()
        elif damage == "wrong-dtype":
            t[f"{NAME}.weight_mbs"] = t[f"{NAME}.weight_mbs"].to(torch.int32)
        elif damage == "extra-tensor":
            t[f"{NAME}.weight_global_scale"] = torch.ones(1)
        elif damage == "orphan":
            t["ghost.weight_scale"] = torch.zeros(2, 2, dtype=torch.uint8)
        else:
            t[f"{NAME}.weight"] = torch.zeros(2, 2)

    _rewrite(dst, edit)
    with pytest.raises(CheckpointError, match=message) as e:
        open_checkpoint(dst)
    if damage not in ("orphan",):
        assert "model.safetensors" in str(e.value)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("format_version", 99, r"format_version 99 is not supported"),
        ("quant_method", "mxfp5", r"unknown scheme 'mxfp5'"),
        ("weight_format", "nvfp4", r"weight_format is 'nvfp4', scheme 'mxfp4-mbs-s' expects"),
    ],
)
def test_reader_checks_quantization_config(
    quantized_dir: Path, tmp_path: Path, field: str, value: object, message: str
) -> None:
    dst = _copy(quantized_dir, tmp_path / "q")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"][field] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(dst)


def test_reader_truncated_checkpoint(quantized_dir: Path, tmp_path: Path) -> None:
    dst = _copy(quantized_dir, tmp_path / "q")
    f = dst / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated"):
        open_checkpoint(dst)
    (dst / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        open_checkpoint(dst)
