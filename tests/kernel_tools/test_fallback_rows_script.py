"""benchmarks/fallback_rows.py on a checkpoint written here: the rows each FP8-chunk GEMM
leaves to the exact fallback, counted per projection kind (a row with blocks 12 binades under
its chunk's largest: exact in the FP8 form, past the packed-weight GEMM's tables; a row with
blocks 20 binades under: inexact in both), and K = 576 not served by the packed GEMM."""

from __future__ import annotations

import torch
from repo_scripts import load_repo_script
from safetensors.torch import save_file


def test_counts_on_a_small_checkpoint(tmp_path, capsys):
    mod = load_repo_script("benchmarks/fallback_rows.py")
    g = torch.Generator().manual_seed(0)
    down = torch.randn(8, 512, generator=g)
    down[2, 16:32] *= 2.0**-12  # exact in the FP8 form, wider than the tables
    down[5, 32:48] *= 2.0**-20  # past the FP8 form's 14 binades
    gate = torch.randn(6, 576, generator=g)
    save_file({"model.layers.0.mlp.down_proj.weight": down.to(torch.bfloat16),
               "model.layers.0.mlp.gate_proj.weight": gate.to(torch.bfloat16),
               "model.norm.weight": torch.ones(512)}, str(tmp_path / "model.safetensors"))  # fmt: skip
    res = mod.count(tmp_path, "mxfp4-mbs")
    d, gp = res["by_kind"]["down_proj"], res["by_kind"]["gate_proj"]
    assert d == {"tensors": 1, "rows": 8, "inexact_rows": 1, "packed_rows": 8,
                 "packed_fallback_rows": 2}  # fmt: skip
    assert gp["rows"] == 6 and "packed_rows" not in gp, "K = 576: not a multiple of 256"
    assert res["total"]["rows"] == 14 and "norm" not in res["by_kind"]
    assert mod.main(["--model", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "down_proj" in out and "25.000%" in out  # 2 of 8 rows
