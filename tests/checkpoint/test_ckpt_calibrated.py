"""`mxplus quantize --method rtn-aware|gptq` end to end on a tiny llama (calibration.py).

The tiny model's tokenizer is a stub, so calibration tokens are random ids (monkeypatched);
what is checked is the pipeline: every decoder linear comes out of calibration, the
checkpoint has the rtn layout and reads back, each weight is an exact encoding of its format
(re-quantizing with its own parameters returns it), and the methods actually differ from RTN.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ckpt_helpers import cli_args, source_tensors

from vllm_mxplus.checkpoint import load
from vllm_mxplus.checkpoint.cli_quantize import run
from vllm_mxplus.formats import get_scheme, quantize
from vllm_mxplus.formats.e2m1 import unpack_fp4
from vllm_mxplus.formats.params import GroupParams, padded_k, quantize_columns

SCHEMES = ["mxfp4-mbs-h", "nvfp4", "mxplus"]


def _requantized_codes(q, k: int) -> torch.Tensor:  # noqa: ANN001
    """The codes of q's dequantized values re-quantized with q's own parameters (its block
    scales, MBS bytes per q.macro_block, block-max indices, global scale)."""
    kp = padded_k(q.fmt, k, q.macro_block)
    nb = kp // q.spec.block_size

    def pad(t, n, value=0):  # noqa: ANN001, ANN202
        if t is None or t.shape[-1] == n:
            return t
        fill = torch.full((t.shape[0], n - t.shape[-1]), value, dtype=torch.uint8)
        return torch.cat([t.view(torch.uint8), fill], -1).view(t.dtype)

    p = GroupParams(
        pad(q.scales, nb),
        pad(q.mbs, kp // q.macro_block),
        pad(q.block_max_index, nb, 255),
        q.global_scale,
        macro_block=q.macro_block,
    )
    codes, _ = quantize_columns(q.fmt, F.pad(q.dequantize(), (0, kp - k)), p, 0)
    return codes[:, :k]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("method", ["rtn-aware", "gptq"])
def test_calibrated_checkpoint_is_exact_and_differs_from_rtn(
    llama_dir: Path, calibrated, scheme: str, method: str
) -> None:
    dst, report = calibrated(scheme, method)
    assert report.n_quantized == 7
    qcfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == scheme
    assert qcfg["calibration"]["method"] == method
    source = source_tensors(llama_dir)
    fmt = get_scheme(scheme).weight_format
    changed = 0
    for module, q in load(dst).items():
        k = q.shape[-1]
        assert torch.equal(_requantized_codes(q, k), unpack_fp4(q.codes, k)), module
        rtn = quantize(source[f"{module}.weight"], fmt)
        changed += int(not torch.equal(rtn.dequantize(), q.dequantize()))
    assert changed >= 4, f"{method} left {7 - changed} of 7 weights equal to RTN"


def test_cli_method_gptq(
    llama_dir: Path, tmp_path: Path, random_tokens: None, capsys: pytest.CaptureFixture
) -> None:
    dst = tmp_path / "cli"
    code = run(
        cli_args(
            str(llama_dir),
            str(dst),
            "--method",
            "gptq",
            "--nsamples",
            "2",
            "--seqlen",
            "8",
            "--no-progress",
        )
    )
    assert code == 0, capsys.readouterr().err
    assert len(load(dst)) == 7


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--method", "gptq", "--nsamples", "0"], "--nsamples"),
        (["--method", "rtn-aware", "--calib", "/nonexistent/calib.txt"], "--calib"),
    ],
    ids=["nsamples0", "missing-calib"],
)
def test_cli_bad_calibration_options(
    llama_dir: Path, tmp_path: Path, argv: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    code = run(cli_args(str(llama_dir), str(tmp_path / "bad"), *argv, "--no-progress"))
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
