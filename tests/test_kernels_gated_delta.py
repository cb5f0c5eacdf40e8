"""The torch reference kernels against float64 token-by-token oracles."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from gdn_layer.kernels import chunk_gated_delta_rule, recurrent_gated_delta_rule
from oracle import naive_gated_delta_rule


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_inputs(T, Hk=2, Hv=4, Dk=16, Dv=8, B=1, dtype=torch.float32, g_scale=0.1, seed=None, grad=False):
    gen = torch.Generator().manual_seed(seed if seed is not None else torch.randint(0, 2**31, ()).item())
    q = torch.randn(B, T, Hk, Dk, generator=gen, dtype=dtype)
    k = torch.randn(B, T, Hk, Dk, generator=gen, dtype=dtype)
    v = torch.randn(B, T, Hv, Dv, generator=gen, dtype=dtype)
    g = -torch.rand(B, T, Hv, generator=gen, dtype=torch.float32) * g_scale
    beta = torch.rand(B, T, Hv, generator=gen, dtype=dtype)
    xs = [q, k, v, g, beta]
    if grad:
        for x in xs:
            x.requires_grad_(True)
    return xs


def grads(fn, inputs, h0):
    """Forward with a fixed random cotangent on (o, final state); returns (o, final, grads of inputs + h0)."""
    o, s = fn(*inputs, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    gen = torch.Generator().manual_seed(7)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum() + \
           (s.double() * torch.randn(s.shape, generator=gen, dtype=torch.float64)).sum()
    return o, s, torch.autograd.grad(loss, [*inputs, h0])


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 127, 129])
def test_chunk_fp32_matches_float64_recurrence_outputs_state_and_grads(T):
    x32 = make_inputs(T, grad=True)
    h32 = torch.randn(1, 4, 16, 8, requires_grad=True)
    x64 = [t.detach().double().requires_grad_(True) for t in x32]
    h64 = h32.detach().double().requires_grad_(True)
    o, s, g32 = grads(chunk_gated_delta_rule, x32, h32)
    o_ref, s_ref, g64 = grads(recurrent_gated_delta_rule, x64, h64)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(s, s_ref) <= 1e-5
    for name, a, b in zip(["q", "k", "v", "g", "beta", "initial_state"], g32, g64):
        assert rel_err(a, b) <= 1e-5, name


def test_float64_recurrence_matches_literal_oracle():
    q, k, v, g, beta = make_inputs(37, Hk=2, Hv=6, B=2, dtype=torch.float64)
    h0 = torch.randn(2, 6, 16, 8, dtype=torch.float64)
    o, s = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    assert rel_err(o, o_ref) < 1e-12 and rel_err(s, s_ref) < 1e-12
    o2, s2 = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    assert rel_err(o2, o_ref) < 1e-12 and rel_err(s2, s_ref) < 1e-12


def test_custom_scale_and_no_l2norm_follow_the_oracle():
    q, k, v, g, beta = make_inputs(70, dtype=torch.float64)
    k = k * 0.2  # keep the un-normalised delta rule stable
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3)
    o_ref, _ = naive_gated_delta_rule(q, k, v, g, beta, scale=0.3)
    assert rel_err(o, o_ref) < 1e-12


def test_packed_equals_each_sequence_alone():
    lens = [37, 64, 1, 90]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v, g, beta = make_inputs(sum(lens))
    h0 = torch.randn(len(lens), 4, 16, 8)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  cu_seqlens=cu, use_qk_l2norm=True)
    for n in range(len(lens)):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        o_n, s_n = chunk_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                          initial_state=h0[n:n + 1], output_final_state=True, use_qk_l2norm=True)
        assert rel_err(o[:, sl], o_n) <= 1e-6
        assert rel_err(s[n:n + 1], s_n) <= 1e-6


def test_batch_equals_packed():
    q, k, v, g, beta = make_inputs(50, B=3)
    o_b, s_b = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    flat = [x.reshape(1, 150, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o_p, s_p = chunk_gated_delta_rule(*flat, output_final_state=True, cu_seqlens=torch.tensor([0, 50, 100, 150]))
    assert rel_err(o_b.reshape(o_p.shape), o_p) <= 1e-6 and rel_err(s_b, s_p) <= 1e-6


def test_grouped_heads_equal_explicit_repeat_interleave():
    q, k, v, g, beta = make_inputs(80, Hk=2, Hv=6)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
    rep = [x.repeat_interleave(3, dim=2) for x in (q, k)]
    o_ref, s_ref = chunk_gated_delta_rule(*rep, v, g, beta, output_final_state=True, use_qk_l2norm=True)
    assert rel_err(o, o_ref) <= 1e-6 and rel_err(s, s_ref) <= 1e-6
    # and grouping is j // r, not j % Hk
    wrong = [x[:, :, [0, 1, 0, 1, 0, 1]] for x in (q, k)]
    o_wrong, _ = chunk_gated_delta_rule(*wrong, v, g, beta, use_qk_l2norm=True)
    assert rel_err(o, o_wrong) > 1e-2


@pytest.mark.parametrize("cu", [[0, 10, 10, 16], [0, 0, 16], [0, 16, 16]])
@pytest.mark.parametrize("kernel", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_empty_segments(cu, kernel):
    q, k, v, g, beta = make_inputs(16)
    h0 = torch.randn(len(cu) - 1, 4, 16, 8)
    o, s = kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=torch.tensor(cu),
                  use_qk_l2norm=True)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, use_qk_l2norm=True)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
    for n in range(len(cu) - 1):
        if cu[n] == cu[n + 1]:  # an empty sequence hands its initial state straight through
            assert torch.equal(s[n], h0[n])


@pytest.mark.parametrize("kernel", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_zero_length_input(kernel):
    q, k, v, g, beta = make_inputs(0, B=2)
    h0 = torch.randn(2, 4, 16, 8)
    o, s = kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert o.shape == (2, 0, 4, 8) and torch.equal(s, h0)
    q, k, v, g, beta = make_inputs(0)
    o, s = kernel(q, k, v, g, beta, output_final_state=True, cu_seqlens=torch.tensor([0, 0]))
    assert o.shape == (1, 0, 4, 8) and s.shape == (1, 4, 16, 8) and not s.any()


def test_g_zero_is_the_ungated_delta_rule():
    q, k, v, _, beta = make_inputs(100)
    g = torch.zeros(1, 100, 4)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, use_qk_l2norm=True)
    # ungated delta rule, written out separately: S += beta k (v - S^T k)^T
    qn = torch.nn.functional.normalize(q.double(), dim=-1, eps=0) * (16 ** -0.5)
    kn = torch.nn.functional.normalize(k.double(), dim=-1, eps=0)
    S = torch.zeros(4, 16, 8, dtype=torch.float64)
    outs = []
    for t in range(100):
        kt = kn[0, t].repeat_interleave(2, 0)
        S = S + beta[0, t, :, None, None].double() * kt[:, :, None] * (v[0, t].double() - torch.einsum("hkv,hk->hv", S, kt))[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, qn[0, t].repeat_interleave(2, 0)))
    assert rel_err(o[0], torch.stack(outs)) <= 1e-5
    assert rel_err(s[0], S) <= 1e-5


@pytest.mark.parametrize("kernel", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_g_minus_inf_is_a_reset(kernel):
    q, k, v, g, beta = make_inputs(90, g_scale=0.01)
    h0 = torch.randn(1, 4, 16, 8)
    g[0, 70, 1] = -float("inf")
    o, s = kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
    # from the reset on, head 1 behaves as if it started at token 70 from a zero state
    sl = slice(70, 90)
    o_tail, _ = kernel(*(x[:, sl] for x in (q, k, v, g, beta)), use_qk_l2norm=True)
    assert rel_err(o[:, sl, 1], o_tail[:, :, 1]) <= 1e-5
    assert rel_err(o[:, sl, 0], o_tail[:, :, 0]) > 1e-3  # head 0 was not reset: its history shows
    # gradients stay finite through a reset
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, beta)]
    o, s = kernel(xs[0], xs[1], xs[2], g, xs[3], initial_state=h0, output_final_state=True, use_qk_l2norm=True)
    gr = torch.autograd.grad(o.sum() + s.sum(), xs)
    assert all(torch.isfinite(x).all() for x in gr)


def test_very_negative_g_stays_finite():
    q, k, v, _, beta = make_inputs(130)
    g = torch.full((1, 130, 4), float(torch.log(torch.tensor(1e-12))))
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, beta)]
    o, s = chunk_gated_delta_rule(xs[0], xs[1], xs[2], g, xs[3], output_final_state=True, use_qk_l2norm=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    o_ref, _ = naive_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    assert rel_err(o, o_ref) <= 1e-5
    assert all(torch.isfinite(x).all() for x in torch.autograd.grad(o.sum(), xs))


def test_int32_and_int64_cu_seqlens_identical():
    q, k, v, g, beta = make_inputs(100)
    cu = [0, 30, 31, 100]
    a = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    b = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=torch.tensor(cu, dtype=torch.int64))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("cu, match", [
    (torch.tensor([0, 10, 5, 16]), "non-decreasing"),
    (torch.tensor([1, 10, 16]), "start at 0"),
    (torch.tensor([0, 10, 15]), "must equal the packed length"),
    (torch.tensor([0.0, 10.0, 16.0]), "dtype"),
    (torch.tensor([[0, 10, 16]]), "1-D"),
])
@pytest.mark.parametrize("kernel", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_malformed_cu_seqlens_raise_value_error_naming_it(cu, match, kernel):
    q, k, v, g, beta = make_inputs(16)
    with pytest.raises(ValueError, match=f"cu_seqlens.*{match}|{match}.*cu_seqlens"):
        kernel(q, k, v, g, beta, cu_seqlens=cu)


@pytest.mark.parametrize("mutate, exc, match", [
    (lambda x: x.update(g=x["g"].abs() + 0.1), ValueError, "g .*<= 0"),
    (lambda x: x["v"].__setitem__((0, 3, 0, 0), float("nan")), ValueError, "v contains NaN"),
    (lambda x: x.update(k=x["k"][:, :, :1].expand(-1, -1, 2, -1)[..., :8]), ValueError, "same shape"),
    (lambda x: x.update(v=x["v"][:, :, :3]), ValueError, "multiple of num_k_heads"),
    (lambda x: x.update(beta=x["beta"][..., :2]), ValueError, "beta must be"),
    (lambda x: x.update(initial_state=torch.zeros(2, 4, 16, 8)), ValueError, "initial_state must be"),
    (lambda x: x.update(initial_state=torch.zeros(1, 4, 16, 8, dtype=torch.int32)), TypeError,
     "initial_state must be a floating-point"),
    (lambda x: x.update(v=x["v"].to(torch.complex64)), TypeError, "v must be a floating-point"),
    (lambda x: x.update(q=x["q"][0]), ValueError, "4-D"),
    (lambda x: x.update(backend="nope"), ValueError, "backend"),
    (lambda x: x.update(scale="a"), TypeError, "scale"),
    (lambda x: x.update(use_qk_l2norm="no"), TypeError, "use_qk_l2norm must be a bool"),
    (lambda x: x.update(q=x["q"][..., :0], k=x["k"][..., :0]), ValueError, "head dims must be positive"),
])
def test_bad_inputs_raise_naming_the_argument(mutate, exc, match):
    q, k, v, g, beta = make_inputs(20)
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    mutate(args)
    with pytest.raises(exc, match=match):
        chunk_gated_delta_rule(**args)


def test_cu_seqlens_with_batch_above_one_raises():
    q, k, v, g, beta = make_inputs(16, B=2)
    with pytest.raises(ValueError, match="B == 1"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 16]))


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(0, 80), min_size=1, max_size=4), hk=st.sampled_from([1, 2]),
       r=st.sampled_from([1, 2, 3]), dk=st.sampled_from([4, 8]), dv=st.sampled_from([4, 6]),
       seed=st.integers(0, 2**31 - 1))
def test_random_shapes_chunk_matches_literal_oracle(lens, hk, r, dk, dv, seed):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = make_inputs(cu[-1], Hk=hk, Hv=hk * r, Dk=dk, Dv=dv, seed=seed)
    h0 = torch.randn(len(lens), hk * r, dk, dv, generator=torch.Generator().manual_seed(seed))
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  cu_seqlens=torch.tensor(cu), use_qk_l2norm=True)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, use_qk_l2norm=True)
    if cu[-1]:
        assert rel_err(o, o_ref) <= 1e-5
    assert rel_err(s, s_ref) <= 1e-5


@pytest.mark.parametrize("big", [1e4, 1e10, 3e38])
def test_small_decays_next_to_a_huge_one_keep_fp32_precision(big):
    # every 8th token decays by exp(-big), the others slowly: a difference of fp32 cumulative sums
    # would lose the slow ones (and overflow to inf - inf at 3e38)
    q, k, v, g, beta = make_inputs(128, g_scale=0.05)
    g[:, ::8] = -big
    xs = [x.clone().requires_grad_(True) for x in (q, k, v, beta)]
    o, s = chunk_gated_delta_rule(xs[0], xs[1], xs[2], g, xs[3], output_final_state=True, use_qk_l2norm=True)
    o_ref, s_ref = naive_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5
    x64 = [x.detach().double().requires_grad_(True) for x in (q, k, v, beta)]
    o64, _ = recurrent_gated_delta_rule(x64[0], x64[1], x64[2], g.double(), x64[3], use_qk_l2norm=True)
    cot = torch.randn(o.shape, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad((o * cot).sum(), xs), torch.autograd.grad((o64 * cot).sum(), x64)):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("custom_bwd", [True, False])
@pytest.mark.parametrize("kernel", ["chunk", "recurrent"])
def test_dense_batch_runs_packed_on_dense_as_packed_backends(kernel, custom_bwd):
    """A backend with ``dense_as_packed`` (the compiled CUDA ones) gets a dense [B, T] call as one pack of
    B sequences (one kernel variant to compile); outputs, final states and gradients equal the dense call,
    with the backend's own backward and with the vjp of its forward."""
    import dataclasses

    from gdn_layer.kernels import register_backend, registry, resolve_backend
    from gdn_layer.kernels.ops_library import _vjp
    torch_b = resolve_backend("torch", "cpu")
    seen = []

    def fwd(q, k, v, g, beta, cu=None, **kw):
        seen.append((tuple(q.shape), None if cu is None else cu.tolist()))
        return getattr(torch_b, f"{kernel}_gated_delta_rule")(q, k, v, g, beta, cu=cu, **kw)

    def bwd(do, dfinal, q, k, v, g, beta, scale=None, initial_state=None, cu=None, use_qk_l2norm=False):
        seen.append((tuple(q.shape), None if cu is None else cu.tolist()))
        out_state = dfinal is not None

        def f(q, k, v, g, beta, h0):
            o, fin = getattr(torch_b, f"{kernel}_gated_delta_rule")(
                q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=out_state, cu=cu,
                use_qk_l2norm=use_qk_l2norm)
            return (o, fin) if out_state else (o,)
        return _vjp(f, (q, k, v, g, beta, initial_state), (do, dfinal)[:1 + out_state])

    register_backend(dataclasses.replace(torch_b, name="packed_only", priority=-5, dense_as_packed=True,
                                         **{f"{kernel}_gated_delta_rule": fwd,
                                            f"{kernel}_gated_delta_rule_bwd": bwd if custom_bwd else None}))
    try:
        op = chunk_gated_delta_rule if kernel == "chunk" else recurrent_gated_delta_rule
        B, T = 3, (1 if kernel == "recurrent" else 70)
        xs = make_inputs(T, B=B, seed=5, grad=True)
        h0 = torch.randn(B, 4, 16, 8, requires_grad=True)
        want = grads(lambda *a, **kw: op(*a, backend="torch", **kw), xs, h0)
        got = grads(lambda *a, **kw: op(*a, backend="packed_only", **kw), xs, h0)
    finally:
        registry._BACKENDS.pop("packed_only", None)
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    for a, b in zip([got[0], got[1], *got[2]], [want[0], want[1], *want[2]]):
        assert rel_err(a, b) <= 1e-6
    assert seen and all(shape[:2] == (1, B * T) and cu == [i * T for i in range(B + 1)] for shape, cu in seen)
