"""Read and validate a quantized checkpoint: the reverse of the quantizer.

docs/numerics.md, Packing and checkpoint layout.

`open_checkpoint(path)` parses config.json and every shard header and checks the layout
without reading tensor data: each quantized module has every tensor its format stores, with
the right dtype and shape, and nothing else. Errors name the file and the tensor at fault.
`load(path)` returns {module: QuantizedTensor}; `load_unquantized(path)` the other tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vllm_mxplus.checkpoint.codec import WEIGHTS_METADATA_KEY, decode, stored_layout
from vllm_mxplus.checkpoint.errors import CheckpointError
from vllm_mxplus.checkpoint.layout import (
    SUFFIX_BM_INDEX,
    SUFFIX_GLOBAL,
    SUFFIX_MBS,
    SUFFIX_PACKED,
    SUFFIX_SCALE,
    check_quantization_config,
    checkpoint_macro_block,
    is_mxplus_quantization_config,
)
from vllm_mxplus.checkpoint.safetensors_io import DTYPES, TensorInfo, read_header
from vllm_mxplus.checkpoint.source import (
    INDEX_NAME,
    SINGLE_NAME,
    is_plain_file_name,
    read_json,  # one JSON reader for the package
)
from vllm_mxplus.formats import MACRO_BLOCK, QuantizedTensor

ALL_SUFFIXES = (SUFFIX_PACKED, SUFFIX_SCALE, SUFFIX_MBS, SUFFIX_GLOBAL, SUFFIX_BM_INDEX)


@dataclass
class QuantizedModule:
    """One quantized weight: its logical shape and dtype and its stored tensors."""

    name: str
    shape: tuple[int, ...]
    dtype: str | None  # the source dtype ("BF16", ...) when recorded
    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # suffix -> stored tensor


@dataclass
class QuantizedCheckpoint:
    path: Path
    config: dict[str, Any]
    weight_format: str
    modules: dict[str, QuantizedModule]
    other: dict[str, TensorInfo]  # unquantized tensors by name
    macro_block: int = MACRO_BLOCK  # quantization_config.macro_block_size

    @property
    def quantization_config(self) -> dict[str, Any]:
        return self.config["quantization_config"]

    def quantized(self, device: str | torch.device = "cpu") -> dict[str, QuantizedTensor]:
        """{module name: QuantizedTensor} for every quantized weight."""
        data = _get_all([t for m in self.modules.values() for t in m.tensors.values()], device)
        out = {}
        for name, m in self.modules.items():
            try:
                out[name] = decode(
                    {sfx: data[t.name] for sfx, t in m.tensors.items()},
                    self.weight_format,
                    m.shape,
                    self.macro_block,
                )
            except (ValueError, TypeError, RuntimeError, IndexError) as e:
                raise CheckpointError(
                    f"{m.tensors[SUFFIX_PACKED].path}: cannot decode tensor "
                    f"{name}.{SUFFIX_PACKED} ({e})"
                ) from None
        return out

    def unquantized(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """{tensor name: tensor} for every tensor kept in high precision (norms, embeddings)."""
        return _get_all(list(self.other.values()), device)

    def original_dtype(self, module: str) -> torch.dtype | None:
        d = self.modules[module].dtype
        return DTYPES[d][0] if d in DTYPES else None


def load(path: str | Path, device: str | torch.device = "cpu") -> dict[str, QuantizedTensor]:
    """{module name: formats.QuantizedTensor} of the quantized checkpoint at path (validated)."""
    return open_checkpoint(path).quantized(device)


def load_unquantized(
    path: str | Path, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """The tensors stored in high precision (embeddings, lm_head, norms, ignored modules)."""
    return open_checkpoint(path).unquantized(device)


def open_checkpoint(path: str | Path) -> QuantizedCheckpoint:
    """Parse and validate the checkpoint layout at path without reading tensor data."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: not found")
    config = read_json(config_path)
    qcfg = config.get("quantization_config")
    if not is_mxplus_quantization_config(qcfg):
        raise CheckpointError(f"{config_path}: no vllm-mxplus quantization_config")
    try:
        check_quantization_config(qcfg, str(config_path))
        fmt = qcfg["weight_format"]
        macro = checkpoint_macro_block(qcfg)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        # ValueError names the field; the others come from a field of the wrong JSON type
        msg = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        if str(config_path) not in msg:
            msg = f"{config_path}: invalid quantization_config ({msg})"
        raise CheckpointError(msg) from None
    infos, shapes = _read_shards(path)
    modules, other = _group(infos, shapes)
    for m in modules.values():
        _validate_module(m, fmt, macro)
    return QuantizedCheckpoint(path, config, fmt, modules, other, macro)


def _read_shards(path: Path) -> tuple[dict[str, TensorInfo], dict[str, dict]]:
    index = path / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map") or {}
        if not isinstance(weight_map, dict) or not all(
            map(is_plain_file_name, weight_map.values())
        ):
            raise CheckpointError(
                f"{index}: weight_map must map tensor names to shard file names in {path}"
            )
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE_NAME).is_file():
        weight_map, files = {}, [SINGLE_NAME]
    else:
        raise CheckpointError(f"{path}: no {SINGLE_NAME} and no {INDEX_NAME}")
    infos: dict[str, TensorInfo] = {}
    recorded: dict[str, dict] = {}  # module -> {"shape", "dtype", "file"}
    for f in files:
        if not (path / f).is_file():
            raise CheckpointError(f"{index}: shard {f} is listed but not found")
        tensors, meta = read_header(path / f)
        for t in tensors:
            infos[t.name] = t
        recorded.update(_recorded_weights(path / f, meta))
    for name, f in weight_map.items():
        if name not in infos or infos[name].path.name != f:
            raise CheckpointError(f"{index}: tensor {name!r} is not in its listed shard {f}")
    return infos, recorded


def _recorded_weights(file: Path, meta: dict[str, str]) -> dict[str, dict]:
    """__metadata__[mxplus_weights]: {module: {"shape": [ints], "dtype": str}} (validated)."""
    try:
        rec = json.loads(meta.get(WEIGHTS_METADATA_KEY, "{}"))
    except (ValueError, RecursionError):
        rec = None
    if not isinstance(rec, dict):
        raise CheckpointError(
            f"{file}: corrupted __metadata__ {WEIGHTS_METADATA_KEY} (not a JSON object)"
        )
    for mod, r in rec.items():
        shape = r.get("shape") if isinstance(r, dict) else None
        if (
            not isinstance(shape, list)
            or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
            or not isinstance(r.get("dtype"), str | None)
        ):
            raise CheckpointError(
                f"{file}: corrupted __metadata__ {WEIGHTS_METADATA_KEY} for tensor "
                f'{mod}.{SUFFIX_PACKED}: expected {{"shape": [positive integers], '
                f'"dtype": str}}, got {str(r)[:80]}; re-create the checkpoint'
            )
    return {mod: {**r, "file": file} for mod, r in rec.items()}


def _group(infos: dict[str, TensorInfo], recorded: dict[str, dict]):
    modules: dict[str, QuantizedModule] = {}
    for name, t in infos.items():
        if name.endswith("." + SUFFIX_PACKED):
            mod = name[: -len(SUFFIX_PACKED) - 1]
            rec = recorded.get(mod)
            if rec is not None:
                shape, dtype = tuple(rec["shape"]), rec.get("dtype")
            elif t.shape:  # not recorded: assume even K (the only ambiguity of the packed shape)
                shape, dtype = t.shape[:-1] + (2 * t.shape[-1],), None
            else:
                raise CheckpointError(
                    f"{t.path}: tensor {name!r} is a scalar, expected packed codes"
                )
            modules[mod] = QuantizedModule(mod, shape, dtype)
    for mod, rec in recorded.items():
        if mod not in modules:
            raise CheckpointError(
                f"{rec['file']}: quantized weight {mod!r} (recorded in __metadata__ "
                f"{WEIGHTS_METADATA_KEY}) is missing {mod}.{SUFFIX_PACKED}"
            )
    other = {}
    for name, t in infos.items():
        mod, _, sfx = name.rpartition(".")
        if sfx in ALL_SUFFIXES:
            if mod not in modules:
                raise CheckpointError(f"{t.path}: tensor {name!r} has no {mod}.{SUFFIX_PACKED}")
            modules[mod].tensors[sfx] = t
        elif name.endswith(".weight") and name[: -len(".weight")] in modules:
            raise CheckpointError(f"{t.path}: tensor {name!r} is stored both quantized and not")
        else:
            other[name] = t
    return modules, other


def _validate_module(m: QuantizedModule, fmt: str, macro_block: int) -> None:
    try:
        expected = stored_layout(fmt, m.shape, macro_block)
    except (ValueError, TypeError, ArithmeticError, IndexError) as e:
        t = m.tensors.get(SUFFIX_PACKED)
        raise CheckpointError(
            f"{t.path if t else '?'}: tensor {m.name}.{SUFFIX_PACKED}: weight shape "
            f"{list(m.shape)} has no {fmt} layout ({e})"
        ) from None
    for sfx, t in m.tensors.items():
        if sfx not in expected:
            raise CheckpointError(
                f"{t.path}: unexpected tensor {t.name!r}: format {fmt} does not store {sfx}"
            )
    for sfx, (dtype, shape) in expected.items():
        got = m.tensors.get(sfx)
        if got is None:
            where = m.tensors[SUFFIX_PACKED].path
            raise CheckpointError(
                f"{where}: missing tensor {m.name}.{sfx} (format {fmt} stores "
                f"{', '.join(expected)})"
            )
        t = got
        if t.dtype != dtype:
            raise CheckpointError(
                f"{t.path}: tensor {t.name!r} has dtype {t.dtype}, expected {dtype}"
            )
        if t.shape != shape:
            raise CheckpointError(
                f"{t.path}: tensor {t.name!r} has shape {list(t.shape)}, expected {list(shape)} "
                f"for a weight of shape {list(m.shape)}"
            )


def _get_all(infos: list[TensorInfo], device: str | torch.device) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for t in infos:
        by_file.setdefault(t.path, []).append(t.name)
    out: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        name = None
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as f:
                for name in names:
                    out[name] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({e})") from None
    return out
