"""Backend registry and selector: priority, fallback with a logged reason, pick by M."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_mxplus.backends import selection as dispatch
from vllm_mxplus.backends.base import LinearBackend, LinearSpec, set_packed_buffers
from vllm_mxplus.backends.linear_op import LinearDispatch
from vllm_mxplus.backends.reference.linear import WEIGHT_ATTR, ReferenceBackend
from vllm_mxplus.backends.selection import first_uncovered_m, register_backend, select
from vllm_mxplus.formats import quantize

SPEC = LinearSpec(scheme="mxfp4-mbs", n=32, k=256, out_dtype=torch.float32)


class _Decode(LinearBackend):
    """A fake decode kernel: sm90+ only, M <= 16, returns a marker."""

    name = "fake-decode"
    covers_all_m = False

    @classmethod
    def is_supported(cls, platform: str, capability: int | None):
        if capability is None or capability < 90:
            return False, f"needs capability >= 90, got {capability}"
        return True, ""

    @classmethod
    def supports_m(cls, m: int) -> bool:
        return m <= 16

    def process_weights_after_loading(self, layer, qweight):

        layer.decode_ready = True

    def apply(self, layer, x, bias, act_global_scale=None):

        spec = self.spec
        return torch.full((*x.shape[:-1], spec.n), 7.0)


class _NoScheme(_Decode):
    name = "fake-no-nvfp4"

    @classmethod
    def can_implement(cls, spec):
        return (spec.scheme.name != "mxfp4-mbs"), "only other schemes"


@pytest.fixture
def registry(monkeypatch):
    monkeypatch.setattr(dispatch, "_REGISTRY", {"linear": {"cuda": [], "cpu": []}, "experts": {}})
    monkeypatch.setattr(dispatch, "_LOGGED", set())
    # The selector's mechanics (priority, M ranges, the reference appended where kernels leave
    # M uncovered) on every platform; that CUDA layers never get the reference unasked is
    # tested on its own below.
    monkeypatch.setattr(dispatch, "NO_SILENT_REFERENCE", ())
    # registration may route our logs to vLLM's handler only; caplog listens on the root.
    monkeypatch.setattr(logging.getLogger("vllm_mxplus"), "propagate", True)
    return dispatch._REGISTRY["linear"]


def test_cuda_never_falls_back_to_the_reference_unasked(registry, monkeypatch):
    """A CUDA layer no kernel serves fails to load, naming the layer, why each kernel was
    rejected and the setting that allows the reference; it never runs fp32 weights quietly."""
    monkeypatch.setattr(dispatch, "NO_SILENT_REFERENCE", ("cuda",))
    monkeypatch.delenv("VLLM_MXPLUS_BACKEND", raising=False)
    register_backend("cuda", _Decode)
    with pytest.raises(dispatch.BackendUnavailable) as e:
        select(SPEC, "cuda", 90, "model.layers.0.mlp.down_proj")
    msg = str(e.value)
    assert "model.layers.0.mlp.down_proj" in msg and "no kernel backend serves M >= " in msg
    assert "VLLM_MXPLUS_BACKEND=linear:reference" in msg
    with pytest.raises(dispatch.BackendUnavailable, match="needs capability >= 90"):
        select(SPEC, "cuda", 80)


def test_cuda_reference_only_when_the_setting_names_it(registry, monkeypatch):
    monkeypatch.setattr(dispatch, "NO_SILENT_REFERENCE", ("cuda",))
    register_backend("cuda", _Decode)
    monkeypatch.setenv("VLLM_MXPLUS_BACKEND", "linear:fake-decode,linear:reference")
    assert [b.name for b in select(SPEC, "cuda", 90)] == ["fake-decode", "reference"]


def test_registry_imports_only_the_platform_asked():
    """The registry names every backend without importing its family: resolving the CPU
    entries loads the C++ CPU backend module and no Triton or CUTLASS one (a fresh
    interpreter, so what other tests imported does not count)."""
    import subprocess
    import sys

    code = (
        "import sys; from vllm_mxplus.backends.selection import registered_backends, "
        "backend_names\n"
        "assert 'triton-decode' in backend_names('linear')\n"
        "assert 'cutlass_prefill' in backend_names('linear')\n"
        "[registered_backends('cpu', k) for k in ('linear', 'experts')]\n"
        "bad = [m for m in sys.modules if m.startswith(('vllm_mxplus.backends.triton', "
        "'vllm_mxplus.backends.cutlass'))]\n"
        "assert not bad, bad\n"
        "assert 'vllm_mxplus.backends.cpu.linear' in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]


def test_empty_cpu_registry_gets_reference_only(registry):
    chosen = select(SPEC, "cpu", None)
    assert [b.name for b in chosen] == ["reference"]


def test_fallback_logs_reason_once(registry, caplog):
    register_backend("cuda", _Decode)
    caplog.set_level(logging.INFO, logger="vllm_mxplus.backends.selection")
    for _ in range(3):
        chosen = select(SPEC, "cuda", 80)
    assert [b.name for b in chosen] == ["reference"]
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 1 and "falling back" in msgs[0] and "capability >= 90" in msgs[0]


def test_priority_and_pick_by_m(registry, caplog):
    register_backend("cuda", _Decode)
    register_backend("cuda", _NoScheme, priority=0)
    caplog.set_level(logging.INFO, logger="vllm_mxplus.backends.selection")
    chosen = select(SPEC, "cuda", 90)
    assert [b.name for b in chosen] == ["fake-decode", "reference"]
    assert "only other schemes" in caplog.records[0].getMessage()
    layer = torch.nn.Module()
    d = LinearDispatch(SPEC, chosen)
    d.process_weights_after_loading(layer, quantize(torch.randn(32, 256), "mxfp4-mbs-d"))
    assert layer.decode_ready
    assert isinstance(d.pick(1), _Decode) and isinstance(d.pick(16), _Decode)
    assert isinstance(d.pick(17), ReferenceBackend)
    assert (d.apply(layer, torch.randn(4, 256), None) == 7.0).all()
    ref = d.apply(layer, torch.randn(100, 256), None)
    assert ref.shape == (100, 32) and not (ref == 7.0).all()


class _AllM(_Decode):
    """A backend that serves every M: nothing after it is kept (no reference fp32 copy)."""

    name = "fake-all-m"
    covers_all_m = True

    @classmethod
    def supports_m(cls, m: int) -> bool:
        return True


def test_backend_serving_every_m_ends_the_list(registry):
    register_backend("cuda", _Decode)
    register_backend("cuda", _AllM)
    register_backend("cuda", _NoScheme)
    chosen = select(SPEC, "cuda", 90)
    assert [b.name for b in chosen] == ["fake-decode", "fake-all-m"]
    layer = torch.nn.Module()
    LinearDispatch(SPEC, chosen).process_weights_after_loading(
        layer, quantize(torch.randn(32, 256), "mxfp4-mbs-d")
    )
    assert not hasattr(layer, "mxplus_weight_fp32")  # the reference never prepared weights


# ----------------------------------------------------------------- memory: M ranges

PACKED_BPW = 0.5 + 1 / 16 + 1 / 128  # codes + E8M0 scales + MBS bytes per weight
FP32_BPW = 4.0  # the reference backend's dequantized copy


class _Packed(LinearBackend):
    """Keeps its own copy of the packed weight (as a backend with its own layout does)."""

    name = "packed"

    @classmethod
    def is_supported(cls, platform: str, capability: int | None):
        return True, ""

    def process_weights_after_loading(self, layer, qweight):

        set_packed_buffers(
            layer,
            tuple(f"{self.name}_{a}" for a in ("codes", "scales", "mbs")),
            (qweight.codes.clone(), qweight.scales.clone(), qweight.mbs.clone()),
        )

    def apply(self, layer, x, bias, act_global_scale=None):

        spec = self.spec
        return torch.zeros((*x.shape[:-1], spec.n))


def _packed(name: str, lo: int, hi: int | None) -> type[LinearBackend]:
    return type(name, (_Packed,), {"name": name, "min_m": lo, "max_m": hi})


class _LegacyDecode(_Packed):
    """Declares no range, only `covers_all_m = False` and a `supports_m`: range unknown."""

    name = "legacy-decode"
    covers_all_m = False

    @classmethod
    def supports_m(cls, m: int) -> bool:
        return m <= 16


DEC, PRE = _packed("decode", 1, 16), _packed("prefill", 17, None)
COMBOS = {
    "decode-only": ([DEC], ["decode", "reference"], PACKED_BPW + FP32_BPW),
    "prefill-only": ([PRE], ["prefill", "reference"], PACKED_BPW + FP32_BPW),
    "decode+prefill": ([DEC, PRE], ["decode", "prefill"], 2 * PACKED_BPW),
    "all-m": ([_packed("all", 1, None), DEC], ["all"], PACKED_BPW),
    "shadowed": ([DEC, _packed("decode8", 1, 8), PRE], ["decode", "prefill"], 2 * PACKED_BPW),
    "three-ranges": (
        [DEC, _packed("mid", 17, 64), _packed("big", 65, None)],
        ["decode", "mid", "big"],
        3 * PACKED_BPW,
    ),
    "gap-17-32": (
        [DEC, _packed("big", 33, None)],
        ["decode", "big", "reference"],
        2 * PACKED_BPW + FP32_BPW,
    ),
    "legacy+prefill": (
        [_LegacyDecode, PRE],
        ["legacy-decode", "prefill", "reference"],
        2 * PACKED_BPW + FP32_BPW,
    ),
}


@pytest.mark.parametrize("combo", list(COMBOS), ids=list(COMBOS))
def test_bytes_per_weight_by_backend_combination(registry, combo):
    backends, want_names, want_bpw = COMBOS[combo]
    for b in backends:
        register_backend("cuda", b)
    spec = LinearSpec(scheme="mxfp4-mbs", n=64, k=1024, out_dtype=torch.bfloat16)
    chosen = select(spec, "cuda", 90)
    assert [b.name for b in chosen] == want_names
    layer = torch.nn.Module()
    LinearDispatch(spec, chosen).process_weights_after_loading(
        layer, quantize(torch.randn(spec.n, spec.k), "mxfp4-mbs-d")
    )
    held = sum(t.nbytes for t in [*layer.parameters(), *layer.buffers()])
    assert held / (spec.n * spec.k) == pytest.approx(want_bpw)
    assert hasattr(layer, WEIGHT_ATTR) == ("reference" in want_names)


def test_gap_is_served_by_the_reference(registry):
    register_backend("cuda", DEC)
    register_backend("cuda", _packed("big", 33, None))
    d = LinearDispatch(SPEC, select(SPEC, "cuda", 90))
    assert [d.pick(m).name for m in (1, 16, 17, 32, 33, 4096)] == [
        "decode",
        "decode",
        "reference",
        "reference",
        "big",
        "big",
    ]


def test_selection_log_names_the_m_ranges(registry, caplog):
    register_backend("cuda", DEC)
    register_backend("cuda", _packed("big", 33, None))
    caplog.set_level(logging.INFO, logger="vllm_mxplus.backends.selection")
    select(SPEC, "cuda", 90)
    msg = caplog.records[-1].getMessage()
    assert "decode (M <= 16) > big (M >= 33) > reference (M >= 17)" in msg


@pytest.mark.parametrize(
    "ranges,lo,hi,want",
    [
        ([], 1, None, 1),
        ([(1, None)], 1, None, None),
        ([(1, 16)], 1, None, 17),
        ([(17, None)], 1, None, 1),
        ([(17, None), (1, 16)], 1, None, None),
        ([(1, 16), (33, None)], 1, None, 17),
        ([(1, 16), (10, 40), (41, None)], 1, None, None),
        ([(1, 16)], 1, 8, None),
        ([(1, 16)], 10, 20, 17),
        ([(5, 9)], 1, 4, 1),
    ],
    ids=[
        "none",
        "all",
        "decode",
        "prefill",
        "both",
        "gap",
        "overlap",
        "inside",
        "straddle",
        "below",
    ],
)
def test_first_uncovered_m(ranges, lo, hi, want):
    assert first_uncovered_m(ranges, lo, hi) == want
