"""A tiny random Llama and a 10-item local multiple-choice task for the runner smoke test."""

from __future__ import annotations

import json
from pathlib import Path

# Words of the tiny model's word-level vocabulary (tests/integration/tiny_models.py, WORDS).
ITEMS = [
    ("the capital of france is", ["paris", "water", "blue"], 0),
    ("one two three", ["four", "moon", "city"], 0),
    ("the sun is in the", ["sky", "river", "model"], 0),
    ("two three four", ["five", "red", "hello"], 0),
    ("hello", ["world", "nine", "star"], 0),
    ("the river is", ["water", "six", "who"], 0),
    ("five six seven", ["eight", "green", "user"], 0),
    ("the moon and the", ["sun", "token", "ten"], 0),
    ("who is the", ["assistant", "a", "of"], 0),
    ("six seven eight", ["nine", "paris", "sky"], 0),
]

TASK_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: tiny_mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{prompt}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_tiny_task(tasks_dir: Path) -> Path:
    tasks_dir.mkdir(parents=True, exist_ok=True)
    (tasks_dir / "tiny_mc.jsonl").write_text(
        "".join(json.dumps({"prompt": p, "choices": c, "gold": g}) + "\n" for p, c, g in ITEMS)
    )
    (tasks_dir / "tiny_mc.yaml").write_text(TASK_YAML)
    return tasks_dir


def write_tiny_config(path: Path, tasks_dir: Path, model_dir: Path) -> Path:
    path.write_text(f"""name: tiny-smoke
title: "tiny smoke test"
models:
  tiny: {{path: {model_dir}}}
model_args: {{dtype: float32, enforce_eager: true, max_model_len: 256}}
include_path: {tasks_dir}
rows:
  - {{id: mxfp4-ocp, label: MXFP4-OCP, quantization: mxfp4-ocp}}
  - {{id: bf16, label: BF16, quantization: null}}
baseline: mxfp4-ocp
target: bf16
tasks:
  - {{task: tiny_mc, label: Tiny MC, metric: "acc,none", kind: accuracy, num_fewshot: 0}}
""")
    return path
