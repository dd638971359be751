"""A vLLM worker loads only what serves: registering the plugin, importing the integration layer
and resolving one platform's backends loads no offline tool (quantizer driver, calibration,
assets, evaluation, analysis, kernel tools) and no other platform's kernel family."""

from __future__ import annotations

import pytest
from repo_scripts import load_repo_script

imports = load_repo_script("scripts/serving_imports.py")


@pytest.mark.parametrize(
    ("platform", "absent"), [("cpu", ("triton", "cutlass")), ("cuda", ("cpu",))]
)
def test_serving_imports_no_offline_tool_and_no_other_platform(platform, absent):
    mods = imports.loaded_modules(platform)
    groups = imports.classify(mods)
    assert groups["offline"] == [], groups["offline"]
    for family in absent:
        assert groups[family] == [], f"{platform} worker imported {groups[family]}"
    # the probe really resolved this platform's backends (a count of zero would pass vacuously)
    own = "cpu" if platform == "cpu" else "triton"
    assert groups[own], f"{platform}: the {own} backends were not resolved"
    assert "vllm_mxplus.integration.linear" in mods and "vllm_mxplus.checkpoint.layout" in mods


def test_classify_names_offline_tools_and_families():
    groups = imports.classify(
        [
            "vllm_mxplus.calibration.gptq",
            "vllm_mxplus.checkpoint.quantizer",
            "vllm_mxplus.checkpoint.layout",
            "vllm_mxplus.backends.triton.linear",
            "vllm_mxplus.backends.cpu",
        ]
    )
    assert groups["offline"] == ["vllm_mxplus.calibration.gptq", "vllm_mxplus.checkpoint.quantizer"]
    assert groups["triton"] == ["vllm_mxplus.backends.triton.linear"]
    assert groups["cpu"] == ["vllm_mxplus.backends.cpu"]
    assert groups["cutlass"] == []
