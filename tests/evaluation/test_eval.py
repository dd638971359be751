"""`mxplus eval`: config validation, the table builder on committed lm-eval JSON, resume
planning, and one smoke run of the runner (vLLM, tiny random Llama, 10-item local task)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mxplus.evaluation.config import ConfigError, load_config, parse_config
from vllm_mxplus.evaluation.runner import plan, resolve_model_paths
from vllm_mxplus.evaluation.table import collect, markdown_table, summarize, write_report

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
FIXTURES = Path(__file__).parent / "fixtures"
PAPER_ROWS = {"mxfp4-ocp", "mxplus", "mxfp4-16-oas", "mxfp4-mbs-s", "mxfp4-mbs-h", "nvfp4"}


# --- configs -------------------------------------------------------------------------------


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_files_validate(path: Path) -> None:
    from vllm_mxplus.formats import SCHEMES

    cfg = load_config(path)
    quant = {r.quantization for r in cfg.rows}
    assert quant - {None} <= set(SCHEMES), "only the plugin's registered names"
    if path.stem.endswith("-quick"):  # a quick check: some rows of its study, same cells
        study = load_config(path.with_name(path.stem.removesuffix("-quick") + ".yaml"))
        assert all(r in study.rows for r in cfg.rows)
        assert cfg.tasks == study.tasks and cfg.model_args == study.model_args
        assert cfg.lm_eval == study.lm_eval and cfg.models == study.models
        return
    assert quant >= PAPER_ROWS and None in quant, "every paper row plus BF16"
    assert cfg.baseline == "mxfp4-ocp" and cfg.target == "nvfp4"
    if cfg.include_path:  # local tasks: every task has its YAML and its data file
        for t in cfg.tasks:
            yaml_file = cfg.include_path / f"{t.task}.yaml"
            assert yaml_file.is_file(), yaml_file
            assert (cfg.include_path / f"{t.task}.jsonl").is_file()


def test_paper_configs_carry_the_papers_figures() -> None:
    t1 = load_config(REPO / "configs" / "table1-llama3.1-8b.yaml")
    assert t1.reference["average"] == {"mxfp4-ocp": 61.25, "mxfp4-mbs-h": 66.50, "nvfp4": 67.02}
    assert t1.reference["delta_average"]["mxfp4-ocp->mxplus"] == 1.76
    assert {t.task for t in t1.tasks if t.source == "paper"} == {"mmlu_pro", "gsm8k"}
    t6 = load_config(REPO / "configs" / "table6-wikitext.yaml")
    assert t6.reference["gap_to_target"]["qwen3-8b/mxfp4-ocp"] == 2.49
    assert [t.kind for t in t6.tasks] == ["perplexity"]


def _base() -> dict:
    return {
        "name": "x",
        "models": {"m": "/nowhere"},
        "rows": [{"id": "a", "quantization": "mxfp4-ocp"}, {"id": "b", "quantization": None}],
        "tasks": [{"task": "t", "metric": "acc,none", "kind": "accuracy"}],
    }


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda d: d.update(bogus=1), "bogus"),
        (lambda d: d.pop("name"), "'name'"),
        (lambda d: d["rows"][0].update(quantization="mxfp4-bogus"), "rows[0].quantization"),
        (lambda d: d["rows"][1].pop("quantization"), "'quantization'"),
        (lambda d: d["rows"].append({"id": "a", "quantization": None}), "rows[2].id"),
        (lambda d: d["tasks"][0].update(metric="acc"), "tasks[0].metric"),
        (lambda d: d["tasks"][0].update(kind="loss"), "tasks[0].kind"),
        (lambda d: d["tasks"][0].update(num_fewshot="5"), "tasks[0].num_fewshot"),
        (lambda d: d["tasks"][0].update(limit=0), "tasks[0].limit"),
        (lambda d: d.update(target="nvfp4"), "target"),
        (lambda d: d.update(include_path="does/not/exist"), "include_path"),
        (lambda d: d.update(reference={"average": {"nope": 1.0}}), "reference.average.nope"),
        (lambda d: d["models"].update(m={"pth": "/x"}), "models.m"),
    ],
    ids=[
        "unknown-key",
        "no-name",
        "bad-scheme",
        "no-quantization",
        "dup-row",
        "bad-metric",
        "bad-kind",
        "fewshot-str",
        "limit-0",
        "target-not-a-row",
        "include-missing",
        "reference-row",
        "model-key",
    ],
)
def test_config_errors_name_the_key(mutate, key: str, tmp_path: Path) -> None:
    data = _base()
    mutate(data)
    with pytest.raises(ConfigError, match=r".*") as info:
        parse_config(data, tmp_path / "c.yaml")
    assert key in str(info.value), str(info.value)


def test_model_override() -> None:
    cfg = parse_config(_base())
    assert resolve_model_paths(cfg, ["org/model"]) == {"m": "org/model"}
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model_paths(cfg, ["/definitely/not/here"])
    two = _base()
    two["models"] = {"m": "a/b", "n": "c/d"}
    cfg2 = parse_config(two)
    assert resolve_model_paths(cfg2, ["n=e/f"]) == {"m": "a/b", "n": "e/f"}
    with pytest.raises(ValueError, match="ID=DIR"):
        resolve_model_paths(cfg2, ["e/f"])


def test_models_filter_checks_and_plans_only_those(tmp_path: Path) -> None:
    two = _base()
    model_dir = tmp_path / "ready"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    two["models"] = {"m": str(model_dir), "n": str(tmp_path / "not-yet")}
    cfg = parse_config(two)
    # n's checkpoint does not exist yet: checking every model fails, naming it
    with pytest.raises(ValueError, match="model n: .*not-yet"):
        resolve_model_paths(cfg, [])
    paths = resolve_model_paths(cfg, [], models=["m"])
    cells, _ = plan(cfg, tmp_path / "out", paths, models=["m"])
    assert cells and {c.model.id for c in cells} == {"m"}
    cells, _ = plan(cfg, tmp_path / "out", paths)
    assert {c.model.id for c in cells} == {"m", "n"}
    with pytest.raises(ConfigError, match="unknown model 'x'"):
        plan(cfg, tmp_path / "out", paths, models=["x"])


# --- table builder on committed lm-eval JSON -----------------------------------------------


@pytest.fixture()
def fixture_cfg():
    return load_config(FIXTURES / "fixture.yaml")


def test_collect_reads_cells_and_ignores_limited_runs(fixture_cfg) -> None:
    values = collect(fixture_cfg, FIXTURES / "results")
    assert values[("m", "mxfp4-ocp", "mc_a")].value == pytest.approx(40.0)  # not the limit-5 run
    assert values[("m", "mxfp4-ocp", "mc_b")].value == pytest.approx(50.0)  # acc_norm, not acc
    assert values[("m", "nvfp4", "ppl")].value == pytest.approx(25.0)  # from a second file
    assert values[("m", "nvfp4", "ppl")].stderr is None  # "N/A" in lm-eval's JSON
    assert values[("m", "bf16", "mc_a")].n == 100
    assert not any(r == "mxplus" for _, r, _ in values)  # no saved results
    limited = collect(fixture_cfg, FIXTURES / "results", limit=5)
    assert limited[("m", "mxfp4-ocp", "mc_a")].value == pytest.approx(90.0)


def test_summary_gap_and_gap_closed(fixture_cfg) -> None:
    s = summarize(fixture_cfg, collect(fixture_cfg, FIXTURES / "results"))["m"]
    acc, ppl = s["accuracy"], s["perplexity"]
    assert acc["mxfp4-ocp"]["avg"] == pytest.approx(45.0)
    assert acc["mxfp4-mbs-h"]["avg"] == pytest.approx(52.0)
    assert acc["mxfp4-mbs-h"]["gap_to_target"] == pytest.approx(-2.0)
    assert acc["mxfp4-mbs-h"]["gap_closed_pct"] == pytest.approx(100 * 7 / 9)
    assert acc["nvfp4"]["gap_closed_pct"] == pytest.approx(100.0)
    assert acc["mxplus"]["avg"] is None
    assert ppl["mxfp4-ocp"]["gap_to_target"] == pytest.approx(5.0)
    assert ppl["mxfp4-mbs-h"]["gap_closed_pct"] == pytest.approx(80.0)
    assert ppl["bf16"]["gap_closed_pct"] == pytest.approx(120.0)


def test_markdown_table_shape(fixture_cfg) -> None:
    md = markdown_table(fixture_cfg, collect(fixture_cfg, FIXTURES / "results"))
    lines = md.splitlines()
    assert lines[0] == (
        "| Format | PPL ↓ | MC-A (%) ↑ | MC-B (%) ↑ | Avg acc | Δacc vs NVFP4 | "
        "Gap closed | Avg ppl | Δppl vs NVFP4 | Gap closed |"
    )
    assert len(lines) == 2 + len(fixture_cfg.rows)
    mbs = next(line for line in lines if line.startswith("| MXFP4-MBS-H"))
    cells = [c.strip() for c in mbs.strip("|").split("|")]
    assert cells[1] == "26.00"
    assert cells[2].startswith("48.00 ± ")
    assert cells[4:] == ["52.00", "-2.00", "78%", "26.00", "+1.00", "80%"]
    mxplus = next(line for line in lines if line.startswith("| MX+"))
    assert mxplus.count("—") == 9  # nothing saved: every cell is a dash


def test_write_report(fixture_cfg, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(FIXTURES / "results", out)
    md, js, png = write_report(fixture_cfg, out, header="- command: `x`")
    text = md.read_text()
    assert text.startswith("# fixture table") and "- command: `x`" in text
    assert "Paper reference" in text and "MXFP4-OCP -> MX+: 1.76" in text
    assert "Tasks of our choice (not named by the paper): PPL, MC-B." in text
    data = json.loads(js.read_text())
    assert data["summary"]["m"]["accuracy"]["nvfp4"]["avg"] == pytest.approx(54.0)
    assert png is not None and png.read_bytes()[:4] == b"\x89PNG"


def test_plan_resumes_from_saved_json(fixture_cfg, tmp_path: Path) -> None:
    paths = {"m": "/models/fixture"}
    cells, done = plan(fixture_cfg, FIXTURES / "results", paths)
    assert done == 4 * 3  # ocp, mbs-h, nvfp4, bf16 x 3 tasks
    assert [(c.row.id, [t.task for t in c.tasks]) for c in cells] == [
        ("mxplus", ["ppl", "mc_a", "mc_b"])
    ]
    cells, done = plan(fixture_cfg, FIXTURES / "results", paths, limit=5)
    assert done == 3 and {c.row.id for c in cells} == {"mxplus", "mxfp4-mbs-h", "nvfp4", "bf16"}
    cells, _ = plan(fixture_cfg, tmp_path, paths, rows=["bf16"])
    assert len(cells) == 1 and cells[0].row.id == "bf16"


def test_cli_dry_run(capsys) -> None:
    from vllm_mxplus.cli import main

    rc = main(
        ["eval", str(FIXTURES / "fixture.yaml"), "--out", str(FIXTURES / "results"), "--dry-run"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "lm_eval --model vllm" in out and "quantization=mxplus" in out
    assert main(["eval", str(FIXTURES / "fixture.yaml"), "--rows", "nope", "--dry-run"]) == 2


# --- smoke run through vLLM ----------------------------------------------------------------


@pytest.mark.vllm
@pytest.mark.slow
def test_runner_smoke_tiny_model(tmp_path: Path, subprocess_env) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    sys.path.insert(0, str(Path(__file__).parents[1] / "integration"))
    from tiny_models import build_tiny_llama
    from tiny_setup import write_tiny_config, write_tiny_task

    model = build_tiny_llama(tmp_path / "model", hidden=128, intermediate=256, heads=4, kv_heads=2)
    tasks = write_tiny_task(tmp_path / "tasks")
    cfg = write_tiny_config(tmp_path / "cfg.yaml", tasks, model)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "vllm_mxplus.cli",
        "eval",
        str(cfg),
        "--out",
        str(out),
        "--rows",
        "mxfp4-ocp",
        "--no-progress",
    ]
    env = {**subprocess_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    logs = "\n".join(p.read_text()[-3000:] for p in (out / "logs").glob("*.log"))
    assert proc.returncode == 0, proc.stderr[-3000:] + logs
    raw = list((out / "raw" / "tiny" / "mxfp4-ocp").glob("*.json"))
    assert len(raw) == 1
    res = json.loads(raw[0].read_text())
    assert res["config"]["model_args"]["quantization"] == "mxfp4-ocp"
    assert res["n-samples"]["tiny_mc"]["effective"] == 10
    assert 0.0 <= res["results"]["tiny_mc"]["acc,none"] <= 1.0
    md = (out / "tiny-smoke.md").read_text()
    assert "| MXFP4-OCP |" in md and (out / "tiny-smoke.png").is_file()
    # resumable: the finished cell is found and nothing runs again
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "0 cell(s) to run, 1 result(s)" in again.stderr


def test_step_gains(fixture_cfg) -> None:
    from vllm_mxplus.evaluation.table import step_gains

    lines = step_gains(fixture_cfg, collect(fixture_cfg, FIXTURES / "results"))
    # MX+ has no results: the first step spans it
    assert lines == [
        "acc: MXFP4-MBS-H − MXFP4-OCP +7.00; NVFP4 − MXFP4-MBS-H +2.00",
        "ppl: MXFP4-MBS-H − MXFP4-OCP -4.00; NVFP4 − MXFP4-MBS-H -1.00",
    ]


def test_worker_process_group_is_reaped(tmp_path: Path) -> None:
    """A worker that leaves with os._exit must not leave its children (vLLM engines) alive."""
    import os
    import time

    from vllm_mxplus.evaluation.runner import _kill_group

    pid_file = tmp_path / "child.pid"
    code = (
        "import os, subprocess, sys; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); os._exit(0)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    proc.wait(timeout=30)
    child = int(pid_file.read_text())
    os.kill(child, 0)  # the orphan is alive after its parent exited
    _kill_group(proc)
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a killed orphan stays a zombie until init reaps it; check its state instead
        stat = Path(f"/proc/{child}/stat")
        if not stat.exists() or stat.read_text().split()[2] == "Z":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {child} still running")
