"""`mxplus kernels --plan`: the selector's choice per scheme and layer kind on a GPU this
machine does not have; on sm_90 and sm_100 no scheme falls to the reference (fp32 copies)."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_mxplus.cli import main
from vllm_mxplus.formats import SCHEMES
from vllm_mxplus.kernel_tools.plan import plan

KINDS = [("linear", None, None)] + [
    ("experts", act, bias) for act in ("silu", "gelu", "swigluoai") for bias in (False, True)
]


def _check_cover(rows) -> None:
    """Per (scheme, layer kind: linear, experts of every activation with and without bias):
    contiguous ranges from M = 1 with no upper end."""
    for scheme in SCHEMES:
        for layer, act, bias in KINDS:
            mine = sorted(
                (
                    r
                    for r in rows
                    if (r.scheme, r.layer, r.activation, r.bias) == (scheme, layer, act, bias)
                ),
                key=lambda r: r.m_min,
            )
            assert mine, (scheme, layer, act, bias)
            assert mine[0].m_min == 1 and mine[-1].m_max is None, (scheme, layer, mine)
            for a, b in zip(mine, mine[1:]):
                assert a.m_max is not None and b.m_min == a.m_max + 1, (scheme, layer, mine)


@pytest.mark.parametrize("cc", [90, 100])
@pytest.mark.parametrize("cutlass", [True, False], ids=["cutlass-built", "cutlass-absent"])
def test_no_reference_on_hopper_or_blackwell(cc, cutlass):
    rows = plan("cuda", cc, cutlass, torch.bfloat16)
    _check_cover(rows)
    assert not [r for r in rows if r.backend == "reference"], rows
    prefill = {r.scheme: r.backend for r in rows if r.layer == "linear" and r.m_max is None}
    # CUTLASS first where built; on sm_100a only without MBS (its MBS path relaunches per
    # 128-K chunk: the static model's bound puts the FP8-chunk pipeline ahead)
    assert (prefill["mxfp4-mbs"] == "cutlass_prefill") is (cutlass and cc == 90)
    assert (prefill["mxfp4-16-oas"] == "cutlass_prefill") is cutlass
    if cc == 100:  # sm_100's block-scaled FP4 MMA without a build: MBS, NVFP4, MXFP4-OCP
        for scheme in ("mxfp4-mbs", "nvfp4", "mxfp4-ocp"):
            assert prefill[scheme] == "triton-fp4-prefill", scheme
        assert prefill["mxplus"] == "triton-fp8-prefill" or prefill["mxplus"] == "triton-gemm"
    assert prefill["nvfp4"] != "cutlass_prefill"  # its kernels take E8M0 at block 16 only
    # bytes per weight held on the device, measured from the backends' own load code: the
    # packed format (0.53-0.58) wherever the Triton kernels serve alone; with the CUTLASS
    # prefill, sm_90a holds nothing more (its FP8 form is made per call) and sm_100a adds its
    # interleaved scale copy (1 byte per 16: 0.63); sm_100's Triton FP4 MMA adds its UE4M3
    # scale bytes (1 per 16) and one fp32 factor per 128 with MBS (0.69).
    for r in rows:
        assert 0.5 < r.bytes_per_weight <= 0.7, r


def test_cutlass_is_not_planned_on_ampere():
    rows = plan("cuda", 80, True, torch.bfloat16)
    _check_cover(rows)
    assert "cutlass_prefill" not in {r.backend for r in rows}


def test_cpu_plan_is_the_packed_kernels():
    rows = plan("cpu", None, False, torch.bfloat16)
    _check_cover(rows)
    assert {r.backend for r in rows} <= {"cpu-packed", "reference"}


def test_cli_json_shape(capsys):
    assert main(["kernels", "--plan", "--capability", "100", "--cutlass", "built", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    keys = {"scheme", "layer", "m_min", "m_max", "backend", "bytes_per_weight"}
    assert out and {o["layer"] for o in out} == {"linear", "experts"}
    for o in out:
        assert set(o) == keys | ({"activation", "bias"} if o["layer"] == "experts" else set())
    experts = {(o["activation"], o["bias"]) for o in out if o["layer"] == "experts"}
    assert experts == {(a, b) for a in ("silu", "gelu", "swigluoai") for b in (False, True)}
    assert not [o for o in out if o["backend"] == "reference"]
