"""Evaluation configs: which model(s), which rows (quantization schemes), which lm-eval tasks.

A config is one YAML file per paper table (see configs/README.md for the format). Loading
validates every key and raises :class:`ConfigError` with a one-line message naming the file
and the key at fault, so that a typo never costs a multi-hour run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A row's quantization must be one of the plugin's names (docs/numerics.md, Formats and
# schemes) or null (bf16).
KNOWN_QUANTIZATIONS = (
    "mxfp4-ocp",
    "mxplus",
    "mxfp4-16-oas",
    "mxfp4-mbs-s",
    "mxfp4-mbs-h",
    "mxfp4-mbs",
    "nvfp4",
)
KINDS = ("accuracy", "perplexity")
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # used in file names

TOP_KEYS = {
    "name",
    "title",
    "description",
    "models",
    "model_args",
    "include_path",
    "rows",
    "tasks",
    "baseline",
    "target",
    "reference",
    "lm_eval",
    "env",
}
MODEL_KEYS = {"label", "path", "model_args"}
ROW_KEYS = {"id", "label", "quantization", "model_args"}
TASK_KEYS = {
    "task",
    "label",
    "metric",
    "kind",
    "num_fewshot",
    "limit",
    "source",
    "scale",
    "apply_chat_template",
    "fewshot_as_multiturn",
    "gen_kwargs",
    "note",
}
LM_EVAL_KEYS = {"batch_size", "seed", "log_samples"}


class ConfigError(ValueError):
    """An invalid eval config; the message names the file and the key."""


@dataclass(frozen=True)
class ModelSpec:
    id: str
    label: str
    path: str  # hub id or local dir; `mxplus eval --model` overrides it
    model_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RowSpec:
    id: str
    label: str
    quantization: str | None  # None = the unquantized checkpoint (bf16 row)
    model_args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TaskSpec:
    task: str  # lm-eval task name
    label: str
    metric: str  # lm-eval result key, e.g. "acc,none" or "word_perplexity,none"
    kind: str  # "accuracy" (higher is better, shown in %) or "perplexity" (lower is better)
    num_fewshot: int | None = None  # None: the task's own default
    limit: float | None = None  # items per task (int) or fraction (<1); None: all
    source: str = "ours"  # "paper": the paper names it; "ours": our choice
    scale: float = 1.0  # value shown = metric * scale (100 for accuracies in %)
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False
    gen_kwargs: str | None = None
    note: str = ""

    @property
    def higher_is_better(self) -> bool:
        return self.kind == "accuracy"

    def group_key(self) -> tuple:
        """Tasks with equal keys run in one lm-eval call (one engine start)."""
        return (
            self.num_fewshot,
            self.limit,
            self.apply_chat_template,
            self.fewshot_as_multiturn,
            self.gen_kwargs,
        )


@dataclass(frozen=True)
class EvalConfig:
    name: str
    title: str
    models: tuple[ModelSpec, ...]
    rows: tuple[RowSpec, ...]
    tasks: tuple[TaskSpec, ...]
    model_args: dict[str, Any]
    include_path: Path | None
    baseline: str | None  # row id of the "gap closed" baseline (MXFP4-OCP)
    target: str | None  # row id of the reference format (NVFP4)
    reference: dict[str, Any]
    lm_eval: dict[str, Any]
    env: dict[str, str]
    description: str = ""
    source: Path | None = None

    def row(self, row_id: str) -> RowSpec:
        return self._by_id(self.rows, row_id, "row")

    def model(self, model_id: str) -> ModelSpec:
        return self._by_id(self.models, model_id, "model")

    def _by_id(self, entries: tuple[Any, ...], ident: str, what: str) -> Any:
        for e in entries:
            if e.id == ident:
                return e
        raise ConfigError(
            f"{self.source}: unknown {what} {ident!r}; {what}s: {', '.join(e.id for e in entries)}"
        )


def _fail(where: str, msg: str) -> ConfigError:
    return ConfigError(f"{where}: {msg}")


def _check_keys(d: Any, allowed: set[str], where: str) -> dict:
    if not isinstance(d, dict):
        raise _fail(where, f"must be a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise _fail(
            where, f"unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )
    return d


def _req(d: dict, key: str, typ: type | tuple, where: str) -> Any:
    if key not in d:
        raise _fail(where, f"missing required key '{key}'")
    return _typed(d[key], typ, f"{where}.{key}")


def _typed(value: Any, typ: type | tuple, where: str) -> Any:
    if isinstance(value, bool) and typ in (int, float, (int, float)):
        raise _fail(where, f"must be {_tname(typ)}, got bool")
    if not isinstance(value, typ):
        raise _fail(where, f"must be {_tname(typ)}, got {type(value).__name__} ({value!r})")
    return value


def _tname(typ: type | tuple) -> str:
    if isinstance(typ, tuple):
        return " or ".join(t.__name__ for t in typ)
    return typ.__name__


def _ident(value: Any, where: str) -> str:
    value = _typed(value, str, where)
    if not _ID.match(value):
        raise _fail(where, f"{value!r} must match {_ID.pattern} (it names files)")
    return value


def _label_and_args(spec: dict, default_label: str, where: str) -> tuple[str, dict]:
    """A model's or a row's optional `label` (default: its id) and `model_args` (default {})."""
    label = _typed(spec.get("label", default_label), str, f"{where}.label")
    model_args = dict(_typed(spec.get("model_args", {}), dict, f"{where}.model_args"))
    return label, model_args


def _parse_models(raw: Any, where: str) -> tuple[ModelSpec, ...]:
    if not isinstance(raw, dict) or not raw:
        raise _fail(where, "must be a non-empty mapping of model id -> {path, label, model_args}")
    out = []
    for mid, spec in raw.items():
        w = f"{where}.{mid}"
        _ident(mid, w)
        if isinstance(spec, str):
            spec = {"path": spec}
        _check_keys(spec, MODEL_KEYS, w)
        label, model_args = _label_and_args(spec, mid, w)
        out.append(
            ModelSpec(id=mid, label=label, path=_req(spec, "path", str, w), model_args=model_args)
        )
    return tuple(out)


def _unique_entries(
    raw: Any, where: str, shape: str, keys: set[str], key: str, what: str, ident: bool
) -> Iterator[tuple[str, dict, str]]:
    """(where, entry, its `key` value) for each entry of raw, which must be a non-empty list
    of mappings (`shape` in the message) with allowed keys `keys` and unique `key` values (a
    file-naming identifier when `ident`)."""
    if not isinstance(raw, list) or not raw:
        raise _fail(where, f"must be a non-empty list of {shape}")
    seen = set()
    for i, spec in enumerate(raw):
        w = f"{where}[{i}]"
        _check_keys(spec, keys, w)
        value = _req(spec, key, str, w)
        if ident:
            _ident(value, f"{w}.{key}")
        if value in seen:
            raise _fail(f"{w}.{key}", f"duplicate {what} {value!r}")
        seen.add(value)
        yield w, spec, value


def _parse_rows(raw: Any, where: str) -> tuple[RowSpec, ...]:
    out = []
    shape = "{id, label, quantization}"
    for w, spec, rid in _unique_entries(raw, where, shape, ROW_KEYS, "id", "row id", True):
        if "quantization" not in spec:
            raise _fail(w, "missing required key 'quantization' (a scheme name, or null for bf16)")
        q = spec["quantization"]
        if q is not None:
            _typed(q, str, f"{w}.quantization")
            if q not in KNOWN_QUANTIZATIONS:
                raise _fail(
                    f"{w}.quantization",
                    f"unknown scheme {q!r}; valid: {', '.join(KNOWN_QUANTIZATIONS)} or null",
                )
        label, model_args = _label_and_args(spec, rid, w)
        out.append(RowSpec(id=rid, label=label, quantization=q, model_args=model_args))
    return tuple(out)


def _parse_tasks(raw: Any, where: str) -> tuple[TaskSpec, ...]:
    out = []
    shape = "{task, metric, kind, ...}"
    for w, spec, name in _unique_entries(raw, where, shape, TASK_KEYS, "task", "task", False):
        metric = _req(spec, "metric", str, w)
        if "," not in metric:
            raise _fail(
                f"{w}.metric",
                f"{metric!r} must be an lm-eval result key "
                "'METRIC,FILTER', e.g. 'acc,none' or 'exact_match,strict-match'",
            )
        kind = _req(spec, "kind", str, w)
        if kind not in KINDS:
            raise _fail(f"{w}.kind", f"{kind!r} must be one of {', '.join(KINDS)}")
        fewshot = spec.get("num_fewshot")
        if fewshot is not None and (_typed(fewshot, int, f"{w}.num_fewshot") < 0):
            raise _fail(f"{w}.num_fewshot", "must be >= 0")
        limit = spec.get("limit")
        if limit is not None and _typed(limit, (int, float), f"{w}.limit") <= 0:
            raise _fail(f"{w}.limit", "must be > 0 (items, or a fraction < 1)")
        source = spec.get("source", "ours")
        if source not in ("paper", "ours"):
            raise _fail(f"{w}.source", f"{source!r} must be 'paper' or 'ours'")
        default_scale = 100.0 if kind == "accuracy" else 1.0
        out.append(
            TaskSpec(
                task=name,
                label=_typed(spec.get("label", name), str, f"{w}.label"),
                metric=metric,
                kind=kind,
                num_fewshot=fewshot,
                limit=limit,
                source=source,
                scale=float(_typed(spec.get("scale", default_scale), (int, float), f"{w}.scale")),
                apply_chat_template=_typed(
                    spec.get("apply_chat_template", False), bool, f"{w}.apply_chat_template"
                ),
                fewshot_as_multiturn=_typed(
                    spec.get("fewshot_as_multiturn", False), bool, f"{w}.fewshot_as_multiturn"
                ),
                gen_kwargs=spec.get("gen_kwargs"),
                note=_typed(spec.get("note", ""), str, f"{w}.note"),
            )
        )
    return tuple(out)


def parse_config(data: Any, source: Path | None = None) -> EvalConfig:
    """Validate a loaded YAML mapping; relative include_path resolves against the file."""
    where = str(source) if source else "<config>"
    _check_keys(data, TOP_KEYS, where)
    name = _ident(_req(data, "name", str, where), f"{where}: name")
    models = _parse_models(data.get("models"), f"{where}: models")
    rows = _parse_rows(data.get("rows"), f"{where}: rows")
    tasks = _parse_tasks(data.get("tasks"), f"{where}: tasks")
    row_ids = {r.id for r in rows}
    for key in ("baseline", "target"):
        v = data.get(key)
        if v is not None and v not in row_ids:
            raise _fail(f"{where}: {key}", f"{v!r} is not a row id; rows: {', '.join(row_ids)}")
    include = data.get("include_path")
    include_path = None
    if include is not None:
        _typed(include, str, f"{where}: include_path")
        base = source.parent if source else Path.cwd()
        include_path = (base / include).resolve()
        if not include_path.is_dir():
            raise _fail(f"{where}: include_path", f"{include_path} is not a directory")
    lm_eval = dict(_check_keys(data.get("lm_eval", {}), LM_EVAL_KEYS, f"{where}: lm_eval"))
    env = _typed(data.get("env", {}), dict, f"{where}: env")
    reference = _typed(data.get("reference", {}), dict, f"{where}: reference")
    _check_reference(reference, row_ids, {t.task for t in tasks}, f"{where}: reference")
    return EvalConfig(
        name=name,
        title=_typed(data.get("title", name), str, f"{where}: title"),
        description=_typed(data.get("description", ""), str, f"{where}: description"),
        models=models,
        rows=rows,
        tasks=tasks,
        model_args=dict(_typed(data.get("model_args", {}), dict, f"{where}: model_args")),
        include_path=include_path,
        baseline=data.get("baseline"),
        target=data.get("target"),
        reference=reference,
        lm_eval=lm_eval,
        env={str(k): str(v) for k, v in env.items()},
        source=source,
    )


REFERENCE_KEYS = {"text", "source", "average", "delta_average", "gap_to_target"}


def _check_reference(ref: dict, row_ids: set[str], tasks: set[str], where: str) -> None:
    """reference: the paper's own figures, quoted; numbers keyed by row id (or model/row)."""
    _check_keys(ref, REFERENCE_KEYS, where)
    for key in ("average", "delta_average", "gap_to_target"):
        block = ref.get(key, {})
        _typed(block, dict, f"{where}.{key}")
        for k, v in block.items():
            # keys: "row" or "model/row" or "row-a->row-b" (delta between rows)
            parts = re.split(r"/|->", str(k))
            rows_named = [p for p in parts if p in row_ids]
            if not rows_named:
                raise _fail(f"{where}.{key}.{k}", f"names no row id ({', '.join(sorted(row_ids))})")
            if isinstance(v, dict):
                for kk, vv in v.items():
                    _typed(vv, (int, float), f"{where}.{key}.{k}.{kk}")
            else:
                _typed(v, (int, float), f"{where}.{key}.{k}")


def load_config(path: str | Path) -> EvalConfig:
    """Read and validate one YAML config file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return parse_config(data, path.resolve())
