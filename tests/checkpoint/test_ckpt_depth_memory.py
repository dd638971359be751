"""The quantizer's peak memory does not grow with model depth.

RTN streams tensor by tensor (peak ~ the largest tensor and its temporaries); the calibrated
methods stream layer by layer (checkpoint/layer_loader.py: one decoder layer's fp32 weights,
the calibration hidden states, one layer's Hessians; finished layers on disk). The same
small-shaped Llama with 4 and with 20 decoder layers is quantized in a fresh subprocess each,
and its peak RSS while quantizing compared (VmHWM, reset through /proc/self/clear_refs after
the imports, whose own peak would otherwise hide the quantizer's). The scheme is mxfp4-mbs-s: memory does not depend on
the parameter search, and MBS-D's exhaustive one would make this test take minutes.

Bound: the 16 extra layers hold EXTRA_BF16 bytes in bf16 (the source dtype, the cheapest
form a quantizer could keep them in; fp32 copies are twice that). Peak RSS may grow by at
most a quarter of that: a quantizer that held even 4 of the 16 extra layers, or their fp32
copies for 2, fails, while the run-to-run noise of the peak (allocator, imports: a few MiB
on this machine) stays well below it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_helpers import make_llama

HIDDEN, INTER = 512, 1536
PER_LAYER = 3 * HIDDEN * HIDDEN + 3 * HIDDEN * INTER  # q, o, k + v (half width); MLP
DEEP = 20
EXTRA_BF16 = (DEEP - 4) * PER_LAYER * 2

CHILD = """
import json, sys, torch
import transformers.models.llama.modeling_llama  # imported before the measurement starts
import vllm_mxplus.checkpoint.quantizer as qm

def tokens(src, calib=None, nsamples=32, seqlen=512):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 96, (nsamples, seqlen), generator=g)

def status(key):  # bytes
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

def hwm():  # peak RSS since the last reset
    return status("VmHWM")

def reset():  # Linux: writing 5 to clear_refs resets the peak RSS (VmHWM) to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

qm.calibration_tokens = tokens
reset()
report = qm.quantize_checkpoint(
    sys.argv[1], sys.argv[2], "mxfp4-mbs-s", method=sys.argv[3], nsamples=4, seqlen=32,
    progress=False, device="cpu",
)
peak = hwm()
# the instrument's own check: holding int(sys.argv[4]) more bytes shows in the same measure
reset()
base = status("VmRSS")
held = torch.ones(int(sys.argv[4]), dtype=torch.uint8)
control = hwm() - base
print(json.dumps({"peak": peak, "control": control, "quantized": report.n_quantized}))
"""


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("depth")
    return {
        n: make_llama(root / f"l{n}", hidden=HIDDEN, intermediate=INTER, layers=n)
        for n in (4, DEEP)
    }


def _peak(src: Path, dst: Path, method: str) -> dict[str, int]:
    env = dict(
        os.environ,
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
        OMP_NUM_THREADS="1",  # the same thread pools (and their stacks) in both runs
        # a fixed mmap threshold: glibc's dynamic one rises to the size of each freed block
        # (up to 32 MiB), after which this model's 0.5-3 MiB tensors come from the heap and
        # its fragmentation, not what the quantizer holds, grows with the number of layers
        # (measured: rtn-aware +219 MiB from 4 to 32 layers with it, +5 MiB without). Real
        # models' tensors are above 32 MiB and always mmapped.
        MALLOC_MMAP_THRESHOLD_="131072",
    )
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(src), str(dst), method, str(EXTRA_BF16)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs"
)
@pytest.mark.slow  # quantizes checkpoints of two depths in subprocesses: ~1-2 min each
@pytest.mark.parametrize("method", ["rtn", "rtn-aware"])
def test_peak_rss_does_not_grow_with_depth(
    sources: dict[int, Path], tmp_path: Path, method: str
) -> None:
    shallow = _peak(sources[4], tmp_path / "q4", method)
    deep = _peak(sources[DEEP], tmp_path / f"q{DEEP}", method)
    assert (shallow["quantized"], deep["quantized"]) == (4 * 7, DEEP * 7)  # every linear
    # the instrument sees memory that is held: EXTRA_BF16 bytes allocated after a reset
    assert deep["control"] >= 0.9 * EXTRA_BF16, deep
    growth = deep["peak"] - shallow["peak"]
    assert growth < EXTRA_BF16 / 4, (
        f"{method}: peak RSS {shallow['peak'] / 2**20:.0f} MiB at 4 layers, "
        f"{deep['peak'] / 2**20:.0f} MiB at {DEEP} (+{growth / 2**20:.0f} MiB; the "
        f"{DEEP - 4} extra layers "
        f"are {EXTRA_BF16 / 2**20:.0f} MiB in bf16)"
    )
