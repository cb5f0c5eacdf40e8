"""``Backend.chunk_residuals``: what a backend's chunk forward keeps for its backward (FlashQLA's gate cumsum
and UT matrices) reaches that backward unchanged through the ``gdn_layer`` ops and the layer, in eager mode;
nowhere else is it asked for (``torch.compile``, no autograd, the recurrent op), and the backward then gets
``residuals=None``. The gradients are checked against the torch backend's on the same inputs.

The backend under test is the torch reference whose chunk forward returns two residuals, fresh tensors that
its backward checks against the forward's and only then uses (the gradients go through ``torch.func.vjp``
of the reference), recording what it was given.
"""
import dataclasses

import pytest
import torch

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import chunk_gated_delta_rule, recurrent_gated_delta_rule, registry
from gdn_layer.kernels import reference


@pytest.fixture
def keeping():
    """Register ``"keeping"``; yields its log: ``{"made": [(r0, r1) per forward], "given": [residuals per backward],
    "asked": [bool per chunk forward]}``."""
    log = {"made": [], "given": [], "asked": []}
    torch_b = registry.backend_by_name("torch")

    def fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu=None,
            use_qk_l2norm=False, residuals=False):
        log["asked"].append(residuals)
        o, final = torch_b.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                                  output_final_state=output_final_state, cu=cu,
                                                  use_qk_l2norm=use_qk_l2norm)
        if not residuals:
            return o, final
        made = (g.cumsum(1).float(), k.detach().clone())        # packed layout, any shapes: opaque to ops
        log["made"].append(made)
        return o, final, made

    def bwd(do, dfinal, q, k, v, g, beta, scale=None, initial_state=None, cu=None, use_qk_l2norm=False,
            residuals=None):
        log["given"].append(residuals)
        if residuals is not None:      # the backend's own check that they belong to these inputs
            assert torch.equal(residuals[0], g.cumsum(1).float()) and torch.equal(residuals[1], k)
        prim = [t.detach() for t in (q, k, v, g, beta, initial_state) if t is not None]

        def f(q, k, v, g, beta, h0=None):
            o, final = torch_b.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                                      output_final_state=dfinal is not None, cu=cu,
                                                      use_qk_l2norm=use_qk_l2norm)
            return (o, final) if dfinal is not None else (o,)
        _, pull = torch.func.vjp(f, *prim)
        grads = pull((do, dfinal) if dfinal is not None else (do,))
        return (*grads[:5], grads[5] if initial_state is not None else None)

    b = dataclasses.replace(torch_b, name="keeping", priority=-1, chunk_gated_delta_rule=fwd,
                            chunk_gated_delta_rule_bwd=bwd, chunk_residuals=True)
    registry.register_backend(b)
    yield log
    registry._BACKENDS.pop("keeping")


def _inputs(seed, T=23, cu=(0, 9, 9, 23), dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)   # noqa: E731
    q, k = (torch.nn.functional.normalize(r(1, T, 2, 8), dim=-1) for _ in range(2))
    v = r(1, T, 4, 8)
    g = -torch.rand(1, T, 4, generator=gen, dtype=dtype) * 0.05     # slow decay
    beta = torch.rand(1, T, 4, generator=gen, dtype=dtype)
    h0 = r(len(cu) - 1, 4, 8, 8) * 0.1
    return [t.requires_grad_(True) for t in (q, k, v, g, beta, h0)], torch.tensor(cu)


def _grads(backend, seed, **kw):
    xs, cu = _inputs(seed)
    o, final = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu,
                                      backend=backend, **kw)
    gen = torch.Generator().manual_seed(seed + 1)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (final * final).sum()
    return torch.autograd.grad(loss, xs)


def test_the_backward_gets_what_the_forward_kept(keeping):
    got = _grads("keeping", 0)
    assert keeping["asked"] == [True] and len(keeping["made"]) == len(keeping["given"]) == 1
    assert all(a is b for a, b in zip(keeping["given"][0], keeping["made"][0]))      # the same tensors
    for a, b in zip(got, _grads("torch", 0)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_a_forward_that_kept_nothing_gives_the_backward_none(keeping, monkeypatch):
    b = registry.backend_by_name("keeping")
    fwd = b.chunk_gated_delta_rule
    monkeypatch.setitem(registry._BACKENDS, "keeping", dataclasses.replace(
        b, chunk_gated_delta_rule=lambda *a, residuals=False, **k: (*fwd(*a, **k)[:2], ()) if residuals else fwd(*a, **k)))
    for a, b_ in zip(_grads("keeping", 1), _grads("torch", 1)):
        torch.testing.assert_close(a, b_, rtol=1e-10, atol=1e-12)
    assert keeping["given"] == [None]


def test_nothing_is_kept_without_autograd_or_for_the_recurrent_op(keeping):
    xs, cu = _inputs(2)
    with torch.no_grad():
        out = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], cu_seqlens=cu, backend="keeping")
    with torch.inference_mode():
        out2 = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], cu_seqlens=cu, backend="keeping")
    assert len(out) == len(out2) == 2 and keeping["asked"] == [False, False] and keeping["made"] == []
    o, _ = recurrent_gated_delta_rule(*(x[:, :1] for x in xs[:5]), initial_state=xs[5][:1], output_final_state=True,
                                      cu_seqlens=torch.arange(2), backend="keeping")
    o.sum().backward()                          # the recurrent op's functions take no residuals= (would raise)
    assert keeping["asked"] == [False, False]


def test_under_torch_compile_nothing_is_kept(keeping):
    xs, cu = _inputs(3)

    def f(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                      backend="keeping")
    o, final = torch.compile(f, backend="aot_eager", fullgraph=True)(*xs)
    (o.sum() + final.sum()).backward()
    assert keeping["asked"] and not any(keeping["asked"]) and keeping["given"] == [None]
    want = torch.autograd.grad(sum(t.sum() for t in chunk_gated_delta_rule(
        *xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu, backend="torch")), xs)
    for x, w in zip(xs, want):
        torch.testing.assert_close(x.grad, w, rtol=1e-10, atol=1e-12)


def test_the_layer_trains_through_kept_residuals(keeping):
    """The layer's packed training step on the keeping backend: the same output and gradients as on torch."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(16, 2, 4, 8, 8, backend="torch", dtype=torch.float64)
    x = torch.randn(1, 20, 16, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 7, 20])
    out = {}
    for name in ("torch", "keeping"):
        layer.backend = name
        x.grad = None
        layer.zero_grad()
        y = layer(x, cu_seqlens=cu)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        out[name] = (y.detach(), x.grad.clone(), [p.grad.clone() for p in layer.parameters()])
    assert len(keeping["given"]) == 1 and keeping["given"][0] is not None
    torch.testing.assert_close(out["keeping"][0], out["torch"][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["keeping"][1], out["torch"][1], rtol=1e-10, atol=1e-12)
    for a, b in zip(out["keeping"][2], out["torch"][2]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bad,got", [
    (lambda out: (*out[:2], (torch.zeros(1),)), "residuals tuple of 1"),
    (lambda out: (*out[:2], (torch.zeros(1),) * 3), "residuals tuple of 3"),
    (lambda out: (*out[:2], None), "residuals NoneType"),
    (lambda out: (*out[:2], (torch.zeros(1), None)), "residuals tuple of 2"),
    (lambda out: (*out[:2], torch.zeros(2, 3)), "residuals Tensor"),     # (not split into two rows)
    (lambda out: out[:2], "2 values"),                                   # took residuals=, returned none
])
def test_residuals_that_are_not_empty_or_a_pair_of_tensors_are_an_error(keeping, monkeypatch, bad, got):
    b = registry.backend_by_name("keeping")
    fwd = b.chunk_gated_delta_rule
    monkeypatch.setitem(registry._BACKENDS, "keeping", dataclasses.replace(
        b, chunk_gated_delta_rule=lambda *a, **k: bad(fwd(*a, **k))))
    xs, cu = _inputs(4)
    with pytest.raises(RuntimeError, match=r"backend 'keeping' has chunk_residuals=True, so its "
                       r"chunk_gated_delta_rule called with residuals=True must return \(o, final, residuals\) "
                       r".*; got " + got):
        chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], cu_seqlens=cu, backend="keeping")


def test_nothing_is_kept_when_no_input_needs_a_gradient(keeping):
    """Grad mode on, but nothing to differentiate (a frozen layer's eval pass): not asked."""
    xs, cu = _inputs(5)
    out = chunk_gated_delta_rule(*(x.detach() for x in xs[:5]), initial_state=xs[5].detach(), cu_seqlens=cu,
                                 backend="keeping")
    assert len(out) == 2 and keeping["asked"] == [False]
    o, _ = chunk_gated_delta_rule(xs[0].detach(), xs[1].detach(), xs[2], *(x.detach() for x in xs[3:5]),
                                  initial_state=xs[5].detach(), cu_seqlens=cu, backend="keeping")
    o.sum().backward()                          # only v needs one: kept, and given back
    assert keeping["asked"] == [False, True] and keeping["given"][0] is not None


def test_chunk_residuals_backends_are_checked_when_registered():
    torch_b = registry.backend_by_name("torch")
    with pytest.raises(TypeError, match="chunk_residuals=True, so its chunk_gated_delta_rule must take residuals="):
        registry.register_backend(dataclasses.replace(torch_b, name="no_res", chunk_residuals=True))
    with pytest.raises(TypeError, match="chunk_residuals=True, so its chunk_gated_delta_rule_bwd is None: it needs one"):
        registry.register_backend(dataclasses.replace(
            torch_b, name="no_res_bwd", chunk_residuals=True,
            chunk_gated_delta_rule=lambda *a, residuals=False, **k: reference.chunk_gated_delta_rule(*a, **k)))
    assert "no_res" not in registry._BACKENDS and "no_res_bwd" not in registry._BACKENDS
