"""The AMX path's own tests on emulated tiles, on hosts without AMX.

The AMX kernels (csrc/mx_amx_cpu.cpp: AMX-BF16; csrc/mx_amx_int8_cpu.cpp: AMX-INT8) and the
backend's dispatch to them are tested by test_cpu_amx_tiles.py, test_cpu_amx_int8.py and
test_cpu_exact_bf16.py, whose kernel tests skip where the CPU has no AMX: on most CI hosts.
Here those files run in a subprocess with VLLM_MXPLUS_CPU_AMX_EMULATE=1, a build of the same
sources whose six tile instructions are C++ functions that follow the Intel SDM's pseudo-code
(csrc/mx_amx_emulate.h) and whose other code (AVX-512: the decoders, quantizer, folds,
epilogues, refusals) is the AMX build's. Every test of the three files must run and pass: a
skip there would hide a kernel test. What only an AMX host confirms is the silicon itself
(the instructions' results and speed); those files run natively there as well.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vllm_mxplus import settings
from vllm_mxplus.backends.cpu.exact_bf16 import EMULATE_NEEDS
from vllm_mxplus.platform_amx import cpu_flags, read_cpuinfo

HERE = Path(__file__).resolve().parent
FILES = ("test_cpu_amx_int8.py", "test_cpu_amx_tiles.py", "test_cpu_exact_bf16.py")


@pytest.mark.slow  # one kernel build (~60 s on 2 cores) and ~30 s of tests
def test_amx_tests_pass_on_emulated_tiles(tmp_path):
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler (c++)")
    missing = sorted(EMULATE_NEEDS - (cpu_flags(read_cpuinfo()) or set()))
    if missing:
        pytest.skip(f"the AMX code's AVX-512 cannot run on this CPU: no {', '.join(missing)}")
    report = tmp_path / "report.xml"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env[settings.CPU_AMX_EMULATE.name] = "1"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-rs",
            f"--junitxml={report}",
            *(str(HERE / f) for f in FILES),
        ],
        env=env,
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    tests, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    assert failed == 0, r.stdout[-6000:]
    # The int8 file alone has ~400 cases; none may skip (a skip is an untested kernel path).
    assert tests > 500 and skipped == 0, (tests, skipped, r.stdout[-6000:])
