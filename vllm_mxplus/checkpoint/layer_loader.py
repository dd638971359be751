"""A transformers model whose weights live on disk until their decoder layer is calibrated.

The calibrated methods (rtn_aware.calibrate_and_quantize) visit the decoder layers one at a
time. Loading the whole model first (fp32: 4 bytes per parameter, 32 GB for an 8B model)
is what makes calibration run out of memory; here the model is built from config.json with
every parameter on the meta device (no memory; buffers such as the rotary frequencies are
real), and the safetensors tensors of one decoder layer are read (fp32, the dtype
calibration computes in) just before that layer is calibrated and dropped right after it.
The parameters outside the layers (embeddings, final norm) are read only while the
first layer's inputs are captured; lm_head is never read.

Memory: the largest decoder layer in fp32 (8B: 218M parameters, 0.87 GB) plus the
embeddings during the capture (8B: 0.5B parameters, 2.1 GB fp32), not the model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from vllm_mxplus.checkpoint.safetensors_io import TensorInfo, read_tensor
from vllm_mxplus.errors import UsageError

logger = logging.getLogger(__name__)


class StreamedModel:
    """model: the causal LM on the meta device; `load(prefix)` / `unload(prefix)` bring the
    parameters of one submodule in from the source files and drop them again."""

    def __init__(self, src: Path, tensors: Iterable[TensorInfo], device: str, method: str):
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        self.src, self.device, self.method = Path(src), device, method
        self.tensors = {t.name: t for t in tensors}
        try:
            cfg = AutoConfig.from_pretrained(str(src))
            cfg.dtype = torch.float32  # as from_pretrained(dtype=float32) computes
            with init_empty_weights(include_buffers=False):
                model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        except Exception as e:  # transformers raises many kinds for an unloadable model
            raise UsageError(
                f"{src}: transformers cannot build it for --method {method} ({e}); use --method rtn"
            ) from None
        self.model: nn.Module = model.eval()
        if device != "cpu":
            for name, buf in list(self.model.named_buffers()):
                _set(self.model, name, buf.to(device), buffer=True)

    def load(self, prefix: str) -> None:
        """Read every parameter under the module `prefix` (a decoder layer) from the source,
        fp32, onto the device."""
        self._load(lambda n: n.startswith(prefix + "."))

    def load_outer(self, layers_prefix: str) -> None:
        """The parameters outside the decoder layers, lm_head excepted (what the forward
        needs up to the first layer)."""
        self._load(lambda n: not n.startswith((layers_prefix + ".", "lm_head.")))

    def unload(self) -> None:
        """Every loaded parameter back to the meta device (the layer just calibrated, or the
        embeddings after the capture)."""
        for name, p in list(self.model.named_parameters(remove_duplicate=False)):
            if p.device.type != "meta":
                _set(self.model, name, torch.empty_like(p, device="meta"))

    def _load(self, wanted: Callable[[str], bool]) -> None:
        for name, p in list(self.model.named_parameters(remove_duplicate=False)):
            if not wanted(name) or p.device.type != "meta":
                continue
            info = self.tensors.get(name)
            if info is None:
                raise UsageError(
                    f"{self.src}: no tensor {name!r} for transformers' parameter of that name "
                    f"(--method {self.method} reads the source under transformers' names); "
                    "use --method rtn"
                )
            t = read_tensor(info)
            if tuple(t.shape) != tuple(p.shape):
                raise UsageError(
                    f"{info.path}: tensor {name!r} has shape {list(t.shape)}, transformers "
                    f"builds {list(p.shape)}; use --method rtn"
                )
            _set(self.model, name, t.to(self.device, torch.float32))


def _set(model: nn.Module, name: str, value: torch.Tensor, buffer: bool = False) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if buffer:
        mod._buffers[leaf] = value
    else:
        mod._parameters[leaf] = nn.Parameter(value, requires_grad=False)
