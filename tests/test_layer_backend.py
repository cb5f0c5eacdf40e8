"""Every kernel of a layer runs on the backend the layer reports (``layer.resolved_backend``): conv,
gate, chunk, recurrent and the gated RMSNorm, however the layer was built.

A recording backend of the highest priority (the torch reference behind a call log) is registered for
each test and removed afterwards, and the torch backend is swapped for a recording copy of itself, so
a kernel that resolves ``"auto"`` on its own instead of using the layer's backend shows up in the log.
"""
import dataclasses

import pytest
import torch

from gdn_layer import GatedDeltaNet, GDNState
from gdn_layer.kernels import Backend, register_backend, registry, resolve_backend

OPS = [f.name for f in dataclasses.fields(Backend)
       if f.name not in ("name", "available", "priority", "dense_as_packed", "conv_splits", "grads_into",
                         "conv_l2norm", "chunk_residuals")]
ALL_OPS = {"causal_conv1d", "gdn_gate", "gated_rms_norm", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"}


@pytest.fixture
def calls():
    """``{backend name: [op names in call order]}`` for "torch" and a higher-priority "recording"."""
    log = {"torch": [], "recording": []}
    original = resolve_backend("torch", "cpu")

    def logged(backend, op):
        fn = getattr(original, op)

        def run(*args, **kwargs):
            log[backend].append(op)
            return fn(*args, **kwargs)
        return run

    for name, priority in (("torch", original.priority), ("recording", original.priority + 100)):
        register_backend(dataclasses.replace(original, name=name, priority=priority,
                                             **{op: logged(name, op) for op in OPS}))
    try:
        yield log
    finally:
        register_backend(original)
        registry._BACKENDS.pop("recording")


def _run_every_kernel(layer: GatedDeltaNet) -> None:
    """A packed prefill (chunk kernel) with output state, then one decode token per sequence (recurrent)."""
    torch.manual_seed(0)
    cu = torch.tensor([0, 5, 12])
    _, state = GatedDeltaNet.forward(layer, torch.randn(1, 12, layer.hidden_size), cu_seqlens=cu, output_state=True)
    assert isinstance(state, GDNState)
    GatedDeltaNet.forward(layer, torch.randn(2, 1, layer.hidden_size), state=state)


def _check(layer, calls, expected: str) -> None:
    assert layer.resolved_backend == expected
    _run_every_kernel(layer)
    other = "torch" if expected == "recording" else "recording"
    assert set(calls[expected]) == ALL_OPS, calls
    assert calls[other] == [], f"kernels ran on {other!r} while the layer reports {expected!r}: {calls[other]}"


@pytest.mark.parametrize("backend,expected", [("torch", "torch"), ("recording", "recording"), ("auto", "recording")])
def test_constructor_backend_reaches_every_kernel(calls, backend, expected):
    layer = GatedDeltaNet(8, 1, 2, 4, 4, backend=backend)
    assert layer.backend == backend and layer.norm.backend == backend
    _check(layer, calls, expected)


@pytest.mark.parametrize("backend,expected", [("torch", "torch"), ("recording", "recording")])
def test_backend_set_after_construction_reaches_every_kernel(calls, backend, expected):
    layer = GatedDeltaNet(8, 1, 2, 4, 4)
    layer.backend = backend
    _check(layer, calls, expected)


@pytest.mark.parametrize("backend,expected", [("torch", "torch"), ("recording", "recording")])
def test_from_hf_and_swap_backend_reach_every_kernel(calls, backend, expected):
    pytest.importorskip("transformers")
    from test_hf import qwen3_5

    from gdn_layer.hf import HFGatedDeltaNet, swap_gated_deltanet

    torch.manual_seed(0)
    model = qwen3_5()
    _check(GatedDeltaNet.from_hf(model.model.layers[0].linear_attn, backend=backend), calls, expected)
    calls["torch"].clear(), calls["recording"].clear()
    assert swap_gated_deltanet(model, backend=backend) == 2
    swapped = [m for m in model.modules() if isinstance(m, HFGatedDeltaNet)]
    assert len(swapped) == 2
    for layer in swapped:
        _check(layer, calls, expected)
