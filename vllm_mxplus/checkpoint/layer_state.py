"""Calibration state on disk, per finished decoder layer: what `--resume` continues from.

A calibrated run (`mxplus quantize --method rtn-aware|gptq`) keeps, in a hidden directory
next to DST (`.DST.mxplus-calib`):
* `layer-NNNNN.safetensors`: the quantized weights of decoder layer NNNNN in the stored
  layout of docs/numerics.md (codec.encode; module name, format and shape in the metadata);
* `hidden-NNNNN.pt`: the calibration hidden states entering layer NNNNN (and the keyword
  arguments the layers take: rotary embeddings, masks), i.e. the outputs of the layers before
  it, already quantized;
* `state.json`: the request's fingerprint and how many layers are done, written last (after
  an atomic rename of each file above), so a run killed at any point leaves a state whose
  `done` layers are all on disk.

Memory: the quantized weights of finished layers are not held; the writer reads them back one
layer at a time (`LayerResults`). A run that finishes removes the directory. `--resume` with
the same request continues after the last finished layer; a different request (another
scheme, method, calibration text, source, ...) is refused, naming what differs.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from vllm_mxplus.checkpoint.codec import decode, encode
from vllm_mxplus.errors import UsageError
from vllm_mxplus.formats import QuantizedTensor

logger = logging.getLogger(__name__)

STATE_TAG = ".mxplus-calib"
STATE_FILE = "state.json"
VERSION = 1  # of this directory's layout


def state_dir(dst: Path) -> Path:
    """The calibration state directory of a DST."""
    return dst.parent / f".{dst.name}{STATE_TAG}"


class CalibrationState:
    """Open (and, unless resuming a matching run, start afresh) the state of `dst`.

    fingerprint: JSON-able description of the request; `done` layers are on disk."""

    def __init__(self, dst: Path, fingerprint: dict[str, Any], resume: bool):
        self.path = state_dir(dst)
        self.fingerprint = {"version": VERSION, **fingerprint}
        self.done = 0
        old = self._read()
        if old is not None and resume:
            diff = sorted(
                k
                for k in set(old["fingerprint"]) | set(self.fingerprint)
                if old["fingerprint"].get(k) != self.fingerprint.get(k)
            )
            if diff:
                raise UsageError(
                    f"--resume: {self.path} holds a calibration of another request ({', '.join(diff)} "
                    "differ); run the same command as before, or drop --resume to start over"
                )
            self.done = int(old["done"])
            # a warning, so that the CLI (warnings only) shows it
            logger.warning(
                "--resume: %d decoder layer(s) already calibrated in %s, continuing after them",
                self.done,
                self.path,
            )
            return
        if resume:
            logger.info("--resume: no calibration state in %s, starting from layer 0", self.path)
        elif old is not None and old.get("done"):
            logger.warning(
                "%s: a calibration of %d layer(s) left by an interrupted run is discarded "
                "(pass --resume to continue it)",
                self.path,
                old["done"],
            )
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True)
        self._write_state()

    def _read(self) -> dict[str, Any] | None:
        f = self.path / STATE_FILE
        if not f.is_file():
            return None
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
            if isinstance(data, dict) and isinstance(data.get("fingerprint"), dict):
                int(data["done"])
                return data
        except (OSError, ValueError, KeyError, TypeError):
            pass
        logger.warning("%s: unreadable calibration state, starting over", f)
        return None

    def _write_state(self) -> None:
        _atomic_write_text(
            self.path / STATE_FILE,
            json.dumps({"fingerprint": self.fingerprint, "done": self.done}, indent=1),
        )

    def hidden(self, device: str) -> list[tuple[torch.Tensor, dict]]:
        """The hidden states entering layer `done` (done > 0), on `device`."""
        f = self.path / f"hidden-{self.done:05d}.pt"
        try:
            return torch.load(f, map_location=device, weights_only=False)
        except (OSError, RuntimeError, EOFError) as e:
            raise UsageError(
                f"--resume: {f} cannot be read ({e}); drop --resume to start over"
            ) from None

    def save_layer(
        self,
        index: int,
        weights: dict[str, QuantizedTensor],
        hidden: list[tuple[torch.Tensor, dict]],
    ) -> None:
        """Layer `index` is finished: its weights and the hidden states after it, then the
        state (the commit point), then the previous hidden states are removed."""
        assert index == self.done, (index, self.done)
        tensors: dict[str, torch.Tensor] = {}
        meta: dict[str, str] = {}
        for module, q in weights.items():
            for suffix, t in encode(q).items():
                tensors[f"{module}.{suffix}"] = t
            meta[module] = json.dumps({"fmt": q.fmt, "shape": list(q.shape)})
        layer_file = self.path / f"layer-{index:05d}.safetensors"
        tmp = layer_file.with_suffix(".tmp")
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, layer_file)
        hidden_file = self.path / f"hidden-{index + 1:05d}.pt"
        tmp = hidden_file.with_suffix(".tmp")
        torch.save([(h.to("cpu"), _to_cpu(kw)) for h, kw in hidden], tmp)
        os.replace(tmp, hidden_file)
        self.done = index + 1
        self._write_state()
        (self.path / f"hidden-{index:05d}.pt").unlink(missing_ok=True)

    def results(self, macro_block: int) -> LayerResults:
        return LayerResults(sorted(self.path.glob("layer-*.safetensors")), macro_block)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class LayerResults(MutableMapping[str, QuantizedTensor]):
    """The quantized weights of finished layers by module, read from disk one layer file at a
    time (the writer takes them in layer order), forgotten once taken (`pop`)."""

    def __init__(self, files: list[Path], macro_block: int):
        self.macro_block = macro_block
        self.where: dict[str, Path] = {}
        for f in files:
            with safe_open(str(f), "pt") as h:
                for module in h.metadata() or {}:
                    self.where[module] = f
        self._cached: tuple[Path | None, dict[str, QuantizedTensor]] = (None, {})

    def __getitem__(self, module: str) -> QuantizedTensor:
        f = self.where[module]
        if self._cached[0] != f:
            self._cached = (f, self._read(f))
        return self._cached[1][module]

    def _read(self, f: Path) -> dict[str, QuantizedTensor]:
        out = {}
        with safe_open(str(f), "pt") as h:
            names = list(h.keys())
            for module, info in (h.metadata() or {}).items():
                spec = json.loads(info)
                stored = {
                    n[len(module) + 1 :]: h.get_tensor(n)
                    for n in names
                    if n.startswith(module + ".") and "." not in n[len(module) + 1 :]
                }
                out[module] = decode(stored, spec["fmt"], tuple(spec["shape"]), self.macro_block)
        return out

    def __setitem__(self, module: str, q: QuantizedTensor) -> None:
        raise TypeError("LayerResults is filled by CalibrationState.save_layer")

    def __delitem__(self, module: str) -> None:
        del self.where[module]

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to("cpu")
    if isinstance(obj, tuple):
        return tuple(_to_cpu(o) for o in obj)
    if isinstance(obj, list):
        return [_to_cpu(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
