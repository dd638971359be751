"""Architecture coverage: every architecture of tiny_models.ARCHS served by vLLM with
mxfp4-mbs, online and from an `mxplus quantize` checkpoint, against the transformers
fake-quant reference (model_matrix.py says how; docs/model_matrix.json holds the committed
outcome that the README "Supported models" table is rendered from).

All engines run in one driver process; the whole matrix is sized for a 2-core CI box.
`MXPLUS_UPDATE_MATRIX=1` rewrites docs/model_matrix.json from this run (then run
`python scripts/supported_models.py` to refresh the README table).
"""

from __future__ import annotations

import json
import os

import pytest
from model_matrix import (
    KINDS,
    MATRIX_JSON,
    MAX_SLIDING_WINDOW,
    PROMPTS,
    expected_status,
    run_matrix,
    write_matrix,
)
from tiny_models import ARCHS

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def matrix(tmp_path_factory, subprocess_env) -> dict:
    doc = run_matrix(tmp_path_factory.mktemp("matrix"), subprocess_env)
    print(f"model matrix: {doc['seconds']}")
    if os.environ.get("MXPLUS_UPDATE_MATRIX") == "1":
        write_matrix(doc)
    return doc


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_architecture(matrix, arch, kind):
    """Greedy tokens identical to the reference, or the expected refusal at load (naming
    the layer and the reason), never wrong numbers."""
    row = matrix["archs"][arch]
    want, phrase = expected_status(arch, kind)
    note = row.get(f"{kind}_note", "")
    assert row[kind] == want, f"{arch} {kind}: {row[kind]} ({note})"
    assert phrase in note, note


def test_committed_matrix_is_current(matrix):
    """docs/model_matrix.json (and so the README table) says what this run found."""
    committed = json.loads(MATRIX_JSON.read_text())
    got = {a: {k: r[k] for k in KINDS} for a, r in matrix["archs"].items()}
    want = {a: {k: r[k] for k in KINDS} for a, r in committed["archs"].items()}
    assert got == want, (
        "docs/model_matrix.json is stale: rerun with MXPLUS_UPDATE_MATRIX=1 "
        "and `python scripts/supported_models.py`"
    )


def test_a_prompt_outlasts_every_sliding_window():
    """The windowed layers (gemma2, gemma3, gpt_oss) drop keys within the prompt itself."""
    assert MAX_SLIDING_WINDOW > 0
    assert max(len(p) for p in PROMPTS) > MAX_SLIDING_WINDOW, [len(p) for p in PROMPTS]
