"""The CPU C++ kernels (`csrc/*.cpp`): built at first use, cached, loaded once.

    from vllm_mxplus.backends.cpu import kernels as cpu_kernels
    ok, why = cpu_kernels.load()          # builds on first call (~20 s), then cached
    # scheme: the layer's Scheme (weight / activation FormatSpec and macro block)
    mb = scheme.macro_block
    packed = cpu_kernels.pack_weight(codes, scales, mbs, k, scheme.weight, mb)  # once, at load
    args = cpu_kernels.linear_args(scheme.weight, scheme.activation, n, k, mb)
    y = cpu_kernels.linear_packed(x, args, *packed, bias, torch.bfloat16)

The library is compiled with the host C++ compiler for this CPU (-march=native: AVX-512 with
VNNI / VBMI where the CPU has them, else AVX2 (with AVX-VNNI where present), else portable
C++) through torch.utils.cpp_extension, into ~/.cache/vllm-mxplus/cpu_kernels/<hash> (override with
VLLM_MXPLUS_CPU_BUILD_DIR). The hash covers the sources, the flags, torch's version and this
CPU's feature flags, so a cache shared between different machines never runs code built for
another CPU. VLLM_MXPLUS_CPU_MARCH=x86-64-v3 (say) builds for another target instead of
`native` (the tests use it to run the portable path). VLLM_MXPLUS_CPU_KERNELS=0 disables the
kernels (the dispatch then uses the pure torch reference backend and logs why).

Ops (namespace `vllm_mxplus`, each with a fake implementation for torch.compile):
  cpu_act_quant(x, block, rule, mbs, macro)    -> (2*value int8, E8M0, MBS bytes), = formats
  cpu_act_fake_quant(x, block, rule, mbs, macro)        -> fp32, = formats.fake_quantize
  cpu_dequant_weight(codes, scales, mbs, k, block, macro) -> fp32 [N, K], = dequantize()
  cpu_pack_weight(codes, scales, mbs, k, block, macro)  -> the GEMM's 16-row tile layout
  cpu_mx_linear(x, ..., packed weight, n, k, ...)        -> integer-dot-product W4A4 linear
  cpu_nvfp4_act_quant / cpu_nvfp4_linear                 -> NVFP4 (csrc/mx_nvfp4_cpu.cpp)
  cpu_mxplus_pack_weight / cpu_mxplus_linear             -> MX+ (csrc/mx_mxplus_cpu.cpp); its
      activations are cpu_act_quant / cpu_act_fake_quant with rule MXPLUS_RULE
  cpu_amx_gemm / cpu_amx_packed_gemm / cpu_amx_act_quant / cpu_amx_act_operand /
  cpu_amx_available -> the exact-bf16 path's GEMM on AMX-BF16 tiles (csrc/mx_amx_cpu.cpp;
      exact_bf16.py calls it on AMX hosts; the packed form decodes E8M0 weights from
      cpu_pack_weight's tiles per call; cpu_amx_unpack shows its decoder's tiles, for tests)
  cpu_amx_int8_linear / cpu_amx_int8_available -> the E8M0 linear on AMX-INT8 tiles
      (csrc/mx_amx_int8_cpu.cpp; exact_bf16.py calls it on AMX hosts)
The numerics and the error bounds: csrc/mx_gemm_cpu.cpp, mx_nvfp4_cpu.cpp, mx_mxplus_cpu.cpp
(docs/numerics.md, "Kernel numerics and error bounds").
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from pathlib import Path

import torch

from vllm_mxplus import settings
from vllm_mxplus.backends.cpu.fakes import register_fakes
from vllm_mxplus.formats import MACRO_BLOCK, FormatSpec, QuantizedTensor, get_format
from vllm_mxplus.formats.constants import ceil_div
from vllm_mxplus.formats.nvfp4 import NVFP4_BLOCK
from vllm_mxplus.platform_amx import cpu_flags, read_cpuinfo

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(
    CSRC / f
    for f in (
        "mx_quant_cpu.cpp",
        "mx_gemm_cpu.cpp",
        "mx_nvfp4_cpu.cpp",
        "mx_mxplus_cpu.cpp",
        "mx_amx_cpu.cpp",
        "mx_amx_int8_cpu.cpp",
    )
)
HEADERS = tuple(
    CSRC / h
    for h in (
        "mx_cpu_common.h",
        "mx_amx_decode.h",
        "mx_amx_emulate.h",
        "mx_amx_int8_decode.h",
        "mx_amx_int8_rows.h",
        "mx_tiles.h",
        "mx_tile_avx512.h",
        "mx_tile_avx512_panel.h",
        "mx_tile_avx2.h",
        "mx_tile_scalar.h",
    )
)
_BASE_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp", "-DNDEBUG"]
LDFLAGS = ["-fopenmp"]
ENV_DISABLE = settings.CPU_KERNELS.name
RULE_IDS = {"ocp": 0, "floor": 1, "oas": 2}
MXPLUS_RULE = 3  # `ocp` block 32 with the MX+ block max (csrc/mx_quant_cpu.cpp)
TILE_N = 16  # weight rows per tile of cpu_pack_weight (one 32-bit lane each)

_lock = threading.Lock()
_state: dict[str, str | None] = {"error": None, "loaded": None}


def cflags() -> list[str]:
    emulate = ["-DMXPLUS_AMX_EMULATE"] if settings.cpu_amx_emulate() else []
    return [f"-march={settings.cpu_march()}"] + _BASE_CFLAGS + emulate


def _cpu_signature() -> str:
    """This CPU's feature flags (platform_amx.cpu_flags of /proc/cpuinfo, sorted), else the
    platform string."""
    flags = cpu_flags(read_cpuinfo())
    if flags:
        return " ".join(sorted(flags))
    return platform.processor() or platform.machine()


def build_name() -> str:
    h = hashlib.sha256()
    for part in (
        *(p.read_bytes() for p in SOURCES + HEADERS),
        " ".join(cflags() + LDFLAGS).encode(),
        torch.__version__.encode(),
        _cpu_signature().encode(),
    ):
        h.update(part)
    return f"mxplus_cpu_{h.hexdigest()[:16]}"


def build_dir() -> Path:
    base = settings.cpu_build_dir() or Path.home() / ".cache" / "vllm-mxplus" / "cpu_kernels"
    return base / build_name()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++"))


def load() -> tuple[bool, str]:
    """Build (first time) and load the kernels: (True, "") or (False, why not)."""
    if not settings.cpu_kernels_enabled():
        return False, f"disabled by {ENV_DISABLE}=0"
    if _state["loaded"]:
        return True, ""
    with _lock:
        if _state["loaded"]:
            return True, ""
        if _state["error"]:
            return False, _state["error"]
        try:
            _build_and_load()
        except Exception as e:  # noqa: BLE001 - any failure means: use the reference path
            msg = str(e).strip().splitlines()
            logger.warning(
                "mxplus: the CPU kernels could not be built; the reference backend "
                "serves instead. Build output:\n%s",
                "\n".join(msg[-40:]),
            )
            error = (
                f"building the CPU kernels failed ({type(e).__name__}: "
                f"{msg[-1] if msg else ''}); set {ENV_DISABLE}=0 to skip them"
            )
            _state["error"] = error
            return False, error
        _state["loaded"] = build_name()
        return True, ""


STALE_LOCK_S = 30 * 60  # a build takes ~20 s idle, minutes on a loaded box; never half an hour


def _clear_stale_lock(out: Path) -> None:
    """torch's build lock (`out/lock`, a file with no owner recorded) left by a build that was
    killed makes every later build wait on it forever. One older than STALE_LOCK_S is from a
    dead build: remove it, saying so."""
    lock = out / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning(
            "mxplus: removing the stale CPU-kernel build lock %s (%.0f min old: a build that "
            "was killed left it behind)",
            lock,
            age / 60,
        )
        lock.unlink(missing_ok=True)


def _build_and_load() -> None:
    for src in SOURCES + HEADERS:
        if not src.exists():
            raise FileNotFoundError(f"{src} is missing from the installation")
    if _compiler() is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    from torch.utils.cpp_extension import load as cpp_load

    name = build_name()
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    lib = out / f"{name}.so"
    _clear_stale_lock(out)
    fresh = not lib.exists()
    if fresh:
        logger.info("mxplus: building the CPU kernels into %s (once per machine, ~20 s)", out)
    t0 = time.time()
    cpp_load(
        name=name,
        sources=[str(p) for p in SOURCES],
        extra_cflags=cflags(),
        extra_ldflags=list(LDFLAGS),  # load() appends to the list it is given
        build_directory=str(out),
        is_python_module=False,
        verbose=False,
    )
    if fresh:
        logger.info("mxplus: CPU kernels built in %.1f s", time.time() - t0)
    register_fakes(TILE_N)


def _require() -> None:
    ok, why = load()
    if not ok:
        raise RuntimeError(f"mxplus CPU kernels unavailable: {why}")


Format = str | FormatSpec  # a FormatSpec, or a format name (looked up, never compared)


def _spec(fmt: Format) -> FormatSpec:
    return fmt if isinstance(fmt, FormatSpec) else get_format(fmt)


def _act_args(fmt: Format) -> tuple[int, int, bool]:
    spec = _spec(fmt)
    if spec.block_max_mantissa:
        return spec.block_size, MXPLUS_RULE, False
    if spec.scale_rule not in RULE_IDS or spec.mbs == "dynamic":
        raise ValueError(f"the CPU kernels do not quantize activations as {spec.name!r}")
    return spec.block_size, RULE_IDS[spec.scale_rule], spec.mbs == "static"


def _weight_block(fmt: Format) -> int:
    spec = _spec(fmt)
    if spec.scale_rule not in RULE_IDS or spec.block_max_mantissa:
        raise ValueError(f"the CPU kernels do not read weights stored as {spec.name!r}")
    return spec.block_size


def empty_mbs(device: torch.device | str = "cpu") -> torch.Tensor:
    """The `mbs` argument for formats without MBS bytes."""
    return torch.empty((0, 0), dtype=torch.uint8, device=device)


def act_quant(
    x: torch.Tensor, fmt: Format, macro_block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integer GEMM's activation operand for rows x [..., K]: (2 * E2M1 value as int8
    [M, K], E8M0 codes [M, ceil(K/block)], MBS-S bytes [M, ceil(K/macro)] or [M, 0]),
    bit-exact with formats.quantize(x, fmt)."""
    _require()
    block, rule, mbs = _act_args(fmt)
    return torch.ops.vllm_mxplus.cpu_act_quant(x, block, rule, mbs, macro_block)


def amx_act_quant(
    x: torch.Tensor, fmt: Format, macro_block: int, mp: int, kp: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact-bf16 path's activation operand for rows x [M, K] on AMX tiles, in one pass:
    (bf16 [mp, kp], the codes of `act_quant` times half their block scale, zero-padded; fp32
    [mp, chunks], fl(1/F) of the rows' MBS bytes, 1 without MBS, 0 in padding rows)."""
    _require()
    block, rule, mbs = _act_args(fmt)
    return torch.ops.vllm_mxplus.cpu_amx_act_quant(x, block, rule, mbs, macro_block, mp, kp, chunks)


def amx_int8_linear(
    x: torch.Tensor,
    args: tuple,
    wcodes: torch.Tensor,
    wscales: torch.Tensor,
    wmbs: torch.Tensor,
    rw: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    held: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`cpu_amx_int8_linear`: `linear_packed`'s linear on AMX-INT8 tiles (AMX hosts; rw the
    reciprocals 1/Fw [chunks, >= N rounded up to 16] with MBS on either side, else empty);
    where its scale fold cannot be exact the op runs `cpu_mx_linear`'s kernels itself."""
    a_block, a_rule, a_mbs, macro, n, k, _ = args
    weight = (wcodes, wscales, wmbs, rw, n, k)
    held_args = held if held is not None else (None, None)
    return torch.ops.vllm_mxplus.cpu_amx_int8_linear(
        x, a_block, a_rule, a_mbs, macro, *weight, bias, out_dtype, *held_args
    )


def amx_int8_hold(
    args: tuple, wcodes: torch.Tensor, wscales: torch.Tensor, wmbs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`cpu_amx_int8_hold`: the int8 B tiles and their fold data that `amx_int8_linear`
    decodes from the packed weight per call, decoded once (the same bytes); ~1.1 bytes per
    weight. `held` of amx_int8_linear."""
    _, _, a_mbs, macro, n, k, w_block = args
    tiles, meta = torch.ops.vllm_mxplus.cpu_amx_int8_hold(
        wcodes, wscales, wmbs, n, k, w_block, macro, a_mbs
    )
    return tiles, meta


def act_fake_quant(x: torch.Tensor, fmt: Format, macro_block: int) -> torch.Tensor:
    """formats.fake_quantize(x, fmt) in fp32 (same bits), for the E8M0 activation formats."""
    _require()
    block, rule, mbs = _act_args(fmt)
    return torch.ops.vllm_mxplus.cpu_act_fake_quant(x, block, rule, mbs, macro_block)


def dequant_weight(q: QuantizedTensor) -> torch.Tensor:
    """q.dequantize() in fp32 (same bits) for a 2-D E8M0-family weight, by the C++ decoder."""
    _require()
    block = _weight_block(q.spec)
    mbs = empty_mbs(q.codes.device) if q.mbs is None else q.mbs
    return torch.ops.vllm_mxplus.cpu_dequant_weight(
        q.codes, q.scales, mbs, q.shape[-1], block, q.macro_block
    )


def pack_weight(
    codes: torch.Tensor,
    scales: torch.Tensor,
    mbs: torch.Tensor | None,
    k: int,
    fmt: Format,
    macro_block: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A checkpoint-layout weight (codes [N, ceil(K/2)], E8M0 scales, MBS bytes or None) in
    the GEMM's 16-row tile layout: the same bytes re-ordered (N padded to a multiple of 16)."""
    _require()
    mbs_t = empty_mbs(codes.device) if mbs is None else mbs
    return torch.ops.vllm_mxplus.cpu_pack_weight(
        codes, scales, mbs_t, k, _weight_block(fmt), macro_block
    )


def linear_args(
    weight_format: Format, activation_format: Format, n: int, k: int, macro_block: int
) -> tuple:
    """The constant arguments of `cpu_mx_linear` for one layer (see `linear_packed`)."""
    a_block, a_rule, a_mbs = _act_args(activation_format)
    w_block = _weight_block(weight_format)
    if w_block != a_block:
        raise ValueError(
            f"weights {_spec(weight_format).name} (block {w_block}) and activations "
            f"{_spec(activation_format).name} (block {a_block}) need the same block size"
        )
    return a_block, a_rule, a_mbs, macro_block, n, k, w_block


def linear_packed(
    x: torch.Tensor,
    args: tuple,
    wcodes: torch.Tensor,
    wscales: torch.Tensor,
    wmbs: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`cpu_mx_linear` with a layer's `linear_args` and `pack_weight` tensors (kernels already
    loaded). The per-call path of the backends: quantizes x's rows once, then integer dot
    products against the packed weight, any number of rows."""
    a_block, a_rule, a_mbs, macro, n, k, w_block = args
    return torch.ops.vllm_mxplus.cpu_mx_linear(
        x, a_block, a_rule, a_mbs, macro, wcodes, wscales, wmbs, n, k, w_block, bias, out_dtype
    )


def nvfp4_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4 activation rows as the integer GEMM takes them: (2 * E2M1 value as int8 [M, K],
    E4M3 scale bytes [M, ceil(K/16)], per-row global scale fp32 [M]), bit-exact with
    formats.quantize of x in the NVFP4 format with per_row=True."""
    _require()
    return torch.ops.vllm_mxplus.cpu_nvfp4_act_quant(x)


def pack_nvfp4(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An NVFP4 weight [N, K] in the GEMM's 16-row tiles: (codes, E4M3 scale bytes, fp32 global
    scale per row [ceil(N/16) * 16]); the global scale is the tensor's (or each row's)."""
    _require()
    if not q.spec.has_global_scale or q.codes.dim() != 2:
        raise ValueError(
            f"pack_nvfp4 takes a 2-D weight with E4M3 block scales and a global scale "
            f"(NVFP4), got {q.spec.name} {tuple(q.shape)}"
        )
    n, k = q.shape
    # no MBS bytes: the macro block argument is not read (any valid value)
    codes, scales, _ = torch.ops.vllm_mxplus.cpu_pack_weight(
        q.codes, q.scales.view(torch.uint8), empty_mbs(q.codes.device), k, NVFP4_BLOCK, MACRO_BLOCK
    )
    g = torch.zeros(ceil_div(n, TILE_N) * TILE_N, dtype=torch.float32, device=q.codes.device)
    g[:n] = nvfp4_row_global_scales(q)
    return codes, scales, g


def nvfp4_row_global_scales(q: QuantizedTensor) -> torch.Tensor:
    """The fp32 global scale of each row of an NVFP4 weight [N, K], [N]: the tensor's one
    (shape []) for every row, or each row's own ([N, 1]: one per logical weight of a fused
    weight, docs/numerics.md, NVFP4)."""
    gs = q.global_scale
    if gs is None:
        raise ValueError("the nvfp4 weight has no global scale")
    n = q.shape[0]
    gs32 = gs.to(torch.float32)
    return gs32.reshape(-1).expand(n) if gs.numel() == 1 else gs32.reshape(n)


def nvfp4_linear_packed(
    x: torch.Tensor,
    n: int,
    k: int,
    wcodes: torch.Tensor,
    wscales: torch.Tensor,
    wglobal: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    act_global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """NVFP4 W4A4 on integer dot products (csrc/mx_nvfp4_cpu.cpp) with `pack_nvfp4` tensors;
    act_global_scale: per-row global scales [..., 1] to use instead of x's own rows'."""
    return torch.ops.vllm_mxplus.cpu_nvfp4_linear(
        x, wcodes, wscales, wglobal, n, k, act_global_scale, bias, out_dtype
    )


def pack_mxplus(q: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An MX+ weight [N, K] in the GEMM's 16-row tiles: (codes with each block max as code 0,
    E8M0 scales, block maxima: index and 2 * value per row and block), csrc/mx_mxplus_cpu.cpp."""
    _require()
    if not q.spec.block_max_mantissa or q.codes.dim() != 2:
        raise ValueError(
            f"pack_mxplus takes a 2-D weight with MX+ block maxima, got {q.spec.name} "
            f"{tuple(q.shape)}"
        )
    return torch.ops.vllm_mxplus.cpu_mxplus_pack_weight(
        q.codes, q.scales, q._field("block_max_index"), q.shape[-1]
    )


def mxplus_linear_packed(
    x: torch.Tensor,
    n: int,
    k: int,
    wcodes: torch.Tensor,
    wscales: torch.Tensor,
    wbm: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """MX+ W4A4 on integer dot products with `pack_mxplus` tensors: x's rows quantized to MX+
    once (codes bit-exact with formats), block maxima as exact extra terms of the int32 sums."""
    return torch.ops.vllm_mxplus.cpu_mxplus_linear(x, wcodes, wscales, wbm, n, k, bias, out_dtype)


def mx_linear(
    x: torch.Tensor,
    weight_format: Format,
    activation_format: Format,
    codes: torch.Tensor,
    scales: torch.Tensor,
    mbs: torch.Tensor | None,
    k: int,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    macro_block: int,
) -> torch.Tensor:
    """fake_quantize(x, activation_format) @ W_hat^T + bias for a checkpoint-layout weight
    (packs it on every call: for tests and one-off use; layers pack once at load)."""
    _require()
    packed = pack_weight(codes, scales, mbs, k, weight_format, macro_block)
    args = linear_args(weight_format, activation_format, codes.shape[0], k, macro_block)
    return linear_packed(x, args, *packed, bias, out_dtype)
