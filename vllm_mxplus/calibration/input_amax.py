"""max |x| of each linear's input over calibration text: the static activation scale of a
compressed-tensors NVFP4 checkpoint (`input_global_scale`, checkpoint/ct_format.py).

Measured on the model as it will be written (after --smooth), unquantized, in fp32, over
every finite element of every calibration token (docs/checkpoints.md)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from vllm_mxplus.calibration.smoothing import BATCH


def linear_input_amax(
    model: nn.Module, tokens: torch.Tensor, device: str, names: Iterable[str]
) -> dict[str, torch.Tensor]:
    """{module name: fp32 [] max |x| of its input} for the named submodules of `model`."""
    wanted = set(names)
    amax = {n: torch.zeros((), dtype=torch.float32) for n in wanted}

    def record(name: str):  # noqa: ANN202
        def pre_hook(_mod: nn.Module, args: tuple) -> None:
            x = args[0].detach()
            finite = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
            amax[name] = torch.maximum(amax[name], finite.max().to("cpu", torch.float32))

        return pre_hook

    missing = wanted - {n for n, _ in model.named_modules()}
    if missing:
        raise ValueError(
            f"the transformers model has no module {sorted(missing)[0]!r} (checkpoint names "
            "and module names differ); its input scale cannot be measured"
        )
    handles = [
        mod.register_forward_pre_hook(record(n)) for n, mod in model.named_modules() if n in wanted
    ]
    try:
        with torch.no_grad():
            for b in tokens.split(BATCH):
                model(input_ids=b.to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return amax
