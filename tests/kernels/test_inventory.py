"""kernels/INVENTORY.md is the inventory the sources give today (python kernels/inventory.py)."""

from __future__ import annotations

from repo_scripts import REPO, load_repo_script


def _inventory():
    return load_repo_script("kernels/inventory.py", "kernel_inventory")


def test_inventory_is_current():
    inv = _inventory()
    assert (REPO / "kernels" / "INVENTORY.md").read_text() == inv.render(), (
        "stale: run python kernels/inventory.py --write"
    )


def test_inventory_lists_every_family():
    families = {r[0] for r in _inventory().rows()}
    assert families == {"cpu (C++)", "cutlass (CUDA)", "triton"}
