"""scripts/cpu_batch_invariance.py serves the rows it compares in the batches it says: every
row once, in order, in batches of M (the first one `start` rows when shifted), so a count of
differing outputs compares each row with itself under another batching, never two rows."""

from __future__ import annotations

import torch
from repo_scripts import load_repo_script


class _Recorder:
    """A backend whose output row is its input row, recording each call's batch size."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def apply(self, layer, x: torch.Tensor, bias) -> torch.Tensor:
        self.sizes.append(x.shape[0])
        return x.clone()


def test_batches_cover_every_row_once_in_order():
    script = load_repo_script("scripts/cpu_batch_invariance.py")
    x = torch.arange(50.0).unsqueeze(1)
    for m, start, want in [
        (1, 0, [1] * 50),
        (16, 0, [16, 16, 16, 2]),
        (16, script.SHIFT, [8, 16, 16, 10]),
        (64, 0, [50]),
        (64, script.SHIFT, [8, 42]),
    ]:
        rec = _Recorder()
        y = script._batches(rec, None, x, m, start=start)
        assert torch.equal(y, x), (m, start)
        assert rec.sizes == want, (m, start, rec.sizes)
