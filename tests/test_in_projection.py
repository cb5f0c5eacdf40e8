"""The split layout's two input projections with one input gradient (gdn_layer/in_projection.py).

Oracle: the two ``F.linear`` calls through autograd, float64, fresh random inputs."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from gdn_layer import GatedDeltaNet
from gdn_layer.in_projection import _TwoProjections, two_projections

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def inputs(shape, H=24, Fm=40, Fz=16, dtype=torch.float64, x_grad=True, w_grad=True, strided=False):
    x = torch.randn(*shape[:-1], H, dtype=dtype)
    if strided:   # [T, B, H] transposed to [B, T, H]: a non-contiguous input
        x = torch.randn(shape[1], shape[0], H, dtype=dtype).transpose(0, 1)
    return (x.requires_grad_(x_grad), torch.randn(Fm, H, dtype=dtype, requires_grad=w_grad),
            torch.randn(Fz, H, dtype=dtype, requires_grad=w_grad))


def grads_of(fn, x, w_m, w_z, d_m, d_z):
    m, z = fn(x, w_m, w_z)
    leaves = [t for t in (x, w_m, w_z) if t.requires_grad]
    return (m, z, *torch.autograd.grad((m, z), leaves, (d_m, d_z)))


@pytest.mark.parametrize("x_grad, w_grad", [(True, True), (True, False)])
@pytest.mark.parametrize("shape, strided", [((1, 37, 24), False), ((3, 11, 24), False), ((2, 9, 24), True)])
def test_values_and_gradients_are_those_of_two_linears(shape, strided, x_grad, w_grad):
    torch.manual_seed(0)
    x, w_m, w_z = inputs(shape, x_grad=x_grad, w_grad=w_grad, strided=strided)
    d_m, d_z = torch.randn(*x.shape[:-1], 40, dtype=x.dtype), torch.randn(*x.shape[:-1], 16, dtype=x.dtype)
    ours = grads_of(two_projections, x, w_m, w_z, d_m, d_z)
    ref = grads_of(lambda x, a, b: (F.linear(x, a), F.linear(x, b)), x, w_m, w_z, d_m, d_z)
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck_and_second_order():
    torch.manual_seed(1)
    x, w_m, w_z = inputs((2, 5, 6), H=6, Fm=7, Fz=3)
    torch.autograd.gradcheck(lambda *t: _TwoProjections.apply(*t), (x, w_m, w_z))
    torch.autograd.gradgradcheck(lambda *t: _TwoProjections.apply(*t), (x, w_m, w_z))


def test_the_input_gradient_is_summed_inside_the_gemms():
    """The fused path's backward: three GEMMs (one accumulating) and no elementwise add of the two input
    gradients, which two ``F.linear`` calls cost through autograd."""
    from bench_null_backend import OpLog
    torch.manual_seed(2)
    x, w_m, w_z = inputs((1, 16, 24), dtype=torch.float32)

    def backward_ops(fn):
        m, z = fn(x, w_m, w_z)
        d_m, d_z = torch.randn_like(m), torch.randn_like(z)
        with OpLog(skip_empty=True) as log:
            torch.autograd.grad((m, z), (x, w_m, w_z), (d_m, d_z))
        return log.names
    plain = backward_ops(lambda x, a, b: (F.linear(x, a), F.linear(x, b)))
    fused = backward_ops(two_projections)
    assert "aten::add" in plain   # (what the fused backward saves; if torch stops adding, this test says so)
    assert "aten::add" not in fused and "aten::add_" not in fused, fused
    assert "aten::addmm_" in fused, fused


@pytest.mark.parametrize("case", ["no_grad", "x_without_grad", "autocast", "mixed_dtypes"])
def test_falls_back_to_two_linears_where_the_fusion_would_change_something(case):
    """Outside the fused path's conditions the two ``F.linear`` calls run as they are: their values, their
    autocast dtype, their error for mixed dtypes."""
    torch.manual_seed(3)
    x, w_m, w_z = inputs((1, 8, 24), dtype=torch.float32)
    if case == "no_grad":
        with torch.no_grad():
            m, z = two_projections(x, w_m, w_z)
        assert m.grad_fn is None and z.grad_fn is None
    elif case == "x_without_grad":
        m, z = two_projections(x.detach(), w_m, w_z)
        assert "TwoProjections" not in type(m.grad_fn).__name__
    elif case == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            m, z = two_projections(x, w_m, w_z)
        assert m.dtype == z.dtype == torch.bfloat16
        torch.testing.assert_close(m.float(), F.linear(x, w_m).detach(), rtol=2e-2, atol=2e-2)
        return
    else:
        with pytest.raises(RuntimeError):
            two_projections(x.double(), w_m, w_z)
        return
    torch.testing.assert_close(m, F.linear(x, w_m).detach())
    torch.testing.assert_close(z, F.linear(x, w_z).detach())


def test_layer_uses_it_only_for_plain_linears():
    """The layer's split layout takes the fused path with plain ``nn.Linear`` projections, and calls a wrapped
    ``in_proj_z`` (a hook here) as a module, with the same result."""
    torch.manual_seed(4)
    layer = GatedDeltaNet(32, 2, 4, 8, 8, backend="torch", dtype=torch.float64)
    x = torch.randn(1, 12, 32, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 5, 12])
    mixed, z = layer._project(x)
    assert type(mixed.grad_fn).__name__ == "_TwoProjectionsBackward"
    y = layer(x, cu_seqlens=cu)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, layer.in_proj_z.weight), dy)
    calls = []
    handle = layer.in_proj_z.register_forward_hook(lambda *a: calls.append(1))
    try:
        mixed, _ = layer._project(x)
        assert type(mixed.grad_fn).__name__ != "_TwoProjectionsBackward" and calls
        y2 = layer(x, cu_seqlens=cu)
        dx2, dw2 = torch.autograd.grad(y2, (x, layer.in_proj_z.weight), dy)
    finally:
        handle.remove()
    torch.testing.assert_close(y2, y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx2, dx, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(dw2, dw, rtol=1e-10, atol=1e-12)


def test_saves_what_two_linears_save():
    """With frozen weights x is not kept for the backward (so an in-place change of x after the forward is fine,
    as with ``F.linear``); with every input needing a gradient x and both weights are kept."""
    torch.manual_seed(6)

    def saved_shapes(*args):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            out = two_projections(*args)
        assert type(out[0].grad_fn).__name__ == "_TwoProjectionsBackward"
        return sorted(shapes)
    assert saved_shapes(*inputs((1, 8, 24), w_grad=False)) == [(16, 24), (40, 24)]
    assert saved_shapes(*inputs((1, 8, 24))) == [(1, 8, 24), (16, 24), (40, 24)]
    x, w_m, w_z = inputs((1, 8, 24), w_grad=False)
    m, z = two_projections(x, w_m, w_z)
    d_m, d_z = torch.randn_like(m), torch.randn_like(z)
    with torch.no_grad():
        x.mul_(2)
    dx, = torch.autograd.grad((m, z), (x,), (d_m, d_z))
    torch.testing.assert_close(dx, d_m @ w_m + d_z @ w_z)


def test_an_output_without_gradient_leaves_its_weight_gradient_none():
    torch.manual_seed(7)
    x, w_m, w_z = inputs((1, 8, 24), dtype=torch.float64)
    m, z = two_projections(x, w_m, w_z)
    d_m = torch.randn_like(m)
    m.backward(d_m)
    assert w_z.grad is None
    torch.testing.assert_close(w_m.grad, d_m.reshape(-1, 40).t() @ x.detach().reshape(-1, 24))
    torch.testing.assert_close(x.grad, d_m @ w_m.detach())


def test_falls_back_on_a_device_type_autocast_does_not_know(monkeypatch):
    """(``torch.is_autocast_enabled`` raises for such a device type; ``lazy`` is one.)"""
    x, w_m, w_z = inputs((1, 8, 24), dtype=torch.float32)
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device_type: False)
    m, _ = two_projections(x, w_m, w_z)
    assert "TwoProjections" not in type(m.grad_fn).__name__


def _weight_copies(layer, x):
    """The ``aten.cat`` calls of one call whose output is weight-sized (``hidden`` columns)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Cats(TorchDispatchMode):
        found = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.cat.default and out.dim() == 2 and out.shape[-1] == layer.hidden_size:
                self.found.append(tuple(out.shape))
            return out
    with Cats() as spy:
        y = layer(x)
    return y, spy.found


@pytest.mark.parametrize("tokens, mode, copies", [(3, "no_grad", False), (3, "inference", False),
                                                  (3, "grad", True), (40, "no_grad", True)])
def test_few_inference_tokens_project_without_copying_the_weights(tokens, mode, copies):
    """Fewer tokens than hidden and no autograd recording: one GEMM per part (no weight concatenation), the
    values of the concatenated GEMM; otherwise the concatenation, as training runs it."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 8, 8, dtype=torch.float64)
    x = torch.randn(1, tokens, 32, dtype=torch.float64)
    ctx = {"no_grad": torch.no_grad(), "inference": torch.inference_mode(), "grad": torch.enable_grad()}[mode]
    with ctx:
        _, found = _weight_copies(layer, x)
        mixed, z = layer._project(x)
    assert bool(found) == copies, found
    with torch.no_grad():
        w = torch.cat([layer.in_proj_qkv.weight, layer.in_proj_a.weight, layer.in_proj_b.weight])
        assert (mixed - F.linear(x, w)).abs().max() < 1e-12
        assert (z.flatten(2) - F.linear(x, layer.in_proj_z.weight)).abs().max() < 1e-12
