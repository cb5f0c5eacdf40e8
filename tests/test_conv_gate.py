"""``causal_conv1d_gate``: the layer's conv and gate from its pre-conv buffer ``[x | a | b]`` as one op, whose
backward hands back the buffer's gradient as one tensor (concatenating ``[dx | da | db]`` instead costs
0.28 ms per layer call at 32k on an H200).

The oracle is the torch backend's ``causal_conv1d_split`` and ``gdn_gate`` run separately on the same float64
values (outputs, final state, and the gradients of every input for random upstream gradients). The Triton
kernels run under the interpreter on CPU, bound as the CUDA backends bind them (``triton_cpu_backend``).
"""
import dataclasses

import pytest
import torch

from gdn_layer.kernels import (causal_conv1d_gate, causal_conv1d_split, gdn_gate, ops_conv, ops_gate, ops_library,
                               registry, triton_ops)

SIZES, H, W = [8, 8, 16], 2, 4
C = sum(SIZES)
DEV = "cuda" if torch.cuda.is_available() else "cpu"   # (the Triton kernels compiled there, interpreted here)


def inputs(B=1, T=37, dtype=torch.float64, init=True, cu=(0, 5, 5, 37), seed=0):
    g = torch.Generator().manual_seed(seed)
    N = B if cu is None else len(cu) - 1
    mixed = torch.randn(B, T, C + 2 * H, generator=g).to(dtype)
    inp = dict(mixed=mixed, weight=(torch.randn(C, W, generator=g) / 2).to(dtype),
               A_log=torch.empty(H).uniform_(-3, 0, generator=g).to(dtype),
               dt_bias=torch.randn(H, generator=g).to(dtype),
               initial_state=torch.randn(N, C, W - 1, generator=g).to(dtype) if init else None,
               cu=None if cu is None else torch.tensor(cu))
    return {k: None if v is None else v.to(DEV) for k, v in inp.items()}


def fused(inp, backend):
    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items() if k != "cu" and v is not None}
    ys, g, beta, final = causal_conv1d_gate(leaves["mixed"], leaves["weight"], leaves["A_log"], leaves["dt_bias"],
                                            SIZES, cu_seqlens=inp["cu"], initial_state=leaves.get("initial_state"),
                                            output_final_state=True, backend=backend)
    return leaves, [*ys, g, beta, final]


def separate(inp):
    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items() if k != "cu" and v is not None}
    x, a, b = leaves["mixed"].split([C, H, H], -1)
    ys, final = causal_conv1d_split(x, leaves["weight"], SIZES, cu_seqlens=inp["cu"],
                                    initial_state=leaves.get("initial_state"), output_final_state=True, backend="torch")
    g, beta = gdn_gate(a, b, leaves["A_log"], leaves["dt_bias"], backend="torch")
    return leaves, [*ys, g, beta, final]


def grads(leaves, outs, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o)).sum() for o in outs)
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


@pytest.fixture(params=[("torch", False, False), ("triton", False, True), ("triton", True, True),
                        ("triton", False, False)], ids=lambda p: f"{p[0]}-splits{int(p[1])}-into{int(p[2])}")
def backend(request, triton_cpu_backend, monkeypatch):
    """The torch backend, and our Triton kernels with and without ``conv_splits`` and ``grads_into`` (the
    CUDA backends ship one conv per part, gradients written in place)."""
    kind, conv_splits, grads_into = request.param
    if kind == "torch":
        return "torch"
    b = registry.backend_by_name(triton_cpu_backend)
    monkeypatch.setitem(registry._BACKENDS, triton_cpu_backend,
                        dataclasses.replace(b, conv_splits=conv_splits, grads_into=grads_into))
    return triton_cpu_backend


@pytest.mark.parametrize("layout", ["packed", "packed_no_state", "dense"])
def test_conv_gate_equals_the_split_conv_and_the_gate(backend, layout):
    inp = inputs(**{"packed": {}, "packed_no_state": dict(init=False),
                    "dense": dict(B=2, T=19, cu=None)}[layout])
    leaves_f, outs_f = fused(inp, backend)
    leaves_r, outs_r = separate(inp)
    for o_f, o_r in zip(outs_f, outs_r):
        torch.testing.assert_close(o_f, o_r, rtol=1e-10, atol=1e-12)
    grads_f, grads_r = grads(leaves_f, outs_f), grads(leaves_r, outs_r)
    assert set(grads_f) == set(grads_r)
    for name in grads_f:
        assert grads_f[name].abs().sum() > 0, name
        torch.testing.assert_close(grads_f[name], grads_r[name], rtol=1e-10, atol=1e-12, msg=name)


def test_conv_gate_fp32_triton_against_float64(backend):
    inp = inputs()
    leaves_f, outs_f = fused({k: (v.float() if v is not None and v.is_floating_point() else v)
                              for k, v in inp.items()}, backend)
    leaves_r, outs_r = separate(inp)
    for o_f, o_r in zip(outs_f, outs_r):
        torch.testing.assert_close(o_f.double(), o_r, rtol=1e-5, atol=1e-5)
    grads_f, grads_r = grads(leaves_f, outs_f), grads(leaves_r, outs_r)
    for name in grads_f:
        torch.testing.assert_close(grads_f[name].double(), grads_r[name], rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("conv_splits", [False, True])
def test_the_backward_writes_the_buffer_gradient_without_a_copy_or_concatenation(triton_cpu_backend, monkeypatch,
                                                                                conv_splits):
    """With ``grads_into`` the kernels write their columns of the gradient buffer: no part of it is copied in
    and no activation-sized concatenation runs. Without the flag every part is copied in once (the spies see
    it: the test can fail)."""
    inp = inputs(init=False)
    b = registry.backend_by_name(triton_cpu_backend)
    seen, real_cat, real_into = {}, torch.cat, ops_library._into
    for grads_into in (True, False):
        monkeypatch.setitem(registry._BACKENDS, triton_cpu_backend,
                            dataclasses.replace(b, conv_splits=conv_splits, grads_into=grads_into))
        leaves, outs = fused(inp, triton_cpu_backend)
        cats, copies = [], []

        def cat(tensors, *args, **kwargs):   # the ops call torch.cat (their kernels run below the dispatcher)
            out = real_cat(tensors, *args, **kwargs)
            cats.append(out.numel())
            return out

        def into(buffer, got):   # a gradient part that is not the buffer the backend was handed gets copied in
            if buffer is not None and got.data_ptr() != buffer.data_ptr():
                copies.append(buffer.numel())
            return real_into(buffer, got)

        with monkeypatch.context() as m:
            m.setattr(torch, "cat", cat)
            m.setattr(ops_conv, "_into", into)     # (the conv's and the gate's backwards fill their columns)
            m.setattr(ops_gate, "_into", into)
            grads(leaves, outs)
        seen[grads_into] = ([n for n in cats if n > C * W], copies)   # (activation-sized cats: not the weight's)
    assert seen[True] == ([], []), seen
    assert seen[False][0] == [] and sum(seen[False][1]) == inp["mixed"].numel(), seen


@pytest.mark.parametrize("cu", [None, (0, 3, 3, 20)])
def test_conv_dx_and_gate_grads_land_in_their_columns_only(cu):
    B, T = (2, 10) if cu is None else (1, 20)
    inp = inputs(B=B, T=T, dtype=torch.float32, init=False, cu=cu)
    x, a, b = inp["mixed"].split([C, H, H], -1)
    g = torch.Generator().manual_seed(3)
    dy, dg, dbeta = (torch.randn(*x.shape[:2], n, generator=g).to(DEV) for n in (C, H, H))
    cu_t = inp["cu"]
    want_dx, want_dw, _, _ = triton_ops.conv_bwd(dy, None, x, inp["weight"], None, "silu", cu_t)
    want_da, want_db, want_dA, want_ddt = triton_ops.gate_bwd(dg, dbeta, a, b, inp["A_log"], inp["dt_bias"])
    sentinel = 7.25
    buf = torch.full((B, T, C + 2 * H + 3), sentinel, device=DEV)     # 1 column before, 2 after: untouched
    dx, da, db = buf[..., 1:1 + C], buf[..., 1 + C:1 + C + H], buf[..., 1 + C + H:1 + C + 2 * H]
    got_dx, got_dw, _, _ = triton_ops.conv_bwd(dy, None, x, inp["weight"], None, "silu", cu_t, dx=dx)
    got_da, got_db, got_dA, got_ddt = triton_ops.gate_bwd(dg, dbeta, a, b, inp["A_log"], inp["dt_bias"],
                                                          da=da, db=db)
    assert [t.data_ptr() for t in (got_dx, got_da, got_db)] == [t.data_ptr() for t in (dx, da, db)]
    for got, want in ((dx, want_dx), (da, want_da), (db, want_db), (got_dw, want_dw), (got_dA, want_dA),
                      (got_ddt, want_ddt)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (buf[..., 0] == sentinel).all() and (buf[..., -2:] == sentinel).all()


def test_a_wrong_gradient_buffer_raises_before_any_kernel():
    inp = inputs(dtype=torch.float32, init=False)
    x, a, b = inp["mixed"].split([C, H, H], -1)
    dy = torch.randn(*x.shape[:2], C, device=DEV)
    with pytest.raises(ValueError, match="dx must be"):
        triton_ops.conv_bwd(dy, None, x, inp["weight"], None, "silu", inp["cu"],
                            dx=torch.empty(1, 37, C + 1, device=DEV))
    with pytest.raises(ValueError, match="dx must be"):
        triton_ops.conv_bwd(dy, None, x, inp["weight"], None, "silu", inp["cu"],
                            dx=torch.empty(1, 37, C, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="dx must be"):   # channels not unit-stride
        triton_ops.conv_bwd(dy, None, x, inp["weight"], None, "silu", inp["cu"],
                            dx=torch.empty(1, C, 37, device=DEV).mT)
    with pytest.raises(ValueError, match="db must be"):
        triton_ops.gate_bwd(a, b, a, b, inp["A_log"], inp["dt_bias"], db=torch.empty(1, 37, H + 1, device=DEV))


def with_l2norm(outs, D):
    """The oracle of ``l2norm_head_dim=D``: q and k (the first two parts) through ``reference.l2norm`` per head."""
    from gdn_layer.kernels import reference
    heads = lambda y: reference.l2norm(y.unflatten(-1, (-1, D))).flatten(-2)   # noqa: E731
    return [heads(outs[0]), heads(outs[1]), *outs[2:]]


@pytest.mark.parametrize("layout", ["packed", "packed_no_state", "dense"])
def test_l2norm_head_dim_normalises_q_and_k_per_head(backend, layout):
    """``l2norm_head_dim``: q and k L2-normalised over each head after the conv, in the conv kernels (Triton,
    one conv per part: the CUDA backends as shipped) or in torch around the conv (torch, split conv), with
    gradients through the norm; with initial states the Triton launcher normalises in torch after the conv. fp32
    against the float64 oracle: the separate ops and ``reference.l2norm``."""
    inp = inputs(**{"packed": {}, "packed_no_state": dict(init=False), "dense": dict(B=2, T=19, cu=None)}[layout])
    leaves = {k: v.clone().float().requires_grad_(True) for k, v in inp.items() if k != "cu" and v is not None}
    ys, g, beta, final = causal_conv1d_gate(leaves["mixed"], leaves["weight"], leaves["A_log"], leaves["dt_bias"],
                                            SIZES, cu_seqlens=inp["cu"], initial_state=leaves.get("initial_state"),
                                            output_final_state=True, backend=backend, l2norm_head_dim=4)
    outs_f = [*ys, g, beta, final]
    leaves_r, outs_r = separate(inp)
    outs_r = with_l2norm(outs_r, 4)
    assert outs_r[0].unflatten(-1, (2, 4)).norm(dim=-1).sub(1).abs().max() < 1e-3   # (unit heads: the norm ran)
    for o_f, o_r in zip(outs_f, outs_r):
        torch.testing.assert_close(o_f.double(), o_r, rtol=1e-5, atol=1e-5)
    grads_f, grads_r = grads(leaves, outs_f), grads(leaves_r, outs_r)
    for name in grads_f:
        torch.testing.assert_close(grads_f[name].double(), grads_r[name], rtol=1e-5, atol=1e-5, msg=name)


def test_l2norm_head_dim_is_checked():
    inp = inputs(dtype=torch.float32)
    m, w, A, dt = inp["mixed"], inp["weight"], inp["A_log"], inp["dt_bias"]
    for bad, error in ((0, ValueError), (-8, ValueError), (True, TypeError), (4.0, TypeError), (2 ** 63, ValueError),
                       (3, ValueError), (16, ValueError)):   # 16 divides v's 16 but not q's / k's 8
        with pytest.raises(error, match="l2norm_head_dim"):
            causal_conv1d_gate(m, w, A, dt, SIZES, cu_seqlens=inp["cu"], l2norm_head_dim=bad)


def test_l2norm_head_dim_under_create_graph_gives_the_first_order_gradient_and_refuses_the_second(backend):
    """``create_graph=True`` (gradient penalties, meta-learning): the first-order gradient through the norm is
    the plain one on every backend (the torch-side norm's backward runs without recording autograd), and a
    second backward raises instead of returning a partial second derivative."""
    inp = inputs(init=False)
    leaves = {k: v.clone().requires_grad_(True) for k, v in inp.items() if k != "cu" and v is not None}
    outs = None
    for create_graph in (False, True):
        ys, *_ = causal_conv1d_gate(leaves["mixed"], leaves["weight"], leaves["A_log"], leaves["dt_bias"], SIZES,
                                    cu_seqlens=inp["cu"], backend=backend, l2norm_head_dim=4)
        gy = torch.randn(ys[0].shape, generator=torch.Generator().manual_seed(5), dtype=ys[0].dtype).to(DEV)
        g, = torch.autograd.grad((ys[0] * gy).sum(), leaves["mixed"], create_graph=create_graph)
        outs = [g] if outs is None else outs + [g]
    torch.testing.assert_close(outs[1].detach(), outs[0], rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="conv_gate is not twice differentiable"):
        outs[1].square().sum().backward()


def test_l2norm_backends_are_checked_when_registered():
    """``conv_l2norm=True`` promises a conv taking ``l2norm_dim=`` and a conv backward taking ``l2norm_out=``
    (inherited by ``dataclasses.replace`` of a shipped backend, as ``grads_into``)."""
    torch_b = registry.backend_by_name("torch")
    with pytest.raises(TypeError, match="conv_l2norm=True, so its causal_conv1d must take l2norm_dim="):
        registry.register_backend(dataclasses.replace(torch_b, name="no_l2", conv_l2norm=True))
    with pytest.raises(TypeError, match="conv_l2norm=True, so its causal_conv1d_bwd must take l2norm_out="):
        registry.register_backend(dataclasses.replace(torch_b, name="no_l2_bwd", conv_l2norm=True,
                                                      causal_conv1d=triton_ops.conv_fwd))
    assert "no_l2" not in registry._BACKENDS and "no_l2_bwd" not in registry._BACKENDS


def test_conv_fuses_l2norm_only_with_the_flag_and_one_conv_per_part(triton_cpu_backend, monkeypatch):
    """The layer moves the delta rule's q / k norm into the conv only where the conv kernels take it."""
    assert not registry.conv_fuses_l2norm("torch", "cpu")
    assert not registry.conv_fuses_l2norm(triton_cpu_backend, "cpu")      # (the fixture's split conv)
    b = registry.backend_by_name(triton_cpu_backend)
    monkeypatch.setitem(registry._BACKENDS, triton_cpu_backend, dataclasses.replace(b, conv_splits=False))
    assert registry.conv_fuses_l2norm(triton_cpu_backend, "cpu")
    monkeypatch.setitem(registry._BACKENDS, triton_cpu_backend,
                        dataclasses.replace(b, conv_splits=False, conv_l2norm=False))
    assert not registry.conv_fuses_l2norm(triton_cpu_backend, "cpu")


def test_conv_gate_names_the_argument_it_rejects():
    inp = inputs(dtype=torch.float32)
    m, w, A, dt = inp["mixed"], inp["weight"], inp["A_log"], inp["dt_bias"]
    with pytest.raises(ValueError, match=r"split_sizes must sum to C = mixed.shape\[-1\] - 2 \* A_log"):
        causal_conv1d_gate(m, w, A, dt, [8, 8, 15], cu_seqlens=inp["cu"])
    with pytest.raises(TypeError, match="split_sizes"):
        causal_conv1d_gate(m, w, A, dt, [8, 8, 16.0], cu_seqlens=inp["cu"])
    with pytest.raises(ValueError, match="mixed must be"):
        causal_conv1d_gate(m[0], w, A, dt, SIZES)
    with pytest.raises(TypeError, match="mixed"):
        causal_conv1d_gate(m.long(), w, A, dt, SIZES)
    with pytest.raises(ValueError, match="dt_bias must be"):
        causal_conv1d_gate(m, w, A, dt[:1], SIZES, cu_seqlens=inp["cu"])
    with pytest.raises(ValueError, match=r"dt_bias must be \[H\] like A_log"):   # (not a split_sizes error)
        causal_conv1d_gate(m, w, torch.cat([A, A]), dt, SIZES, cu_seqlens=inp["cu"])
    with pytest.raises(ValueError, match=r"weight must be \[C, W\] with C = mixed\[\.\.\., :C\]"):
        causal_conv1d_gate(m, w[:-1], A, dt, SIZES, cu_seqlens=inp["cu"])
    with pytest.raises(ValueError, match="A_log must be"):   # no heads
        causal_conv1d_gate(m[..., :C], w, A[:0], dt[:0], SIZES, cu_seqlens=inp["cu"])
    with pytest.raises(ValueError, match="cu_seqlens must be 1-D"):   # (a shape rule: checked on every device)
        causal_conv1d_gate(m, w, A, dt, SIZES, cu_seqlens=torch.tensor([[0, 5, 37]], device=DEV))


def test_grads_into_promises_both_backwards_with_their_buffers():
    """A backend with ``grads_into=True`` (the flag is inherited by ``dataclasses.replace`` of a shipped one) whose
    conv or gate backward is missing, or does not take the buffers, is refused when registered."""
    torch_b = registry.backend_by_name("torch")
    with pytest.raises(TypeError, match="grads_into=True, so its causal_conv1d_bwd must take dx="):
        registry.register_backend(dataclasses.replace(torch_b, name="no_bwd", grads_into=True))
    old_signature = dict(causal_conv1d_bwd=lambda dy, dfinal, x, w, bias=None, activation="silu", cu=None,
                         initial_state=None: None, gdn_gate_bwd=triton_ops.gate_bwd)
    with pytest.raises(TypeError, match="causal_conv1d_bwd must take dx="):
        registry.register_backend(dataclasses.replace(torch_b, name="old_sig", grads_into=True, **old_signature))
    assert "no_bwd" not in registry._BACKENDS and "old_sig" not in registry._BACKENDS


def test_a_grads_into_backend_that_returns_its_own_gradients_is_copied_in(triton_cpu_backend, monkeypatch):
    """The contract asks the backwards to write the given views; one that returns new tensors instead still
    gives the right gradient (copied into the buffer), never the buffer's uninitialised memory."""
    b = registry.backend_by_name(triton_cpu_backend)

    def conv_bwd(dy, dfinal, x, w, bias=None, activation="silu", cu=None, initial_state=None, dx=None):
        return triton_ops.conv_bwd(dy, dfinal, x, w, bias, activation, cu, initial_state)   # dx left unwritten

    def gate_bwd(dg, dbeta, a, b_, A_log, dt_bias, da=None, db=None):
        return triton_ops.gate_bwd(dg, dbeta, a, b_, A_log, dt_bias)

    monkeypatch.setitem(registry._BACKENDS, triton_cpu_backend, dataclasses.replace(
        b, causal_conv1d_bwd=conv_bwd, gdn_gate_bwd=gate_bwd, grads_into=True))
    inp = inputs()
    leaves_f, outs_f = fused(inp, triton_cpu_backend)
    leaves_r, outs_r = separate(inp)
    torch.testing.assert_close(grads(leaves_f, outs_f)["mixed"], grads(leaves_r, outs_r)["mixed"],
                               rtol=1e-10, atol=1e-12)
