"""Sharded sources and sharded outputs (model.safetensors.index.json)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from ckpt_helpers import make_custom, reshard, source_tensors
from test_ckpt_roundtrip import check_round_trip

from vllm_mxplus.checkpoint import load, load_unquantized, quantize_checkpoint
from vllm_mxplus.checkpoint.safetensors_io import read_header


def test_sharded_source_equals_single(llama_dir: Path, tmp_path: Path) -> None:
    sharded = reshard(llama_dir, tmp_path / "sharded", shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    assert (sharded / "model.safetensors.index.json").is_file()
    a, b = tmp_path / "qa", tmp_path / "qb"
    quantize_checkpoint(llama_dir, a, "mxfp4-mbs-s", progress=False)
    quantize_checkpoint(sharded, b, "mxfp4-mbs-s", progress=False)
    check_round_trip(sharded, b, "mxfp4-mbs-s")
    qa, qb = load(a), load(b)
    assert qa.keys() == qb.keys()
    for k in qa:
        assert torch.equal(qa[k].codes, qb[k].codes) and torch.equal(qa[k].mbs, qb[k].mbs)
    # the output is small enough for one file
    assert [p.name for p in b.glob("*.safetensors")] == ["model.safetensors"]
    assert not (b / "model.safetensors.index.json").exists()


def test_sharded_output_has_index(tmp_path: Path) -> None:
    torch.manual_seed(0)
    tensors = {
        f"layers.{i}.proj.weight": torch.randn(64, 256, dtype=torch.bfloat16) for i in range(4)
    }
    tensors["embed_tokens.weight"] = torch.randn(32, 256, dtype=torch.bfloat16)
    tensors["norm.weight"] = torch.ones(256, dtype=torch.bfloat16)
    src = make_custom(tmp_path / "src", tensors, shards=2)
    dst = tmp_path / "q"
    report = quantize_checkpoint(src, dst, "nvfp4", max_shard_bytes=20_000, progress=False)
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert report.shards == len(files) > 1
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    stored = {}
    for f in files:
        infos, meta = read_header(dst / f)
        stored.update({t.name: f for t in infos})
        assert meta["producer"] == "vllm-mxplus" and meta["format"] == "pt"
    assert index["weight_map"] == stored
    assert index["metadata"]["total_size"] == report.bytes_out
    # every quantized weight's tensors live in one shard
    for name, f in stored.items():
        if name.endswith("weight_packed"):
            base = name[: -len("weight_packed")]
            assert all(f2 == f for n2, f2 in stored.items() if n2.startswith(base))
    check_round_trip(src, dst, "nvfp4")
    assert set(load_unquantized(dst)) == {"embed_tokens.weight", "norm.weight"}
    assert source_tensors(src).keys() == {*tensors}
