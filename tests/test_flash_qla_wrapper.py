"""The ``flash_qla`` backend's own code on CPU, with FlashQLA replaced by a stand-in.

FlashQLA (TileLang, SM90/SM100) cannot run here, so ``flash_qla.ops.gated_delta_rule.chunk`` is faked
by the float64 torch reference with FlashQLA's call signatures, and the fake returns NaN for any pack
with a zero-length segment, as FlashQLA 0.1.3 did on an H200 (``cu = [0, 100, 100, 257, 700]``). What is
tested is the wrapper: it must hand FlashQLA the pack without its empty segments and pass the dropped
sequences' states through, forward (final = initial) and backward (d initial = d final).
"""
import sys
import types

import pytest
import torch

from gdn_layer.kernels import flash_qla_backend, reference, varlen


def _fake_flash_qla(monkeypatch, calls):
    def _check(cu):
        calls.append(None if cu is None else cu.tolist())
        return cu is not None and bool(((cu[1:] - cu[:-1]) == 0).any())

    def run(q, k, v, g, beta, scale, h0, cu, out_state):
        o, s = reference.chunk_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                                scale, None if h0 is None else h0.double(), out_state, cu)
        return o, s

    def fwd(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, output_final_state=True,
            auto_cp=True):
        assert auto_cp is False
        o, s = run(q, k, v, g, beta, scale, initial_state, cu_seqlens, output_final_state)
        if _check(cu_seqlens):
            o = torch.full_like(o, float("nan"))
        A = torch.full((*k.shape[:2], v.shape[2], 64), float(len(chunk.made_A)), dtype=k.dtype)  # a marked A
        chunk.made_A.append(A)
        return g, A, o.to(v.dtype), None, None if s is None else s.float(), None

    def bwd(q, k, v, g, beta, A, do, dht, scale=None, initial_state=None, cu_seqlens=None, auto_cp=True):
        chunk.seen_A.append(A)
        nan = _check(cu_seqlens)
        leaves = [t.double().requires_grad_(True) for t in (q, k, v, g, beta)]
        h0 = None if initial_state is None else initial_state.double().requires_grad_(True)
        o, s = reference.chunk_gated_delta_rule(*leaves, scale, h0, dht is not None, cu_seqlens)
        loss = (o * do.double()).sum() + (0 if dht is None else (s * dht.double()).sum())
        grads = torch.autograd.grad(loss, leaves + ([h0] if h0 is not None else []))
        dq, dk, dv, dg, db = (gr.to(t.dtype) for gr, t in zip(grads[:5], (q, k, v, g, beta)))
        dh0 = grads[5].float() if h0 is not None else None
        if nan:
            dq = torch.full_like(dq, float("nan"))
        return dq, dk, dv, db, dg, dh0

    chunk = types.ModuleType("flash_qla.ops.gated_delta_rule.chunk")
    chunk.chunk_gated_delta_rule_fwd, chunk.chunk_gated_delta_rule_bwd = fwd, bwd
    chunk.CHUNK_SIZE = 64
    chunk.chunk_local_cumsum = lambda g, cu_seqlens, chunk_size: g   # the fake's bwd takes the raw gate
    chunk.made_A, chunk.seen_A = [], []

    def kkt_solve(k, b, cu_seqlens, chunk_size):
        chunk.made_A.append(torch.full((*k.shape[:2], b.shape[2], 64), -1.0, dtype=k.dtype))   # recomputed
        return chunk.made_A[-1]
    chunk.kkt_solve = kkt_solve
    names = ["flash_qla", "flash_qla.ops", "flash_qla.ops.gated_delta_rule"]
    mods = {n: types.ModuleType(n) for n in names}
    mods["flash_qla"].ops, mods["flash_qla.ops"].gated_delta_rule = mods["flash_qla.ops"], mods[names[2]]
    mods[names[2]].chunk = chunk
    for n, m in [*mods.items(), (chunk.__name__, chunk)]:
        monkeypatch.setitem(sys.modules, n, m)
    return chunk


def _inputs(cu, with_state, seed):
    gen = torch.Generator().manual_seed(seed)
    T, N, Hk, Hv, D = cu[-1], len(cu) - 1, 2, 4, 128
    r = lambda *s: torch.randn(*s, generator=gen)   # noqa: E731
    q, k = (torch.nn.functional.normalize(r(1, T, Hk, D), dim=-1).bfloat16() for _ in range(2))
    v = r(1, T, Hv, D).bfloat16()
    g = -torch.rand(1, T, Hv, generator=gen) * 0.05          # slow decay: a lost state would show
    beta = torch.rand(1, T, Hv, generator=gen).bfloat16()
    h0 = r(N, Hv, D, D) * 0.1 if with_state else None
    return (q, k, v, g, beta), h0, torch.tensor(cu)


@pytest.mark.parametrize("cu", [[0, 100, 100, 257, 700], [0, 0, 0, 70, 70], [0, 3, 3], [0, 65, 130]])
@pytest.mark.parametrize("with_state", [True, False])
def test_empty_segments_are_dropped_and_their_states_pass_through(monkeypatch, cu, with_state):
    calls = []
    _fake_flash_qla(monkeypatch, calls)
    xs, h0, cut = _inputs(cu, with_state, seed=len(cu) + with_state)
    o, s = flash_qla_backend.chunk_fwd(*xs, initial_state=h0, output_final_state=True, cu=cut)
    o_r, s_r = reference.chunk_gated_delta_rule(*(x.double() for x in xs), None,
                                                None if h0 is None else h0.double(), True, cut)
    assert torch.isfinite(o).all()
    torch.testing.assert_close(o.double(), o_r, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(s.double(), s_r, rtol=1e-5, atol=1e-5)
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(o.shape, generator=gen).bfloat16()
    dfinal = torch.randn(s.shape, generator=gen)
    grads = flash_qla_backend.chunk_bwd(do, dfinal, *xs, initial_state=h0, cu=cut)
    leaves = [x.double().requires_grad_(True) for x in xs]
    h = None if h0 is None else h0.double().requires_grad_(True)
    o_r, s_r = reference.chunk_gated_delta_rule(*leaves, None, h, True, cut)
    loss = (o_r * do.double()).sum() + (s_r * dfinal.double()).sum()
    want = torch.autograd.grad(loss, leaves + ([h] if h is not None else []))
    for i, w in enumerate(want):         # chunk_bwd returns dq, dk, dv, dg, dbeta, dh0
        assert torch.isfinite(grads[i]).all()
        torch.testing.assert_close(grads[i].double(), w, rtol=2e-2, atol=2e-2)
    if h0 is None:
        assert grads[5] is None
    # FlashQLA itself never saw an empty segment (the fake would have returned NaN)
    assert calls and all(c is None or all(b > a for a, b in zip(c, c[1:])) for c in calls)


def test_without_empty_segments_keeps_every_boundary():
    cu = torch.tensor([0, 0, 5, 5, 5, 9, 12, 12])
    c = varlen.without_empty_segments(cu)
    assert c.cu.tolist() == [0, 5, 9, 12] and c.keep.tolist() == [1, 4, 5] and c.num_seqs == 7
    assert varlen.without_empty_segments(torch.tensor([0, 1, 3])) is None
    full = torch.randn(7, 2)
    kept = torch.randn(3, 2)
    out = varlen.expand_states(c, kept, full)
    torch.testing.assert_close(out[c.keep], kept)
    torch.testing.assert_close(out[[0, 2, 3, 6]], full[[0, 2, 3, 6]])
    assert torch.equal(varlen.expand_states(c, kept, None)[[0, 2, 3, 6]], torch.zeros(4, 2))


@pytest.mark.parametrize("cu", [[0, 0], [0, 0, 0, 0]])
@pytest.mark.parametrize("with_state", [True, False])
def test_a_pack_of_only_empty_segments_returns_every_state(monkeypatch, cu, with_state):
    """No tokens at all: FlashQLA is not called, final = initial (zeros without one, N rows either way),
    d initial = d final (zeros without a final-state gradient)."""
    calls = []
    _fake_flash_qla(monkeypatch, calls)
    xs, h0, cut = _inputs(cu, with_state, seed=11)
    N = len(cu) - 1
    o, s = flash_qla_backend.chunk_fwd(*xs, initial_state=h0, output_final_state=True, cu=cut.int())
    assert o.shape == xs[2].shape and s is not None and s.shape == (N, 4, 128, 128) and s.dtype == torch.float32
    torch.testing.assert_close(s, torch.zeros_like(s) if h0 is None else h0, rtol=0, atol=0)
    assert flash_qla_backend.chunk_fwd(*xs, initial_state=h0, output_final_state=False, cu=cut)[1] is None
    dfinal = torch.randn(N, 4, 128, 128, generator=torch.Generator().manual_seed(3))
    for dfin in (dfinal, None):
        grads = flash_qla_backend.chunk_bwd(torch.zeros_like(xs[2]), dfin, *xs, initial_state=h0, cu=cut)
        assert all(gr.shape == x.shape and gr.numel() == 0 for gr, x in zip(grads[:5], xs))
        if h0 is None:
            assert grads[5] is None
        else:
            torch.testing.assert_close(grads[5], torch.zeros_like(h0) if dfin is None else dfin, rtol=0, atol=0)
    assert calls == []


@pytest.mark.parametrize("with_state", [True, False])
def test_a_dense_batch_without_tokens_does_not_reach_flash_qla(monkeypatch, with_state):
    """Dense ``[B, 0]`` (the op hands a token-less dense call on as it is, not as a pack) is B empty
    sequences, the case FlashQLA returned NaN for inside a pack: it is not called, the states pass."""
    calls = []
    _fake_flash_qla(monkeypatch, calls)
    xs, h0, _ = _inputs([0, 0, 0, 0], with_state, seed=5)
    xs = tuple(x.expand(3, *x.shape[1:]) for x in xs)          # B = 3 rows of T = 0
    o, s = flash_qla_backend.chunk_fwd(*xs, initial_state=h0, output_final_state=True, cu=None)
    assert o.shape == xs[2].shape and s.shape == (3, 4, 128, 128)
    torch.testing.assert_close(s, torch.zeros_like(s) if h0 is None else h0, rtol=0, atol=0)
    dfinal = torch.randn(3, 4, 128, 128, generator=torch.Generator().manual_seed(2))
    grads = flash_qla_backend.chunk_bwd(torch.zeros_like(xs[2]), dfinal, *xs, initial_state=h0, cu=None)
    assert all(gr.shape == x.shape for gr, x in zip(grads[:5], xs))
    assert grads[5] is None if h0 is None else torch.equal(grads[5], dfinal)
    assert calls == []


@pytest.mark.parametrize("cu", [[0, 100, 100, 257, 700], [0, 65, 130]])
def test_the_backward_takes_the_forwards_gate_cumsum_and_A(monkeypatch, cu):
    """``residuals=True``: the forward returns FlashQLA's chunk-local gate cumsum and UT matrices A, and the
    backward given them runs FlashQLA's backward on them (no ``kkt_solve``); given None it recomputes both.
    The gradients are the same either way (FlashQLA's recompute is the forward's computation)."""
    chunk = _fake_flash_qla(monkeypatch, [])
    xs, h0, cut = _inputs(cu, True, seed=3)
    o, s, res = flash_qla_backend.chunk_fwd(*xs, initial_state=h0, output_final_state=True, cu=cut, residuals=True)
    assert len(res) == 2 and res[1] is chunk.made_A[-1] and len(chunk.made_A) == 1
    o2, s2 = flash_qla_backend.chunk_fwd(*xs, initial_state=h0, output_final_state=True, cu=cut)
    assert torch.equal(o, o2) and torch.equal(s, s2)
    gen = torch.Generator().manual_seed(9)
    do, dfinal = torch.randn(o.shape, generator=gen).bfloat16(), torch.randn(s.shape, generator=gen)
    kept = flash_qla_backend.chunk_bwd(do, dfinal, *xs, initial_state=h0, cu=cut, residuals=res)
    assert chunk.seen_A[-1] is res[1] and len(chunk.made_A) == 2          # no kkt_solve
    again = flash_qla_backend.chunk_bwd(do, dfinal, *xs, initial_state=h0, cu=cut)
    assert chunk.seen_A[-1] is chunk.made_A[-1] and float(chunk.made_A[-1].flatten()[0]) == -1.0   # recomputed
    for a, b in zip(kept, again):
        assert torch.equal(a, b)


def test_no_residuals_where_flash_qla_does_not_run(monkeypatch):
    """fla's kernels (here: fp32 inputs) and a pack without tokens return ``()``: the backward recomputes."""
    _fake_flash_qla(monkeypatch, [])
    xs, h0, cut = _inputs([0, 0, 0], False, seed=2)
    assert flash_qla_backend.chunk_fwd(*xs, initial_state=h0, cu=cut, residuals=True)[2] == ()
    calls = []
    monkeypatch.setattr(flash_qla_backend.fla_backend, "chunk_fwd", lambda *a: calls.append(a) or ("o", None))
    xs, h0, cut = _inputs([0, 5, 9], False, seed=2)
    out = flash_qla_backend.chunk_fwd(*(x.float() for x in xs), initial_state=h0, cu=cut, residuals=True)
    assert out == ("o", None, ()) and len(calls) == 1
