"""The README "Supported models" table is the rendering of docs/model_matrix.json (fast)."""

from __future__ import annotations

import json

from repo_scripts import load_repo_script


def _script():
    return load_repo_script("scripts/supported_models.py")


def test_readme_table_is_current():
    assert _script().main(["--check"]) == 0, (
        "README.md's Supported models table is stale: run `python scripts/supported_models.py`"
    )


def test_every_architecture_has_a_row():
    mod = _script()
    doc = json.loads(mod.MATRIX_JSON.read_text())
    table = mod.render(doc)
    for row in doc["archs"].values():
        assert f"`{row['architecture']}`" in table
    assert table.count("\n| `") == len(doc["archs"])


def test_render_marks_a_mismatch_loudly():
    doc = {
        "scheme": "s",
        "prompts": 1,
        "tokens": 1,
        "archs": {
            "x": {
                "architecture": "XForCausalLM",
                "what": "w",
                "hidden_size": 8,
                "online": "mismatch",
                "online_note": "prompt 0 differs",
                "prequantized": "ok",
            }
        },
    }
    row = _script().render(doc).splitlines()[-1]
    assert row == "| `XForCausalLM` | w | 8 | MISMATCH | yes | prompt 0 differs |"
