"""vLLM 0.32 (CPU build) reading `mxplus quantize --format compressed-tensors` checkpoints with
its in-tree compressed-tensors method, the plugin installed but not claiming them.

What runs here: detection (quant_method compressed-tensors, no plugin config claims it) and the
in-tree config parsing and scheme selection; serving fails on CPU for want of an NVFP4 / MXFP4
linear kernel (the exact error is checked); with vLLM's own NVFP4 emulation kernel added to
the CPU list (ct_vllm_driver.py --emulate) the unchanged method loads the NVFP4 checkpoint,
its loaded parameters equal the stored tensors and one layer's output matches the plugin's
arithmetic on the same codes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_helpers import make_llama, source_tensors

from vllm_mxplus.checkpoint import quantize_checkpoint
from vllm_mxplus.formats import SCHEMES, QuantizedTensor, get_format
from vllm_mxplus.formats.nvfp4 import fake_quantize_nvfp4_given

pytest.importorskip("vllm")

DRIVER = Path(__file__).with_name("ct_vllm_driver.py")
O_PROJ = "model.layers.0.self_attn.o_proj"


@pytest.fixture(scope="module")
def ct_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny llama vLLM's CPU attention takes (head dim 128), in both compressed-tensors
    formats; calibration tokens are random ids (the tiny tokenizer is a stub)."""
    import vllm_mxplus.checkpoint.quantizer as quantizer_mod

    root = tmp_path_factory.mktemp("ctv")
    src = make_llama(root / "llama", hidden=256, intermediate=512, layers=2)
    mp = pytest.MonkeyPatch()
    mp.setattr(
        quantizer_mod,
        "calibration_tokens",
        lambda *a, **k: torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0)),
    )
    out = {}
    try:
        for scheme in ("nvfp4", "mxfp4-ocp"):
            out[scheme] = root / scheme
            quantize_checkpoint(
                src, out[scheme], scheme, out_format="compressed-tensors", progress=False
            )
    finally:
        mp.undo()
    return out


def test_no_plugin_config_claims_a_compressed_tensors_checkpoint(ct_models) -> None:
    from vllm.model_executor.layers.quantization import get_quantization_config

    import vllm_mxplus

    vllm_mxplus.register()
    for scheme, path in ct_models.items():
        qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
        assert qcfg["quant_method"] not in SCHEMES
        for name in SCHEMES:
            cls = get_quantization_config(name)
            assert cls.override_quantization_method(qcfg, None) is None, (scheme, name)
            with pytest.raises(ValueError, match="not a vllm-mxplus checkpoint"):
                cls.from_config(qcfg)  # `--quantization NAME` on it says what to do


def test_vllm_parses_the_config_and_selects_its_fp4_schemes(ct_models) -> None:
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    for scheme, want in (("nvfp4", "_is_nvfp4_format"), ("mxfp4-ocp", "_is_mxfp4")):
        qcfg = json.loads((ct_models[scheme] / "config.json").read_text())["quantization_config"]
        cfg = CompressedTensorsConfig.from_config(qcfg)
        assert "lm_head" in cfg.ignore
        (group,) = cfg.target_scheme_map.values()
        assert getattr(CompressedTensorsConfig, want)(group["weights"])
        if scheme == "nvfp4":  # W4A4: block scales per call, the global one stored
            assert CompressedTensorsConfig._is_nvfp4_format(group["input_activations"])
            assert group["input_activations"].dynamic == "local"


def _serve(model: Path, tmp_path: Path, env: dict[str, str], *flags: str) -> dict:
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(DRIVER), str(model), str(out), *flags]
    env = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, timeout=600, check=False, capture_output=True, text=True)
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.vllm
@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4-ocp"])
def test_cpu_build_has_no_fp4_linear_kernel(
    scheme: str, ct_models, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    res = _serve(ct_models[scheme], tmp_path, subprocess_env)
    name = "NVFP4" if scheme == "nvfp4" else "MXFP4"
    assert res.get("error", "").startswith(
        f"ValueError: Failed to find a kernel that can implement the {name} linear layer"
    ), res
    assert "compressed_tensors" in res["trace"]  # vLLM's in-tree method got it, not the plugin


@pytest.mark.vllm
def test_vllm_emulation_serves_the_nvfp4_checkpoint(
    ct_models, tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    dst = ct_models["nvfp4"]
    res = _serve(dst, tmp_path, subprocess_env, "--emulate")
    assert res.get("error") is None, res.get("trace")
    assert res["quantization"] == "compressed-tensors"
    assert len(res["tokens"]) == 6
    layer = res["layer"]
    assert layer["method"] == "CompressedTensorsW4A4Fp4"
    stored = {
        k.rpartition(".")[2]: v for k, v in source_tensors(dst).items() if k.startswith(O_PROJ)
    }
    # weight loading: the layer holds the checkpoint's bytes; vLLM inverts G to our g
    assert torch.equal(torch.tensor(layer["weight"], dtype=torch.uint8), stored["weight_packed"])
    assert torch.equal(
        torch.tensor(layer["weight_scale"], dtype=torch.uint8),
        stored["weight_scale"].view(torch.uint8),
    )
    g = float((1.0 / stored["weight_global_scale"]).reshape(()))
    assert layer["weight_global_scale"] == g
    assert layer["input_global_scale_inv"] == float(stored["input_global_scale"])
    # its output: activations NVFP4 under the static scale, the plugin's dequantized weight
    x = torch.tensor(layer["x"])
    w = QuantizedTensor(
        stored["weight_packed"],
        stored["weight_scale"],
        get_format("nvfp4"),
        torch.Size((256, 256)),
        global_scale=torch.tensor(g),
    ).dequantize()
    g_in = 1.0 / stored["input_global_scale"].reshape(())
    want = fake_quantize_nvfp4_given(x, g_in) @ w.T
    got = torch.tensor(layer["y"])
    rel = float((got - want).norm() / want.norm())
    # fp32 GEMM order, and vLLM scales activations by a reciprocal (x * (1/s)) where the
    # plugin divides: a rare element lands on the other side of an E2M1 rounding threshold
    assert rel < 1e-3, rel
