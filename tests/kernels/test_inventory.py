"""kernels/INVENTORY.md is the inventory the sources give today (python kernels/inventory.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _inventory():
    spec = importlib.util.spec_from_file_location(
        "kernel_inventory", REPO / "kernels" / "inventory.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_inventory_is_current():
    inv = _inventory()
    assert (REPO / "kernels" / "INVENTORY.md").read_text() == inv.render(), (
        "stale: run python kernels/inventory.py --write"
    )


def test_inventory_lists_every_family():
    families = {r[0] for r in _inventory().rows()}
    assert families == {"cpu (C++)", "cutlass (CUDA)", "triton"}
