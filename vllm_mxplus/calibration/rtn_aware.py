"""Sequential, layer-by-layer calibration of a transformers decoder for rtn-aware / gptq.

The model runs in fp32 on CPU (or the --device), one decoder layer at a time over all
calibration samples: the inputs of layer i are the outputs of layers 0..i-1 already
quantized, with every quantized linear's activations fake-quantized with the scheme's
activation format, as the served model computes them (ops.reference.fake_quant_activation),
at the checkpoint's macro block (`macro_block`: one MBS byte per that many elements of the
weights and activations alike; docs/numerics.md, "Macro Block Scaling"). Per layer: one pass
collects, for each quantized linear, H = sum x x^T of its (quantized) inputs; the linears
are quantized (gptq: H; rtn-aware: diag(H)); a second pass with the quantized weights gives
the next layer's inputs. Memory: the hidden states of the samples plus one layer's Hessians
(K x K each).

With a `StreamedModel` (layer_loader.py) only the layer being calibrated has its weights in
memory; with a `CalibrationState` (layer_state.py) each finished layer's quantized weights and
the hidden states after it go to disk, so the result holds no layer in memory and an
interrupted run resumes after its last finished layer. The progress bar counts layers (with
an ETA) and names the step of the current one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch import nn
from tqdm.auto import tqdm

from vllm_mxplus.backends.reference.linear import fake_quant_activation
from vllm_mxplus.calibration.gptq import (
    can_fuse_rows,
    check_weight,
    gptq,
    prepare_hessian,
    rtn_aware,
    split_rows,
)
from vllm_mxplus.errors import UsageError
from vllm_mxplus.formats import (
    QuantizedTensor,
    check_macro_block,
    get_format,
    get_scheme,
)


class StreamedModel(Protocol):
    """One decoder layer's weights in memory at a time; the quantizer driver builds it
    (checkpoint/layer_loader.py) and passes it in."""

    def load(self, prefix: str) -> None: ...
    def load_outer(self, layers_prefix: str) -> None: ...
    def unload(self) -> None: ...


class CalibrationState(Protocol):
    """Finished layers on disk, for `--resume`; the quantizer driver builds it
    (checkpoint/layer_state.py) and passes it in."""

    done: int

    def hidden(self, device: str) -> list[tuple[torch.Tensor, dict]]: ...
    def save_layer(
        self,
        index: int,
        weights: dict[str, QuantizedTensor],
        hidden: list[tuple[torch.Tensor, dict]],
    ) -> None: ...
    def results(self, macro_block: int) -> Any: ...


logger = logging.getLogger(__name__)

Method = Literal["rtn-aware", "gptq"]
METHODS = ("rtn", "rtn-aware", "gptq")
BATCH = 4  # calibration samples per forward call


class _Stop(Exception):
    pass


@dataclass
class CalibrationResult:
    """Quantized weights by module name, and the modules calibration could not reach."""

    weights: MutableMapping[str, QuantizedTensor] = field(default_factory=dict)
    tokens: int = 0
    layer_seconds: list[float] = field(default_factory=list)  # per layer calibrated in this run


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    for prefix in ("model.layers", "model.language_model.layers", "transformer.h"):
        mod: nn.Module | None = model
        for part in prefix.split("."):
            mod = getattr(mod, part, None)
        if isinstance(mod, nn.ModuleList):
            return prefix, mod
    raise UsageError(
        "calibrated methods need a decoder-only transformers model with "
        "model.layers (Llama-like); use --method rtn for this model"
    )


def _capture_first_inputs(
    model: nn.Module, layer0: nn.Module, tokens: torch.Tensor, device: str
) -> list[tuple[torch.Tensor, dict]]:
    """(hidden_states, kwargs) that reach layer 0, per batch of samples."""
    seen: list[tuple[torch.Tensor, dict]] = []

    def hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        hs = args[0] if args else kwargs.pop("hidden_states")
        seen.append((hs.detach(), {k: v for k, v in kwargs.items() if k != "hidden_states"}))
        raise _Stop

    handle = layer0.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for b in tokens.split(BATCH):
            try:  # noqa: SIM105
                model(input_ids=b.to(device), use_cache=False)
            except _Stop:
                pass
    finally:
        handle.remove()
    return seen


def _layer_out(layer: nn.Module, hs: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hs, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def calibrate_and_quantize(
    model: nn.Module,
    tokens: torch.Tensor,
    scheme: str,
    method: Method,
    targets: Iterable[str],
    device: str = "cpu",
    progress: bool = True,
    on_layer: Callable[[int, int], None] | None = None,
    *,
    macro_block: int,
    nvfp4_global: Callable[[str], torch.Tensor] | None = None,
    streamed: StreamedModel | None = None,
    state: CalibrationState | None = None,
) -> CalibrationResult:
    """Quantize the nn.Linear modules named in `targets` (inside decoder layers) of `model`.

    `model` is modified in place: each quantized linear's weight becomes its dequantized
    value. Returns the QuantizedTensors by module name; targets outside the decoder layers
    are not in the result (the caller quantizes them with plain RTN). macro_block: elements
    per MBS byte of the weights and of the activations the layers see (as served).
    nvfp4_global: module name -> the fixed nvfp4 global scale its group parameters are chosen
    under, the one the checkpoint layout stores (ct_format.py); None: the plugin's rule on
    each original weight (gptq.nvfp4_weight_global).
    streamed: `model` is its meta-device model; each layer's weights are read just before the
    layer is calibrated and dropped after it. state: each finished layer goes to disk and the
    result's weights are read back from there; a state with `done` layers resumes after them.
    """
    try:
        check_macro_block(scheme, macro_block, "--macro-block")
    except ValueError as e:
        raise UsageError(str(e)) from None
    s = get_scheme(scheme)
    wfmt, afmt = s.weight_format, s.activation_format
    per_row = get_format(afmt).has_global_scale
    if nvfp4_global is not None and not get_format(wfmt).has_global_scale:
        raise ValueError(f"nvfp4_global given for {scheme}, whose weights have no global scale")
    targets = set(targets)
    prefix, layers = _decoder_layers(model)
    model.eval()
    result = CalibrationResult(tokens=int(tokens.numel()))
    start = 0 if state is None else state.done
    if start > len(layers):
        raise UsageError(f"--resume: the state has {start} layers done, the model {len(layers)}")
    with torch.no_grad():
        if start:
            batches = state.hidden(device)  # type: ignore[union-attr]
        else:
            if streamed is not None:
                streamed.load_outer(prefix)
            batches = _capture_first_inputs(model, layers[0], tokens, device)
            if streamed is not None:
                streamed.unload()
        bar = tqdm(
            total=len(layers),
            initial=start,
            desc=f"{method} {wfmt}",
            unit="layer",
            disable=not progress,
            dynamic_ncols=True,
        )
        try:
            for i in range(start, len(layers)):
                t0 = time.perf_counter()
                layer = layers[i]
                bar.set_postfix_str(f"layer {i}: loading", refresh=True)
                if streamed is not None:
                    streamed.load(f"{prefix}.{i}")
                bar.set_postfix_str(f"layer {i}: Hessians", refresh=True)
                done: dict[str, QuantizedTensor] = {}
                names = {
                    f"{prefix}.{i}.{n}": m
                    for n, m in layer.named_modules()
                    if isinstance(m, nn.Linear) and f"{prefix}.{i}.{n}" in targets
                }
                hess = _collect_hessians(layer, names, batches, afmt, per_row, macro_block)
                bar.set_postfix_str(f"layer {i}: {method}", refresh=True)
                prepared: dict[int, tuple] = {}  # per shared H (q/k/v, gate/up)
                # thousands of small ops: one thread (see _one_thread)
                with _one_thread():
                    for group in _sibling_groups(
                        names, hess, method == "gptq" and can_fuse_rows(wfmt)
                    ):
                        h, n_tok = hess[group[0]]
                        label = "+".join(group)
                        # nvfp4 is never row-fused (can_fuse_rows): one module per group
                        given = None if nvfp4_global is None else nvfp4_global(group[0])
                        try:
                            ws = [
                                check_weight(names[n].weight.detach().to("cpu", torch.float32), n)
                                for n in group
                            ]
                            if method == "gptq":
                                # siblings sharing H (q/k/v, gate/up) as one GPTQ over their
                                # stacked rows: the same result per row, one column loop
                                w = ws[0] if len(ws) == 1 else torch.cat(ws, 0)
                                if id(h) not in prepared:
                                    prepared[id(h)] = prepare_hessian(h, h.shape[0], label)
                                q = gptq(
                                    w,
                                    h,
                                    wfmt,
                                    name=label,
                                    prepared=prepared[id(h)],
                                    macro_block=macro_block,
                                    global_scale=given,
                                )
                                qs = (
                                    [q] if len(ws) == 1 else split_rows(q, [x.shape[0] for x in ws])
                                )
                            else:
                                d = torch.diagonal(h) / max(n_tok, 1)
                                qs = [
                                    rtn_aware(
                                        ws[0],
                                        d,
                                        wfmt,
                                        name=label,
                                        macro_block=macro_block,
                                        global_scale=given,
                                    )
                                ]
                        except ValueError as e:
                            raise UsageError(str(e)) from None
                        for name, q in zip(group, qs):
                            mod = names[name]
                            done[name] = q
                            mod.weight.data = q.dequantize(torch.float32).to(
                                mod.weight.device, mod.weight.dtype
                            )
                del hess, prepared
                bar.set_postfix_str(f"layer {i}: outputs", refresh=True)
                with _act_quant(names, afmt, per_row, macro_block=macro_block):
                    batches = [(_layer_out(layer, hs, kw), kw) for hs, kw in batches]
                if streamed is not None:
                    streamed.unload()
                if state is not None:
                    state.save_layer(i, done, batches)
                else:
                    result.weights.update(done)
                del done
                result.layer_seconds.append(time.perf_counter() - t0)
                bar.update(1)
                if on_layer is not None:
                    on_layer(i + 1, len(layers))
        finally:
            bar.close()
    if state is not None:
        result.weights = state.results(macro_block)
    return result


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch intra-op threads = 1 for the weight quantization of a layer (restored after).

    Its ops are small (one column of N weights per GPTQ step, chunks of the parameter
    search), so threads buy little on an idle machine; on a loaded one every parallel region
    waits for a descheduled thread: 2 threads on the shared 2-core machine of this project
    took 12x the CPU time and 40x the wall time of 1 (eval/gptq/results/).
    The ops are row by row or sequential (index_add_, cumsum, per-row reductions): the
    output with 2 threads was bit-identical to 1 thread's on that machine.
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _sibling_groups(
    names: dict[str, nn.Linear], hess: dict[str, tuple[torch.Tensor, int]], fuse: bool
) -> list[list[str]]:
    """The linears in order, those sharing one H object together when `fuse`, else one each."""
    if not fuse:
        return [[n] for n in names]
    groups: dict[int, list[str]] = {}
    for n in names:
        groups.setdefault(id(hess[n][0]), []).append(n)
    return list(groups.values())


class _act_quant:
    """Context: the named linears fake-quantize their inputs (as served); optional H sums."""

    def __init__(
        self,
        mods: dict[str, nn.Linear],
        afmt: str,
        per_row: bool,
        hess: dict[str, list] | None = None,
        *,
        macro_block: int,
    ):
        self.mods, self.afmt, self.per_row, self.hess = mods, afmt, per_row, hess
        self.macro_block = macro_block
        self.handles: list = []
        # q/k/v (and gate/up) receive the same input tensor object: quantize it and form
        # its x^T x once (the reference held here keeps that object alive, so `is` is safe).
        self._last: tuple = (None, None, None)

    def __enter__(self) -> _act_quant:
        for name, mod in self.mods.items():
            self.handles.append(mod.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()

    def _hook(self, name: str) -> Callable:
        def hook(_mod: nn.Module, args: tuple) -> tuple:
            x = args[0]
            if self._last[0] is x:  # a sibling of `owner`: share its accumulator
                _, xq, owner = self._last
                if self.hess is not None:
                    self.hess[name] = self.hess[owner]
            else:
                xq = fake_quant_activation(x, self.afmt, self.per_row, self.macro_block)
                if self.hess is not None:
                    flat = xq.reshape(-1, xq.shape[-1]).to("cpu", torch.float32)
                    acc = self.hess[name]
                    acc[0] += (flat.T @ flat).double()
                    acc[1] += flat.shape[0]
                self._last = (x, xq, name)
            return (xq.to(x.dtype), *args[1:])

        return hook


def _collect_hessians(
    layer: nn.Module,
    mods: dict[str, nn.Linear],
    batches: list[tuple[torch.Tensor, dict]],
    afmt: str,
    per_row: bool,
    macro_block: int,
) -> dict[str, tuple[torch.Tensor, int]]:
    hess: dict[str, list] = {
        n: [torch.zeros(m.in_features, m.in_features, dtype=torch.float64), 0]
        for n, m in mods.items()
    }
    with _act_quant(mods, afmt, per_row, hess, macro_block=macro_block):
        for hs, kw in batches:
            _layer_out(layer, hs, kw)
    # siblings share one accumulator list, hence one H tensor object
    return {n: (acc[0], acc[1]) for n, acc in hess.items()}
