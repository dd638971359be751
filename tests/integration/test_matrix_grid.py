"""The slow coverage grid: every scheme online (fp32) and mxfp4-mbs in bf16, on the
architectures of matrix_grid.py (which says how they are judged, and the bf16 rule).

Not in the default suite (test_model_matrix.py, mxfp4-mbs in fp32 on every architecture, is
the CI subset): 36 more engines plus their references, 3 min 42 s on an idle-ish 2-core box
and several times that on a loaded one, outside the CI budget. Run it with

    MXPLUS_MATRIX_GRID=1 bash scripts/test.sh tests/integration/test_matrix_grid.py

`MXPLUS_UPDATE_MATRIX=1` as well rewrites the "grid" and "bf16" sections of
docs/model_matrix.json from this run (then `python scripts/supported_models.py`).
"""

from __future__ import annotations

import json
import os

import pytest
from matrix_grid import BF16_ARCHS, GRID_ARCHS, GRID_SCHEMES, expected_grid, run_grid
from model_matrix import MATRIX_JSON, update_sections

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("MXPLUS_MATRIX_GRID") != "1",
        reason="the slow scheme / bf16 grid: set MXPLUS_MATRIX_GRID=1 to run it",
    ),
]


@pytest.fixture(scope="module")
def grid(tmp_path_factory, subprocess_env) -> dict:
    doc = run_grid(tmp_path_factory.mktemp("grid"), subprocess_env)
    if os.environ.get("MXPLUS_UPDATE_MATRIX") == "1":
        update_sections(doc)
    return doc


@pytest.mark.parametrize("scheme", GRID_SCHEMES)
@pytest.mark.parametrize("arch", GRID_ARCHS)
def test_scheme_online(grid, arch, scheme):
    """Greedy tokens identical to the scheme's reference (the flip rule of
    integration_harness), fp32, else the fp32 flip rule of matrix_grid.py (a rounding flip of
    the reference), or the expected outcome of matrix_grid.EXPECTED_GRID."""
    row = grid["grid"]["archs"][arch]
    want, phrase = expected_grid(arch, scheme)
    note = row.get(f"{scheme}_note", "")
    assert row[scheme] == want, f"{arch} {scheme}: {row[scheme]} ({note})"
    assert phrase in note, note


def test_flip_rule_rejects_broken_engines(grid):
    """Every cell judged "ok" by the fp32 flip rule would fail it with a broken engine:
    another model's continuation, or a deliberately wrong weight (matrix_grid.broken_engines)."""
    controls = grid["flip_controls"]
    assert controls, "no cell judged by the flip rule: update EXPECTED_GRID"
    for cell, verdicts in controls.items():
        assert len(verdicts) == 3, f"{cell}: {sorted(verdicts)}"
        passed = [name for name, why in verdicts.items() if why is None]
        assert not passed, f"{cell}: the flip rule passes broken engines {passed}"


@pytest.mark.parametrize("arch", BF16_ARCHS)
def test_bf16_online(grid, arch):
    """The bf16 rule of matrix_grid.py: every bf16 token within BF16_MAX_GAP nats of the
    fp32 reference's best, BF16_MEAN_GAP on average."""
    row = grid["bf16"]["archs"][arch]
    assert row["online"] == "ok", f"{arch} bf16: {row['online']} ({row.get('online_note')})"


def test_committed_grid_is_current(grid):
    """docs/model_matrix.json's grid and bf16 sections say what this run found."""
    committed = json.loads(MATRIX_JSON.read_text())
    keys = {*GRID_SCHEMES, "online"}  # the statuses; notes and figures vary run to run
    for section in ("grid", "bf16"):
        got, want = (
            {a: {k: v for k, v in r.items() if k in keys} for a, r in d["archs"].items()}
            for d in (grid[section], committed.get(section, {"archs": {}}))
        )
        assert got == want, (
            f"docs/model_matrix.json's {section} section is stale: rerun with "
            "MXPLUS_MATRIX_GRID=1 MXPLUS_UPDATE_MATRIX=1 and `python scripts/supported_models.py`"
        )
