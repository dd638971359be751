"""`mxplus kernels`: builds (or finds) the CPU kernels, lists the backend per scheme, self-test."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mxplus.backends.triton.launch import HAS_TRITON
from vllm_mxplus.cli import main
from vllm_mxplus.kernel_tools import aot, aot_drivers

REPO = Path(__file__).resolve().parents[2]
# every Triton kernel the launchers launch (what --aot must enumerate and compile)
LAUNCHED_KERNELS = {
    "_mx_act_quant_kernel",
    "_nvfp4_act_quant_kernel",
    "_act_fp8_chunks_kernel",
    "_decode_gemm_kernel",
    "_mx_gemm_kernel",
    "_mxplus_act_quant_kernel",
    "_nvfp4_given_act_quant_kernel",
    "_fp8_chunk_gemm_kernel",
    "_weight_fp8_words_kernel",
    "_list_rows_kernel",
}


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")
def test_kernels_check(capsys):
    assert main(["kernels", "--check"]) == 0
    out = capsys.readouterr().out
    assert "CPU kernels: " in out and "mxplus_cpu_" in out
    assert "mxfp4-mbs      -> cpu-packed" in out and "nvfp4          -> cpu-packed" in out
    assert "mxplus         -> cpu-packed" in out
    assert "self-test: bit-exact, linear within bound" in out


def test_kernels_disabled(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_MXPLUS_CPU_KERNELS", "0")
    assert main(["kernels"]) == 1
    assert "unavailable: disabled by VLLM_MXPLUS_CPU_KERNELS=0" in capsys.readouterr().out


# ----------------------------------------------------------------------------- --aot
def test_aot_enumerates_configs_from_the_launchers():
    """The configurations come from driving the launchers (not a hand list): every kernel
    they launch, every format's rule and flag, every macro block the act-quant takes."""
    from vllm_mxplus.backends.triton import act_quant as aq
    from vllm_mxplus.kernel_tools import aot

    quick, full = aot.enumerate_configs(quick=True), aot.enumerate_configs(quick=False)
    kernels = {c.kernel for cs in quick.values() for c in cs}
    assert kernels >= LAUNCHED_KERNELS
    for name in aot.DRIVERS:
        assert set(quick[name]) <= set(full[name]) and len(full[name]) > len(quick[name])
    mx = [dict(c.constexprs) for c in full["act_quant"] if c.kernel == "_mx_act_quant_kernel"]
    assert {c["MACRO"] for c in mx if c["HAS_MBS"]} == set(aq.SUPPORTED_MACRO_BLOCKS)
    assert {c["MANT_THRESHOLD"] for c in mx} == set(aq.MANTISSA_THRESHOLD.values())
    dec = [dict(c.constexprs) for c in quick["decode_gemm"]]
    assert {(d["X_MBS"], d["BS"]) for d in dec} == {(True, 16), (False, 16), (False, 32)}
    # the GPU tile choices, not the interpreter's (tests run with TRITON_INTERPRET=1)
    from vllm_mxplus.backends.triton import decode_gemm as dg

    # the 16-row tile everywhere; the batched decode's 32 / 64 rows on the x_hat path only,
    # with WIDE_NUM_STAGES stages; NVFP4 and MX+ on x_hat too
    assert {d["BLOCK_M"] for d in dec} == {dg.GPU_BLOCK_M, *dg.WIDE_BLOCK_MS}
    assert all(d["X_HAT"] for d in dec if d["BLOCK_M"] > dg.GPU_BLOCK_M)
    assert all(
        dict(c.options).get("num_stages") == (dg.WIDE_NUM_STAGES if wide_m else None)
        for c in quick["decode_gemm"]
        for wide_m in [dict(c.constexprs)["BLOCK_M"] > dg.GPU_BLOCK_M]
    )
    assert any(d["NVFP4"] and d["X_HAT"] for d in dec)
    assert all(d["X_HAT"] and d["BLOCK_M"] == dg.GPU_BLOCK_M for d in dec if d["PLUS"])
    assert any(d["PLUS"] for d in dec)
    # the wide tile where the code rows vectorize, the unaligned one elsewhere: both compiled
    wide = (dg.GPU_BLOCK_N, dg.GPU_BLOCK_K)
    assert {(d["BLOCK_N"], d["BLOCK_K"]) for d in dec} == {
        wide,
        (dg.SLIM_BLOCK_N, dg.GPU_BLOCK_K),  # the served decode's tile (`slim_tile`)
        (dg.UNALIGNED_BLOCK_N, dg.UNALIGNED_BLOCK_K),
    }
    # four warps, but two for the slim tile (and only there)
    for c in quick["decode_gemm"]:
        cx, warps = dict(c.constexprs), dict(c.options)["num_warps"]
        slim = cx["BLOCK_N"] == dg.SLIM_BLOCK_N and cx["BLOCK_K"] == dg.GPU_BLOCK_K
        assert warps == (dg.SLIM_NUM_WARPS if slim else dg.GPU_NUM_WARPS), cx
        assert not slim or (
            cx["W_A"]
            and cx["X_HAT"]
            and (cx["W_FOLD"] or cx["NVFP4"] or cx["PLUS"])
            and cx["BLOCK_M"] <= 32
        )
    # --quick holds the decode shapes that once spilled: every divisibility class of the
    # full set (16-divisible strides, MBS strides that are not, nothing divisible), a bias
    # variant with MBS on both operands
    divisibility = {c.divisible for c in quick["decode_gemm"]}
    assert divisibility == {c.divisible for c in full["decode_gemm"]}
    assert any(d["HAS_BIAS"] and d["X_MBS"] and d["W_MBS"] for d in dec)


def test_aot_kernel_filter(capsys):
    """`--kernel decode_gemm` compiles one launcher's configurations; a wrong name is a
    usage error naming the choices."""
    from vllm_mxplus.kernel_tools import aot

    assert aot.parse_kernels(None) is None and aot.parse_kernels("") is None
    assert aot.parse_kernels("decode_gemm, act_quant") == ["decode_gemm", "act_quant"]
    only = aot.enumerate_configs(quick=True, launchers=["decode_gemm"])
    # the launcher's own kernel, which sums its split K itself
    assert list(only) == ["decode_gemm"]
    assert {c.kernel for c in only["decode_gemm"]} == {"_decode_gemm_kernel"}
    # mx_gemm's split-K sum is a second launch (own key)
    gemm = aot.enumerate_configs(quick=True, launchers=["mx_gemm"])
    assert list(gemm) == ["mx_gemm", aot.SPLIT_K_SUM_KEY]
    assert {c.kernel for c in gemm[aot.SPLIT_K_SUM_KEY]} == {"_finish_kernel"}
    with pytest.raises(ValueError, match="decode_gemm"):
        aot.parse_kernels("decode")
    assert main(["kernels", "--aot", "--kernel", "nope"]) == 2
    assert "--kernel: unknown ['nope']" in capsys.readouterr().out


def test_aot_small_macro_blocks_in_quick_and_filter(capsys):
    """--quick compiles macro block 32 (the decode GEMM's operand rows per macro block in its
    128-element K step, the act-quant's 16 macro blocks per 512-column tile) and the full set
    every Triton macro block; `--macro-block` keeps those MBS configurations only."""
    from vllm_mxplus.backends.triton import act_quant as aq
    from vllm_mxplus.backends.triton import decode_gemm as dg
    from vllm_mxplus.kernel_tools import aot

    quick, full = aot.enumerate_configs(quick=True), aot.enumerate_configs(quick=False)
    dec_full = [dict(c.constexprs) for c in full["decode_gemm"]]
    assert {d["MACRO"] for d in dec_full if d["X_MBS"]} == {16, 32, 64, 128, 256, 2048}
    # macro blocks narrower than the wide K step: an operand row per macro block of the step
    # on the word path (`sub_blocks`), one dot per macro block on the byte path
    assert {d["BLOCK_K"] for d in dec_full} == {dg.GPU_BLOCK_K, dg.UNALIGNED_BLOCK_K}
    for d in dec_full:
        narrow = d["X_MBS"] and d["MACRO"] < d["BLOCK_K"]
        assert d["SUB"] == (d["BLOCK_K"] // d["MACRO"] if narrow and d["WORDS"] else 1), d
    assert {d["SUB"] for d in dec_full} == {1, 2, 4, 8}
    assert any(d["SUB"] > 1 and d["X_HAT"] for d in dec_full)
    assert any(d["SUB"] > 1 and not d["X_HAT"] for d in dec_full)
    assert any(d["X_MBS"] and d["MACRO"] < d["BLOCK_K"] and not d["WORDS"] for d in dec_full)
    assert aot.parse_macro_blocks("16, 32") == [16, 32] and aot.parse_macro_blocks("") is None
    with pytest.raises(ValueError, match="--macro-block"):
        aot.parse_macro_blocks("32x")
    only = aot.select_macro_blocks(quick, [32])
    # the fp8 encoder and the MX+ / NVFP4 quantizers have no macro block
    assert set(only) == {"act_quant", "decode_gemm", "mx_gemm", "moe_gemm"}
    consts = [dict(c.constexprs) for cs in only.values() for c in cs]
    assert consts and all(d["MACRO"] == 32 for d in consts)
    assert {c.kernel for cs in only.values() for c in cs} == {
        "_mx_act_quant_kernel",
        "_decode_gemm_kernel",
        "_mx_gemm_kernel",
    }
    small = aot.select_macro_blocks(full, [16, 32, 64])
    mx = [dict(c.constexprs) for c in small["act_quant"]]
    assert {d["MACRO"] for d in mx} == {16, 32, 64} and all(d["HAS_MBS"] for d in mx)
    assert set(aq.SUPPORTED_MACRO_BLOCKS) >= {16, 32, 64}
    assert main(["kernels", "--aot", "--macro-block", "32x"]) == 2
    assert "--macro-block" in capsys.readouterr().out


def test_aot_mx_gemm_and_experts_configs():
    """The FP4 GEMM of every format and the grouped experts: --quick holds every operand
    kind (E8M0 with and without MBS, NVFP4, MX+), linear and MoE launches, the decode and
    prefill tiles (GPU tile choices, not the interpreter's)."""
    from vllm_mxplus.backends.triton import moe_gemm as mo
    from vllm_mxplus.backends.triton import mx_gemm as mg
    from vllm_mxplus.kernel_tools import aot

    quick = aot.enumerate_configs(quick=True, launchers=["mx_gemm", "moe_gemm"])
    lin = [dict(c.constexprs) for c in quick["mx_gemm"]]
    moe = [dict(c.constexprs) for c in quick["moe_gemm"]]
    for cs in (lin, moe):
        assert {d["FMT"] for d in cs} == {mg.FMT_E8M0, mg.FMT_NVFP4, mg.FMT_MXPLUS}
        assert {d["X_MBS"] for d in cs} == {True, False}
    assert not any(d["MOE"] for d in lin) and all(d["MOE"] for d in moe)
    tiles = {(d["BLOCK_M"], d["BLOCK_N"], d["BLOCK_K"]) for d in lin}
    assert tiles == {
        # rows that do not vectorize, or a macro block of 16 under the wide K step
        (mg.DECODE_BLOCK_M, mg.DECODE_BLOCK_N, mg.GPU_BLOCK_K),
        (mg.DECODE_BLOCK_M, mg.WIDE_DECODE_BLOCK_N, mg.WIDE_DECODE_BLOCK_K),
        (mg.PREFILL_BLOCK_M, mg.PREFILL_BLOCK_N, mg.GPU_BLOCK_K),
        (mg.PREFILL_MBS_BLOCK_M, mg.PREFILL_MBS_BLOCK_N, mg.GPU_BLOCK_K),
        # MBS on rows that do not vectorize; a macro block under the K step
        (mg.GATHER_BLOCK_M, mg.GATHER_BLOCK_N, mg.GPU_BLOCK_K),
        (mg.GATHER_BLOCK_M, mg.GATHER_BLOCK_N, mg.PREFILL_MBS_BLOCK_K),
    }
    assert {d["BLOCK_M"] for d in moe} == {
        mg.DECODE_BLOCK_M,
        mg.GATHER_BLOCK_M,
        mo.MOE_WIDE_BLOCK_M,
    }
    assert {(d["BLOCK_M"] == mo.MOE_WIDE_BLOCK_M, d["BLOCK_N"]) for d in moe} == {
        (False, mg.GATHER_BLOCK_N),  # 64 pairs: the gathered tile's columns
        (True, mo.MOE_WIDE_BLOCK_N),
    }
    narrow = [d for d in lin if d["X_MBS"] and d["MACRO"] < mg.GPU_BLOCK_K]
    assert narrow and all(
        d["BLOCK_K"] == mg.PREFILL_MBS_BLOCK_K
        if d["BLOCK_M"] == mg.GATHER_BLOCK_M
        else d["BLOCK_N"] == mg.DECODE_BLOCK_N
        for d in narrow
    )
    # the prefill tile by operand kind: without MBS the plain tile, MBS on its own or gathered
    for d in lin:
        if d["BLOCK_M"] > mg.DECODE_BLOCK_M:
            mbs = d["X_MBS"] or d["W_MBS"]
            want = {mg.PREFILL_MBS_BLOCK_M, mg.GATHER_BLOCK_M} if mbs else {mg.PREFILL_BLOCK_M}
            assert d["BLOCK_M"] in want


def test_aot_failure_rules():
    from vllm_mxplus.kernel_tools import aot

    cfg = aot.enumerate_configs(quick=True)["decode_gemm"][0]
    ok = aot.CompileResult(cfg, 90, regs=128)
    spill = aot.CompileResult(cfg, 100, regs=255, spill_bytes=84)
    smem = aot.CompileResult(cfg, 80, regs=64, smem=aot.SMEM_LIMIT[80] + 1)
    err = aot.CompileResult(cfg, 90, error="CompilationError: boom")
    assert not ok.failed and spill.failed and smem.failed and err.failed
    lines = aot.failures([ok, spill, smem, err])
    assert len(lines) == 3 and "84 bytes spilled" in lines[0] and "shared memory" in lines[1]
    table = aot.summarize([ok, spill, smem, err])
    assert any(
        line.split()[:2] == ["_decode_gemm_kernel", "100"] and line.split()[-1] == "1"
        for line in table
    )
    with pytest.raises(ValueError, match="--targets"):
        aot.parse_targets("90,75")


SPILLER = """
import triton
import triton.language as tl


@triton.jit
def spiller(x_ptr, out_ptr, BLOCK: tl.constexpr):
    # a [BLOCK, BLOCK] fp32 tile kept live across a reduction: far more than 255 registers
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs[:, None] * BLOCK + offs[None, :])
    s = tl.sum(x, axis=0)
    tl.store(out_ptr + offs[:, None] * BLOCK + offs[None, :], x / s[None, :] + tl.exp(x))
"""


def _aot_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(REPO), env.get("PYTHONPATH", "")])
    env["TMPDIR"] = str(tmp_path)
    return env


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_aot_reports_a_real_spill(tmp_path):
    """ptxas -v parsing end to end: a kernel that must spill is reported as failed."""
    (tmp_path / "spill_kernel.py").write_text(SPILLER)
    code = (
        "import os, tempfile\n"
        "os.environ['TRITON_CACHE_DIR'] = tempfile.mkdtemp()\n"
        "from vllm_mxplus.kernel_tools import aot\n"
        "cfg = aot.KernelConfig('spill_kernel', 'spiller', (('x_ptr', '*fp32'), "
        "('out_ptr', '*fp32'), ('BLOCK', 'constexpr')), (('BLOCK', 128),), (0, 1), "
        "(('num_warps', 1),))\n"
        "r = aot.compile_config(cfg, 90)\n"
        "print('RESULT', r.regs, r.spill_bytes, r.failed, repr(r.error))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=_aot_env(tmp_path),
        timeout=300,
    )
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stdout + proc.stderr[-3000:]
    _, regs, spill, failed, error = line[0].split(maxsplit=4)
    assert error == "''" and int(spill) > 0 and failed == "True"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_aot_quick_passes_for_ampere_hopper_blackwell(tmp_path):
    """What CI runs: `mxplus kernels --aot --targets 80,90,100 --quick` compiles every kernel
    family with no spill and no shared-memory overflow (a few minutes on 2 cores), and
    leaves no private Triton cache behind."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_mxplus.cli",
            "kernels",
            "--aot",
            "--targets",
            "80,90,100",
            "--quick",
            "--jobs",
            "2",
        ],
        capture_output=True,
        text=True,
        env=_aot_env(tmp_path),
        timeout=1800,  # a shared 2-core box: 659 s at load average ~15 (kernels/README.md)
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    for kernel in sorted(LAUNCHED_KERNELS):
        rows = [ln.split() for ln in out.splitlines() if ln.startswith(kernel)]
        # the FP8-chunk kernels need FP8 E4M3 (sm_89+): sm_80 skipped, not failed
        want = [t for t in (80, 90, 100) if t >= aot_drivers.MIN_TARGET.get(kernel, 0)]
        assert sorted(int(r[1]) for r in rows) == want, out
        assert all(r[4] == "0" and r[-1] == "0" for r in rows), out  # no spill, no failure
    assert not list(tmp_path.glob("mxplus-aot-triton-*")), "private Triton cache left behind"


def test_aot_grouped_decode_configs():
    """The grouped E8M0 experts on the decode kernel: MOE launches on the x_hat word path at
    every row tile `moe_block_m` picks, folded and unfolded scales, MBS and not; no linear
    launch among them."""
    from vllm_mxplus.backends.triton import decode_gemm as dg
    from vllm_mxplus.backends.triton import moe_gemm as mo
    from vllm_mxplus.backends.triton import mx_gemm as mg
    from vllm_mxplus.kernel_tools import aot

    full = aot.enumerate_configs(quick=False, launchers=["moe_decode_gemm"])["moe_decode_gemm"]
    quick = aot.enumerate_configs(quick=True, launchers=["moe_decode_gemm"])["moe_decode_gemm"]
    for cs in (full, quick):
        ds = [dict(c.constexprs) for c in cs]
        assert {c.kernel for c in cs} == {"_decode_gemm_kernel"}
        assert all(d["MOE"] and d["X_HAT"] and d["WORDS"] for d in ds)
        assert {d["BLOCK_M"] for d in ds} == {
            mg.DECODE_BLOCK_M, mg.GATHER_BLOCK_M, mo.MOE_WIDE_BLOCK_M
        }  # fmt: skip
        assert {(d["BLOCK_N"], d["BLOCK_K"]) for d in ds} == {(dg.GPU_BLOCK_N, dg.GPU_BLOCK_K)}
        assert {d["X_MBS"] for d in ds} == {True, False}
    assert {dict(c.constexprs)["W_FOLD"] for c in full} == {True, False}
    assert {dict(c.constexprs)["MACRO"] for c in full if dict(c.constexprs)["X_MBS"]} == {128, 256}
    assert len(quick) < len(full)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_a_configuration_compiles_once_per_target_as_launched():
    """A configuration with the E2M1 conversion on (a B200 launch) is, below sm_100, the one
    without it (`aot.as_launched`), so it is compiled there once; on sm_100 both are (the
    launcher can take either); every pair kept is one the launchers make."""
    captured = aot.enumerate_captures(quick=True, launchers=["act_quant"])["act_quant"]
    configs = [c for c, got in captured.items() if got & {90, 100}]  # sm_90's and sm_100's
    hw = [c for c in configs if dict(c.constexprs).get("HW_E2M1") == 1]
    assert hw, "no configuration with the E2M1 conversion to check"
    work = aot.distinct_work(configs, [80, 90, 100])
    per_target = {t: [c for c, tt in work if tt == t] for t in (80, 90, 100)}
    assert len(per_target[100]) == len(configs)
    for t in (80, 90):
        assert len(per_target[t]) == len(configs) - len(hw)
        launched = [aot.as_launched(c, t)[0] for c in per_target[t]]
        assert all(not cx.get("HW_E2M1") for cx in launched)


def test_capture_for_maps_each_target_to_its_generation():
    """sm_80 (and sm_86 / sm_89) compile sm_80's tile choices, sm_90 its own, sm_100 and
    later sm_100's."""
    assert [aot.capture_for(t) for t in (80, 86, 89, 90, 100, 103)] == [80, 80, 80, 90, 100, 100]


def _as_compiled(c, t) -> tuple:
    """What `aot.distinct_work` compiles once: the configuration as launched on sm_<t>."""
    return t, c.kernel, c.signature, c.divisible, repr(sorted(aot.as_launched(c, t)[0].items()))


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_each_target_compiles_the_tiles_its_generation_launches():
    """With the captures (`aot.enumerate_captures`) a configuration is compiled only for the
    targets whose generation launched it: the FP8-chunk GEMM's sm_90 tile (two programs per
    SM) for sm_90 only, the decode GEMM's tiles only sm_80 launches (the union of sm_90's
    and sm_100's choices missed them) for sm_80; fewer compiles than the union; and no
    (configuration, target) pair of a generation's launches left out."""
    from vllm_mxplus.backends.triton.fp8_chunk_gemm import GPU_TILES

    for name in ("fp8_chunk_gemm", "decode_gemm"):
        captured = aot.enumerate_captures(quick=True, launchers=[name])[name]
        work = aot.distinct_work(list(captured), [80, 90, 100], captured)
        assert all(aot.capture_for(t) in captured[c] for c, t in work)
        compiled = {_as_compiled(c, t) for c, t in work}
        for c, got in captured.items():
            for t in (80, 90, 100):
                if aot.capture_for(t) in got and t >= aot_drivers.min_target(c):
                    assert _as_compiled(c, t) in compiled, (c.label(), t)
        assert len(work) < len(aot.distinct_work(list(captured), [80, 90, 100]))
        if name == "decode_gemm":  # sm_80's own: the 32-row tile of macro block 32 (SUB 4)
            sm80 = [c for c, got in captured.items() if got == {80}]
            assert any(dict(c.constexprs)["SUB"] == 4 for c in sm80)
            assert {t for c, t in work if c in sm80} == {80}
        if name == "fp8_chunk_gemm":
            sm90 = [c for c in captured if (dict(c.constexprs)["BLOCK_M"],
                                            dict(c.constexprs)["BLOCK_N"]) == GPU_TILES[9][:2]]  # fmt: skip
            assert sm90 and all(captured[c] == {90} for c in sm90)
            assert {t for c, t in work if c in sm90} == {90}
