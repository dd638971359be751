"""Expert backends in the one registry: priority order, rejection reasons, reference fallback,
the first-use self-test of an expert kernel (fast: no engine; the backends run under vLLM in
tests/integration/test_moe.py)."""

from __future__ import annotations

import logging

import pytest
import torch

from vllm_mxplus.backends import ExpertBackend, ExpertSpec, ReferenceExperts, selection
from vllm_mxplus.backends.cpu.experts import CpuPackedExperts
from vllm_mxplus.backends.expert_layer import EXPERT_ACTIVATIONS, SwigluOAI, expert_activation
from vllm_mxplus.backends.selftest_experts import run_expert_self_test
from vllm_mxplus.formats import SCHEMES, Scheme, get_scheme


def _spec(scheme: str | Scheme = "mxfp4-mbs", device: str = "cpu") -> ExpertSpec:
    return ExpertSpec(get_scheme(scheme), device_type=device)


class _Grouped(ExpertBackend):
    """A stand-in for a grouped GPU kernel that serves every scheme."""

    name = "grouped-test"

    @classmethod
    def is_supported(cls, platform, capability):
        return (capability or 0) >= 90, "needs sm_90"

    def process_weights_after_loading(self, layer, weights):
        raise AssertionError("not called here")

    def apply(self, layer, x, topk_weights, topk_ids, act):
        raise AssertionError("not called here")


@pytest.fixture
def registry(monkeypatch):
    saved = {k: {p: list(v) for p, v in r.items()} for k, r in selection._REGISTRY.items()}
    monkeypatch.setattr(selection, "_LOGGED", set())
    yield selection
    selection._REGISTRY.clear()
    selection._REGISTRY.update(saved)


def test_grouped_kernel_slots_in_first(registry):
    registry.register_backend("cuda", _Grouped, priority=0)
    assert registry.registered_backends("cuda", "experts")[0] is _Grouped
    assert _Grouped not in registry.registered_backends("cuda", "linear")
    got = registry.select(_spec(device="cuda"), "cuda", 90)
    assert [type(b) for b in got] == [_Grouped]


def test_unsupported_capability_takes_the_reference_only_when_asked(registry, monkeypatch):
    """No expert kernel for a CUDA layer: loading fails with the kernel's reason and the
    setting that allows the reference; with that setting the reference (sync-free routing,
    capturable: test_graph_guard_experts.py) serves."""
    registry._REGISTRY["experts"]["cuda"] = []  # only the stand-in (Triton runs interpreted here)
    registry.register_backend("cuda", _Grouped, priority=0)
    monkeypatch.delenv("VLLM_MXPLUS_BACKEND", raising=False)
    with pytest.raises(selection.BackendUnavailable) as e:
        registry.select(_spec("mxfp4-16-oas", device="cuda"), "cuda", 80)
    assert "grouped-test: needs sm_90" in str(e.value)
    assert "VLLM_MXPLUS_BACKEND=experts:reference" in str(e.value)
    monkeypatch.setenv("VLLM_MXPLUS_BACKEND", "experts:reference")
    got = registry.select(_spec("mxfp4-16-oas", device="cuda"), "cuda", 80)
    assert [type(b) for b in got] == [ReferenceExperts]


def test_a_linear_spec_is_refused_by_an_expert_backend():
    from vllm_mxplus.backends import LinearSpec

    with pytest.raises(TypeError, match="experts backend, given a linear spec"):
        ReferenceExperts(LinearSpec("nvfp4", n=8, k=16, out_dtype=torch.float32))


@pytest.mark.parametrize(
    "w,a,ok",
    [
        ("mxfp4-mbs-d", "mxfp4-mbs-s", True),
        ("nvfp4", "nvfp4", True),
        ("mxplus", "mxplus", True),
        ("nvfp4", "mxfp4-mbs-s", False),
    ],
    ids=["mbs", "nvfp4", "mxplus", "mixed"],
)
def test_cpu_packed_takes_every_scheme_and_refuses_mixed_pairs(w, a, ok):
    got, why = CpuPackedExperts.can_implement(_spec(Scheme("test", w, a, "a test pair")))
    assert got is ok
    assert ok or f"no CPU kernel for weights {w}" in why


# ------------------------------------------------------------------ the expert self-test
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_expert_self_test_passes_the_cpu_kernels_and_the_reference(scheme):
    spec = _spec(get_scheme(scheme, 64) if get_scheme(scheme).has_mbs else scheme)
    for cls in (ReferenceExperts, CpuPackedExperts):
        assert run_expert_self_test(cls, spec, torch.device("cpu")) is None, cls.name


class _OffByOne(ReferenceExperts):
    """The reference with one output element moved by 2^-12 of its value: a kernel bug as
    small as a lost bit of a scale product."""

    name = "off-by-one"

    def apply(self, layer, x, topk_weights, topk_ids, act):
        y = super().apply(layer, x, topk_weights, topk_ids, act).clone()
        y[-1, 7] += y[-1, 7].abs() * 2.0**-12 + 1e-30
        return y


class _NoMacroBlock(ReferenceExperts):
    """The reference with the activations quantized at macro block 128 whatever the scheme
    says: the forgotten-argument bug the scheme value exists to prevent."""

    name = "no-macro-block"

    def apply(self, layer, x, topk_weights, topk_ids, act):
        import dataclasses

        saved = self.spec
        self.spec = dataclasses.replace(saved, scheme=get_scheme(saved.scheme.name))
        try:
            return super().apply(layer, x, topk_weights, topk_ids, act)
        finally:
            self.spec = saved


@pytest.mark.parametrize("cls", [_OffByOne, _NoMacroBlock], ids=lambda c: c.name)
def test_expert_self_test_rejects_a_wrong_backend(cls):
    failure = run_expert_self_test(cls, _spec(get_scheme("mxfp4-mbs", 32)), torch.device("cpu"))
    assert failure is not None and "outside the bound" in failure


def test_selector_runs_the_expert_self_test_and_moves_on(registry, monkeypatch, caplog):
    class _BadKernel(_OffByOne):
        name = "bad-kernel"
        kernel = True

        @classmethod
        def is_supported(cls, platform, capability):
            return True, ""

    monkeypatch.setattr(selection.selftest, "_VERDICTS", {})
    registry.register_backend("cpu", _BadKernel, priority=0)
    with caplog.at_level(logging.INFO):
        got = registry.select(_spec(get_scheme("mxfp4-mbs", 32)), "cpu", None)
    assert [type(b) for b in got] == [CpuPackedExperts]
    assert "bad-kernel REJECTED" in caplog.text


# ------------------------------------------------- one self-test kind per expert activation
class _WrongActivation(ReferenceExperts):
    """The reference computing `WRONG` instead of the layer's activation."""

    name = "wrong-activation"
    WRONG: object = None

    def apply(self, layer, x, topk_weights, topk_ids, act):
        return super().apply(layer, x, topk_weights, topk_ids, self.WRONG)


class _SwigluOAIHalves:
    """swigluoai on gate | up read as halves instead of interleaved."""

    takes_gate_up = True

    def __call__(self, gu):
        g, u = gu.chunk(2, dim=-1)
        return SwigluOAI()(torch.stack([g, u], -1).flatten(-2))


class _SwigluOAINoPlusOne(SwigluOAI):
    def __call__(self, gu):
        g = gu[..., ::2].clamp(max=self.limit)
        u = gu[..., 1::2].clamp(min=-self.limit, max=self.limit)
        return u * (g * torch.sigmoid(g * self.alpha))


# gelu and gelu_tanh are not told apart: they differ by < 5e-4 (absolute), which moves about
# one Q(h) code in 10^4 on the self-test's data (measured: 0-2 of 14,976), so whether a
# swap shows depends on the draw; every other confusion moves most codes.
WRONG_ACTIVATIONS = [
    ("silu", expert_activation("gelu"), "gelu-for-silu"),
    ("gelu", expert_activation("silu"), "silu-for-gelu"),
    ("gelu_tanh", torch.relu, "relu-for-gelu_tanh"),
    ("swigluoai", _SwigluOAIHalves(), "halves"),
    ("swigluoai", _SwigluOAINoPlusOne(), "no-plus-one"),
    ("swigluoai", SwigluOAI(limit=float("inf")), "no-clamp"),
    ("swigluoai", SwigluOAI(alpha=1.0), "alpha-1"),
    ("swigluoai", expert_activation("silu"), "silu-for-swigluoai"),
]


@pytest.mark.parametrize("activation", EXPERT_ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_expert_self_test_kind_passes_the_reference(activation, bias):
    spec = ExpertSpec(get_scheme("mxfp4-mbs", 32), activation=activation, has_bias=bias)
    assert run_expert_self_test(ReferenceExperts, spec, torch.device("cpu")) is None


@pytest.mark.parametrize(
    "activation,wrong", [w[:2] for w in WRONG_ACTIVATIONS], ids=[w[2] for w in WRONG_ACTIVATIONS]
)
def test_expert_self_test_fails_a_wrong_activation(activation, wrong):
    cls = type("_Wrong", (_WrongActivation,), {"WRONG": staticmethod(wrong)})
    for bias in (False, True):
        spec = ExpertSpec(get_scheme("mxfp4-mbs", 32), activation=activation, has_bias=bias)
        failure = run_expert_self_test(cls, spec, torch.device("cpu"))
        assert failure is not None and "outside the bound" in failure, (bias, failure)
        assert failure.startswith(activation)


@pytest.mark.parametrize("stem", ["w13", "w2"])
def test_expert_self_test_fails_a_dropped_bias(stem):
    class _DropsBias(ReferenceExperts):
        name = f"drops-{stem}-bias"

        def apply(self, layer, x, topk_weights, topk_ids, act):
            saved = getattr(layer, f"{stem}_bias")
            setattr(layer, f"{stem}_bias", None)
            try:
                return super().apply(layer, x, topk_weights, topk_ids, act)
            finally:
                setattr(layer, f"{stem}_bias", saved)

    for activation in EXPERT_ACTIVATIONS:
        spec = ExpertSpec(get_scheme("nvfp4"), activation=activation, has_bias=True)
        failure = run_expert_self_test(_DropsBias, spec, torch.device("cpu"))
        assert failure is not None and "outside the bound" in failure, (activation, failure)


def test_expert_self_test_names_an_activation_it_cannot_test():
    spec = ExpertSpec(get_scheme("mxfp4-mbs"), activation="relu2_no_mul")
    failure = run_expert_self_test(ReferenceExperts, spec, torch.device("cpu"))
    assert failure is not None and "'relu2_no_mul'" in failure


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("activation", EXPERT_ACTIVATIONS)
def test_cuda_experts_of_every_kind_get_the_grouped_kernel(monkeypatch, activation, bias):
    """On CUDA every scheme's experts, gpt-oss's swigluoai + biases included, are served by
    triton-grouped alone (no reference, no error) with nothing set (the Triton availability
    and the GPU self-test, which need a GPU, stubbed here)."""
    from vllm_mxplus import settings
    from vllm_mxplus.backends.triton.experts import TritonExperts

    monkeypatch.delenv("VLLM_MXPLUS_BACKEND", raising=False)
    monkeypatch.setattr(settings, "selftest_enabled", lambda: False)
    monkeypatch.setattr(TritonExperts, "is_supported", classmethod(lambda c, p, cap: (True, "")))
    for name in sorted(SCHEMES):
        spec = ExpertSpec(
            get_scheme(name), device_type="cuda", activation=activation, has_bias=bias
        )
        got = selection.select(spec, "cuda", 90, "model.layers.0.mlp.experts")
        assert [type(b) for b in got] == [TritonExperts], name
