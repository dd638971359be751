"""The source: a local Hugging Face model directory with safetensors weights."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_mxplus.checkpoint.errors import CheckpointError
from vllm_mxplus.checkpoint.safetensors_io import TensorInfo, read_header
from vllm_mxplus.errors import UsageError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files never copied to DST: the weights (rewritten) and other serializations of them.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")
WEIGHT_INDEX_SUFFIX = ".index.json"


@dataclass
class SourceModel:
    """A parsed source directory: config, tensors in read order, non-weight files."""

    path: Path
    config: dict[str, Any]
    tensors: list[TensorInfo]
    other_files: list[Path]

    @property
    def model_type(self) -> str | None:
        mt = self.config.get("model_type")
        return mt if isinstance(mt, str) else None


def open_source(path: Path) -> SourceModel:
    """Parse SRC: config.json, the safetensors shards (index or glob) and their headers."""
    path = Path(path)
    if not path.is_dir():
        raise UsageError(f"{path}: SRC is not a directory (a local Hugging Face model dir)")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found (SRC must be a Hugging Face model dir)")
    config = read_json(config_path)
    if "quantization_config" in config:
        qcfg = config["quantization_config"]
        method = qcfg.get("quant_method", "?") if isinstance(qcfg, dict) else qcfg
        raise CheckpointError(
            f"{config_path}: the model is already quantized (quant_method {method!r}); "
            "quantize a bf16/fp16/fp32 checkpoint"
        )
    shards = shard_files(path)
    tensors: list[TensorInfo] = []
    seen: dict[str, Path] = {}
    for shard in shards:
        infos, _ = read_header(shard)
        for t in infos:
            if t.name in seen:
                raise CheckpointError(f"{shard}: tensor {t.name!r} is also in {seen[t.name]}")
            seen[t.name] = shard
        tensors.extend(infos)
    other = sorted(
        p
        for p in path.iterdir()
        if p.is_file()
        and p.name != "config.json"
        and not p.name.endswith(WEIGHT_SUFFIXES)
        and not (p.name.endswith(WEIGHT_INDEX_SUFFIX) and ("model" in p.name))
    )
    return SourceModel(path, config, tensors, other)


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a model dir: the index's shards, model.safetensors or a glob."""
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no weight_map")
        bad = [v for v in weight_map.values() if not is_plain_file_name(v)]
        if bad:
            raise CheckpointError(
                f"{index}: weight_map names {str(bad[0])[:80]!r}, not a shard file name in {path}"
            )
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shard {missing[0]} is listed but not found in {path}")
        return [path / s for s in shards]
    single = path / SINGLE_NAME
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{path}: no *.safetensors weights (pytorch .bin is not supported)")
    return found


def is_plain_file_name(name: object) -> bool:
    """A file name inside the model dir: no directories, no '..' (index entries)."""
    return isinstance(name, str) and name not in ("", ".", "..") and name == Path(name).name


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from a file; CheckpointError naming the file otherwise."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: cannot parse JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data
