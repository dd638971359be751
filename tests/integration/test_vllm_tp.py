"""Tensor parallel (TP=2 on CPU): column- and row-parallel shards from both checkpoint kinds.

tiny256 (4 heads, 2 KV heads): qkv_proj / gate_up_proj are column-parallel fused layers,
o_proj (K per rank 128) and down_proj (K per rank 256) are row-parallel with whole macro
blocks per rank. Greedy output must equal the unsharded transformers reference: that holds
only if every shard (codes, E8M0 scales, MBS bytes, NVFP4 per-shard global scales) landed in
the right place and NVFP4 activation scales are reduced over the ranks.
"""

from __future__ import annotations

import pytest
from integration_harness import gen_job, run_driver
from test_vllm_generate import _check_against_reference

from vllm_mxplus.formats import get_scheme

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def tp_run(tiny_models, tmp_path_factory, subprocess_env):
    jobs = [
        gen_job("tp-online-mxfp4-mbs", tiny_models["tiny256"], "mxfp4-mbs", tp=2),
        gen_job("tp-pre-nvfp4", tiny_models["tiny256-nvfp4"], None, tp=2),
    ]
    return run_driver(jobs, tmp_path_factory.mktemp("tp"), subprocess_env, tp=True)


def test_tp2_online_mxfp4_mbs(tp_run, tiny_models):
    _check_against_reference(tp_run[0]["tp-online-mxfp4-mbs"], tiny_models["tiny256"], "mxfp4-mbs")


def test_tp2_prequantized_nvfp4(tp_run, tiny_models):
    _check_against_reference(tp_run[0]["tp-pre-nvfp4"], tiny_models["tiny256"], "nvfp4")


def test_row_parallel_unit_rule():
    assert get_scheme("mxfp4-mbs").group_size == 128
    assert get_scheme("mxfp4-mbs", macro_block=64).group_size == 64
    assert get_scheme("mxfp4-mbs-s", macro_block=32).group_size == 32
    assert get_scheme("mxfp4-16-oas").group_size == 16
    assert get_scheme("mxfp4-ocp").group_size == 32
    assert get_scheme("mxplus").group_size == 32
    assert get_scheme("nvfp4").group_size == 16
