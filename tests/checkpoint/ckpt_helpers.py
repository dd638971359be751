"""Helpers for tests/checkpoint: tiny HF-style model dirs (built in < 1 s), CLI args.

A uniquely named module (not conftest) so that `from ckpt_helpers import ...` cannot pick up
another directory's conftest."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from vllm_mxplus.checkpoint.cli_quantize import add_parser
from vllm_mxplus.checkpoint.safetensors_io import read_header, read_tensor

TOKENIZER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}\n',
    "tokenizer_config.json": '{"model_max_length": 2048}\n',
    "special_tokens_map.json": '{"eos_token": "</s>"}\n',
}


def make_llama(
    path: Path,
    *,
    hidden: int = 64,
    intermediate: int = 100,
    layers: int = 1,
    tie: bool = False,
    seed: int = 0,
) -> Path:
    """A random bf16 LlamaForCausalLM saved with save_pretrained, plus tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=96,
        tie_word_embeddings=tie,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    for name, text in TOKENIZER_FILES.items():
        (path / name).write_text(text)
    return path


def make_custom(
    path: Path, tensors: dict[str, torch.Tensor], config: dict | None = None, shards: int = 1
) -> Path:
    """A model dir with the given tensors (split over `shards` files + index when > 1)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "custom", "architectures": ["CustomForCausalLM"]}
    cfg.update(config or {})
    (path / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return path


def gpt_oss_config(hidden: int, intermediate: int, experts: int, heads: int) -> dict:
    """A one-layer gpt-oss config.json dict with every size its architecture needs (head_dim
    16), so that the source check can build its skeleton."""
    return {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "num_local_experts": experts,
        "num_experts_per_tok": 1,
        "vocab_size": 64,
        "layer_types": ["full_attention"],
        "tie_word_embeddings": False,
    }


def complete_tensors(
    config: dict, tensors: dict[str, torch.Tensor], stored_as: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """`tensors` plus a random bf16 tensor for every other parameter of the model `config`
    builds (shapes from the source check's own meta-device skeleton), except the names
    stored under a suffix of `stored_as` (e.g. gpt-oss's NAME_blocks / NAME_scales)."""
    from vllm_mxplus.checkpoint.source_check import skeleton_shapes

    skeleton = skeleton_shapes(config, "test config")
    assert skeleton is not None, config.get("model_type")
    g = torch.Generator().manual_seed(1)
    out = dict(tensors)
    for name, shape in skeleton[0].items():
        if name not in out and not any(name + sfx in out for sfx in stored_as):
            out[name] = (0.1 * torch.randn(shape, generator=g)).bfloat16()
    return out


def source_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model dir, by name (any number of shards)."""
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        infos, _ = read_header(f)
        out.update({t.name: read_tensor(t) for t in infos})
    return out


def cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="mxplus")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["quantize", *argv])


def reshard(src: Path, dst: Path, shards: int) -> Path:
    """A copy of the model dir `src` whose weights are split over `shards` files + an index."""
    import shutil

    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    make_custom(dst, source_tensors(src), config, shards=shards)
    return dst
