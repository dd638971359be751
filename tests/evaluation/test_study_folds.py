"""The per-fold smoothing ablation of eval/gptq/ (`+sq=F,...` rows fold only those sites):
vllm_mxplus.evaluation.reference_model.only_folds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "checkpoint"))

from ckpt_helpers import make_llama  # noqa: E402

from vllm_mxplus.calibration import smoothing  # noqa: E402
from vllm_mxplus.evaluation.reference_model import only_folds  # noqa: E402


def test_only_the_named_folds_rewrite_tensors(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    src = make_llama(tmp_path / "llama", layers=1, seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    fp32 = {n: torch.float32 for n, _ in model.named_parameters()}
    every = smoothing.FOLDS
    with only_folds(["o", "down"]):
        assert len(smoothing.FOLDS) == 2
        changed = smoothing.smooth_model(
            model, smoothing.input_absmax(model, ids, "cpu"), 0.5, fp32
        )
    assert smoothing.FOLDS is every  # restored
    p = "model.layers.0."
    assert sorted(changed) == sorted(
        p + n
        for n in (
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
        )
    )
    with only_folds(None):
        assert smoothing.FOLDS is every
    with pytest.raises(ValueError, match="unknown fold"), only_folds(["qk"]):
        pass
    assert smoothing.FOLDS is every
