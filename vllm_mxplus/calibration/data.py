"""Calibration tokens for the calibrated methods (`mxplus quantize --method rtn-aware|gptq`).

Default text: the embedded Wikipedia text (`mxplus prepare`), HELD OUT from the evaluation.
The perplexity task of the studies (eval/tasks/build.py) takes articles from the start of the
file in order and stopped at article 19 (16k tokens); calibration only reads articles from
HELD_OUT_FROM on, so the two never share text (tests/calibration/test_calibration_data.py checks
the committed eval task files against it). A user's own text: `--calib FILE` (plain UTF-8).

Samples: nsamples windows of seqlen tokens at random offsets (seeded) in the tokenized text,
the usual GPTQ recipe.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vllm_mxplus.assets import AssetError, prepare_wikipedia_text, read_articles
from vllm_mxplus.errors import UsageError

HELD_OUT_FROM = 50  # first Wikipedia article calibration may use (evaluation uses 0..19)
DEFAULT_NSAMPLES = 32
DEFAULT_SEQLEN = 512
SEED = 0


def default_calibration_text() -> str:
    """The held-out part of the embedded Wikipedia text (articles >= HELD_OUT_FROM)."""

    try:
        articles = read_articles(prepare_wikipedia_text())
    except AssetError as e:
        raise UsageError(f"no default calibration text ({e}); pass --calib FILE") from None
    return "\n\n".join(articles[HELD_OUT_FROM:])


def calibration_tokens(
    tokenizer_dir: str | os.PathLike[str],
    calib: str | os.PathLike[str] | None = None,
    nsamples: int = DEFAULT_NSAMPLES,
    seqlen: int = DEFAULT_SEQLEN,
) -> torch.Tensor:
    """int64 [nsamples, seqlen] token windows from `calib` (a text file) or the default text."""
    if nsamples < 1 or seqlen < 2:
        raise UsageError(f"--nsamples must be >= 1 and --seqlen >= 2 (got {nsamples}, {seqlen})")
    if calib is None:
        text, what = default_calibration_text(), "the default calibration text"
    else:
        path = Path(calib)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--calib {path}: cannot read it as UTF-8 text ({e})") from None
        what = f"--calib {path}"
    ids = _tokenize(tokenizer_dir, text)
    if ids.numel() < seqlen + 1:
        raise UsageError(f"{what} has {ids.numel()} tokens, fewer than --seqlen {seqlen}")
    gen = torch.Generator().manual_seed(SEED)
    starts = torch.randint(0, ids.numel() - seqlen, (nsamples,), generator=gen)
    return torch.stack([ids[s : s + seqlen] for s in starts.tolist()])


def _tokenize(tokenizer_dir: str | os.PathLike[str], text: str) -> torch.Tensor:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    except Exception as e:  # transformers raises many kinds for a missing/broken tokenizer
        raise UsageError(
            f"{tokenizer_dir}: cannot load its tokenizer for calibration ({e})"
        ) from None
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.int64)
