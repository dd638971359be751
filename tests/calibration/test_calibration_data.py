"""The default calibration text is held out from the evaluation text (calib_data.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_mxplus.calibration.data import HELD_OUT_FROM, calibration_tokens

REPO = Path(__file__).resolve().parents[2]
WIKI_TASK = REPO / "eval" / "tasks" / "wiki_ppl.jsonl"


def _eval_docs() -> list[dict]:
    return [json.loads(line) for line in WIKI_TASK.read_text(encoding="utf-8").splitlines()]


def _wiki_prepared() -> Path | None:
    from vllm_mxplus.assets.text import _text_paths

    txt, meta = _text_paths(None, "wikipedia")
    return txt if txt.is_file() and meta.is_file() else None


def test_eval_articles_precede_the_held_out_range() -> None:
    articles = [d["article"] for d in _eval_docs()]
    assert articles and max(articles) < HELD_OUT_FROM


def test_default_calibration_text_shares_no_paragraph_with_eval() -> None:
    if _wiki_prepared() is None:
        pytest.skip("embedded Wikipedia text not prepared (run `mxplus prepare --what text`)")
    from vllm_mxplus.calibration.data import default_calibration_text

    calib = default_calibration_text()
    calib_paras = {p for p in calib.split("\n") if p.strip()}
    eval_paras = {p for d in _eval_docs() for p in d["text"].split("\n") if p.strip()}
    assert len(calib_paras) > 100
    assert not calib_paras & eval_paras
    assert all(p not in calib for p in eval_paras)


def _smollm2_dir() -> Path:
    from vllm_mxplus.assets.smollm2 import MARKER, smollm2_dir

    d = smollm2_dir()
    if not (d / MARKER).is_file():
        pytest.skip("SmolLM2 not prepared (run `mxplus prepare`)")
    return d


def test_calib_file_windows(tmp_path: Path) -> None:
    tok = _smollm2_dir()
    f = tmp_path / "calib.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    ids = calibration_tokens(tok, f, nsamples=3, seqlen=32)
    assert ids.shape == (3, 32)
    again = calibration_tokens(tok, f, nsamples=3, seqlen=32)
    assert ids.equal(again)  # seeded


def test_calib_file_too_short_names_the_file(tmp_path: Path) -> None:
    from vllm_mxplus.errors import UsageError

    tok = _smollm2_dir()
    f = tmp_path / "short.txt"
    f.write_text("Too short.", encoding="utf-8")
    with pytest.raises(UsageError, match="short.txt"):
        calibration_tokens(tok, f, nsamples=2, seqlen=64)
