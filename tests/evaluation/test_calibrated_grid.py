"""vllm_mxplus.evaluation.grid: the served scheme x method table reads each study's saved values."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_mxplus.evaluation import grid as cg


def _study(path: Path, values: dict[str, float]) -> Path:
    path.write_text(json.dumps({"values": {k: {"value": v} for k, v in values.items()}}))
    return path


def test_grid_table_and_gap_to_nvfp4(tmp_path: Path) -> None:
    rtn = _study(
        tmp_path / "rtn.json",
        {
            "smollm2-135m/mxfp4-mbs-h/wiki_ppl": 120.0,
            "smollm2-135m/mxfp4-mbs-h/news_ppl": 150.0,
            "smollm2-135m/nvfp4/wiki_ppl": 100.0,
            "smollm2-135m/nvfp4/news_ppl": 125.0,
        },
    )
    grid = _study(
        tmp_path / "grid.json",
        {"mbsh-gptq/served/wiki_ppl": 90.0, "nvfp4-gptq/served/wiki_ppl": 80.0},
    )
    rows: cg.Rows = {
        "MXFP4-OCP": {"rtn": (rtn, "smollm2-135m/mxfp4-ocp"), "gptq": (grid, "ocp-gptq/served")},
        "MXFP4-MBS-H": {
            "rtn": (rtn, "smollm2-135m/mxfp4-mbs-h"),
            "rtn-aware": (grid, "mbsh-rtnaware/served"),
            "gptq": (grid, "mbsh-gptq/served"),
        },
        "NVFP4": {"rtn": (rtn, "smollm2-135m/nvfp4"), "gptq": (grid, "nvfp4-gptq/served")},
    }
    got = cg.collect(rows)
    assert got["MXFP4-MBS-H"] == {
        "rtn": {"wiki_ppl": 120.0, "news_ppl": 150.0},
        "gptq": {"wiki_ppl": 90.0},
    }
    assert "MXFP4-OCP" not in got  # nothing saved for it: its cells print as "-"
    md = cg.table(got, {"wiki_ppl": 60.0, "news_ppl": 70.0}, rows, "`bf16.md`")
    mbsh = [line for line in md.splitlines() if line.startswith("| MXFP4-MBS-H |")]
    # first the perplexities, then the gap to NVFP4 under the same method
    assert mbsh[0].split(" | ")[1:7] == ["120.00", "150.00", "–", "–", "90.00", "–"]
    assert mbsh[1].split(" | ")[1:7] == ["+20.0 %", "+20.0 %", "–", "–", "+12.5 %", "–"]
    assert "BF16 (unquantized, `bf16.md`): 60.00 / 70.00." in md
    assert not [line for line in md.splitlines() if line.startswith("| NVFP4 |")][1:]  # no gap row


def test_missing_study_or_value_reads_as_no_result(tmp_path: Path) -> None:
    assert cg.load_values(tmp_path / "absent.json") == {}
    path = tmp_path / "partial.json"
    path.write_text(
        json.dumps({"values": {"a/served/wiki_ppl": {"value": None}, "b": {"value": 2.0}}})
    )
    assert cg.load_values(path) == {"b": 2.0}
