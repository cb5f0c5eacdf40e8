"""Our Triton gate and gated-RMSNorm kernels (forward and backward) against the torch reference.

On CPU they run under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before any
import). The oracle is ``kernels/reference.py`` in float64 for fp32 inputs (so the fp32 kernels are
held to fp32 accuracy, not to the reference's own fp32 rounding), and in the input dtype for bf16.
"""
import pathlib
import subprocess
import sys

import pytest
import torch

from gdn_layer.kernels import reference
from gdn_layer.kernels.triton import gate, norm
from launch_spy import LaunchSpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = pathlib.Path(__file__).resolve().parents[1]


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def grads(outputs, inputs, upstream, retain_graph=False):
    return torch.autograd.grad(sum((o.double() * u.double()).sum() for o, u in zip(outputs, upstream)), inputs,
                               retain_graph=retain_graph)


# ------------------------------------------------------------------------------------------------
# gate

def gate_inputs(B, T, H, dtype=torch.float32, param_dtype=torch.float32, scale=3.0):
    """a and b as views of one wider receive-like buffer (extra tokens and channels around them, NaN there)."""
    W = 2 * H + 5
    buf = torch.full((B, T + 3, W), float("nan"), dtype=dtype, device=DEVICE)
    buf[:, 2:T + 2, 1:1 + H] = (torch.randn(B, T, H, device=DEVICE) * scale).to(dtype)
    buf[:, 1:T + 1, H + 3:2 * H + 3] = (torch.randn(B, T, H, device=DEVICE) * scale).to(dtype)
    buf.requires_grad_()
    a, b = buf[:, 2:T + 2, 1:1 + H], buf[:, 1:T + 1, H + 3:2 * H + 3]
    A_log = torch.randn(H, device=DEVICE).to(param_dtype).requires_grad_()
    dt_bias = torch.randn(H, device=DEVICE).to(param_dtype).requires_grad_()
    return buf, a, b, A_log, dt_bias


def check_gate(B, T, H, dtype=torch.float32, param_dtype=torch.float32, tol=1e-5):
    buf, a, b, A_log, dt_bias = gate_inputs(B, T, H, dtype, param_dtype)
    assert B * T == 1 or not (a.is_contiguous() or b.is_contiguous())
    g, beta = gate.gdn_gate(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype and g.shape == beta.shape == (B, T, H)
    if dtype == torch.float32 and param_dtype == torch.float32:
        ref_in = [x.double() for x in (a, b, A_log, dt_bias)]    # fp64 truth
    else:
        ref_in = [a, b, A_log, dt_bias]                          # same roundings as the kernel
    g_ref, beta_ref = reference.gdn_gate(*ref_in)
    up = [torch.randn(B, T, H, device=DEVICE), torch.randn(B, T, H, device=DEVICE).to(dtype)]
    leaves = (buf, A_log, dt_bias)
    got, want = grads((g, beta), leaves, up), grads((g_ref, beta_ref), leaves, up, retain_graph=True)
    # dA_log and ddt_bias are sums over tokens of terms of one sign each (dg/dA_log = g <= 0, dg/ddt_bias =
    # -exp(A_log) sigmoid(a + dt_bias) <= 0) times the upstream gradient: with |upstream| the same sums give
    # the sums of the terms' magnitudes, the scale an fp32 sum's error is relative to (the signed sum can
    # cancel to almost nothing)
    magnitude = grads((g_ref, beta_ref), leaves, [u.abs() for u in up])
    assert rel_err(g, g_ref) <= tol and rel_err(beta, beta_ref) <= tol
    for name, x, y, m in zip(("d(a, b)", "dA_log", "ddt_bias"), got, want, magnitude):
        assert torch.isfinite(x).all(), name
        err = rel_err(x, y) if name == "d(a, b)" else float((x.double() - y.double()).norm() / m.double().norm())
        assert err <= tol, (name, err)


@pytest.mark.parametrize("H", [1, 3, 8])
@pytest.mark.parametrize("B,T", [(1, 1), (2, 1), (1, 3), (3, 21), (2, 32), (5, 13)])   # 1, 2, 3, 63, 64, 65 rows
def test_gate_matches_fp64_reference_on_strided_views(B, T, H):
    check_gate(B, T, H)


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_gate_bf16_matches_reference(param_dtype):
    check_gate(3, 21, 8, dtype=torch.bfloat16, param_dtype=param_dtype, tol=3e-3)   # a bf16 ulp is 3.9e-3


def test_gate_bf16_beta_grad_uses_the_rounded_beta_like_torch():
    # near saturation 1 - beta is a few bf16 ulps: torch's sigmoid backward reads the bf16 output,
    # so using the unrounded fp32 sigmoid would change db by up to 100% per element
    b = torch.linspace(3.0, 7.0, 64, device=DEVICE).to(torch.bfloat16).reshape(1, 64, 1).requires_grad_()
    A_log, dt_bias = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    dbeta = torch.randn(1, 64, 1, device=DEVICE).to(torch.bfloat16)
    db = gate.gdn_gate_bwd(None, dbeta, b.detach(), b.detach(), A_log, dt_bias)[1]
    (db_ref,) = torch.autograd.grad(reference.gdn_gate(b, b, A_log, dt_bias)[1], b, dbeta)
    torch.testing.assert_close(db, db_ref, rtol=1e-2, atol=0)


def test_gate_float64_computes_in_float64():
    buf, a, b, A_log, dt_bias = gate_inputs(2, 9, 3, dtype=torch.float64, param_dtype=torch.float64)
    g, beta = gate.gdn_gate(a, b, A_log, dt_bias)
    g_ref, beta_ref = reference.gdn_gate(a, b, A_log, dt_bias)
    assert g.dtype == torch.float64 and rel_err(g, g_ref) <= 1e-13 and rel_err(beta, beta_ref) <= 1e-13


def test_gate_reads_views_in_place(monkeypatch):
    spy = LaunchSpy(gate._gate_fwd_kernel)
    monkeypatch.setattr(gate, "_gate_fwd_kernel", spy)
    _, a, b, A_log, dt_bias = gate_inputs(2, 7, 3)
    gate.gdn_gate_fwd(a, b, A_log, dt_bias)
    (args,) = spy.launches
    assert args[0] is a and args[1] is b


def test_softplus_is_accurate_at_both_tails():
    # beyond +20 softplus is x (torch's threshold); far below 0 it is exp(x), which log(1 + exp(x))
    # in fp32 would round to 0 from x < -17 on
    x = torch.tensor([-80.0, -40.0, -25.0, -17.0, -5.0, -1e-3, 0.0, 1e-3, 5.0, 19.9, 20.0, 20.1, 40.0, 1e4],
                     device=DEVICE)
    a = x.reshape(1, -1, 1)
    A_log, dt_bias = torch.zeros(1, device=DEVICE), torch.zeros(1, device=DEVICE)
    g, _ = gate.gdn_gate_fwd(a, a, A_log, dt_bias)
    g_ref, _ = reference.gdn_gate(a.double(), a.double(), A_log.double(), dt_bias.double())
    torch.testing.assert_close(g.double(), g_ref, rtol=2e-6, atol=0)
    dg = torch.ones_like(g)
    da = gate.gdn_gate_bwd(dg, None, a, a, A_log, dt_bias)[0]
    a64 = a.double().requires_grad_()
    (da_ref,) = torch.autograd.grad(reference.gdn_gate(a64, a64, A_log.double(), dt_bias.double())[0].sum(), a64)
    torch.testing.assert_close(da.double(), da_ref, rtol=2e-6, atol=0)


def test_gate_backward_with_one_grad_missing():
    _, a, b, A_log, dt_bias = gate_inputs(2, 5, 3)
    dg, dbeta = torch.randn(2, 5, 3, device=DEVICE), torch.randn(2, 5, 3, device=DEVICE)
    full = gate.gdn_gate_bwd(dg, dbeta, a, b, A_log, dt_bias)
    no_beta = gate.gdn_gate_bwd(dg, None, a, b, A_log, dt_bias)
    no_g = gate.gdn_gate_bwd(None, dbeta, a, b, A_log, dt_bias)
    for x, y in zip(no_beta, full[:1] + (torch.zeros_like(full[1]),) + full[2:]):
        assert torch.equal(x, y)
    for x, y in zip(no_g, (torch.zeros_like(full[0]), full[1], torch.zeros(3), torch.zeros(3))):
        assert torch.equal(x, y.to(DEVICE))
    # through autograd: only g used, so beta's grad arrives as None
    a2, A2 = a.detach().requires_grad_(), A_log.detach().requires_grad_()
    (g, _), (g_ref, _) = gate.gdn_gate(a2, b, A2, dt_bias), reference.gdn_gate(a2, b, A2, dt_bias)
    assert all(rel_err(x, y) <= 1e-5 for x, y in zip(grads([g], (a2, A2), [dg]), grads([g_ref], (a2, A2), [dg])))


def test_gate_many_tiles_per_program_sum_every_row_deterministically(monkeypatch):
    monkeypatch.setattr(gate, "_TILE", 16)          # BLOCK_T = 4 rows for H = 3
    monkeypatch.setattr(gate, "_MAX_PROGRAMS", 3)   # 17 tiles over 3 programs: each loops
    check_gate(5, 13, 3)
    _, a, b, A_log, dt_bias = gate_inputs(5, 13, 3)
    dg, dbeta = torch.randn(5, 13, 3, device=DEVICE), torch.randn(5, 13, 3, device=DEVICE)
    first = gate.gdn_gate_bwd(dg, dbeta, a, b, A_log, dt_bias)
    again = gate.gdn_gate_bwd(dg, dbeta, a, b, A_log, dt_bias)
    assert all(torch.equal(x, y) for x, y in zip(first, again))


def test_gate_expanded_upstream_grad_and_empty_input():
    _, a, b, A_log, dt_bias = gate_inputs(2, 4, 3)
    dg = torch.randn(3, device=DEVICE).expand(2, 4, 3)                      # row strides 0
    dbeta = torch.randn(1, device=DEVICE).expand(2, 4, 3)                   # stride(-1) == 0
    got = gate.gdn_gate_bwd(dg, dbeta, a, b, A_log, dt_bias)
    want = gate.gdn_gate_bwd(dg.contiguous(), dbeta.contiguous(), a, b, A_log, dt_bias)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    e = torch.empty(2, 0, 3, device=DEVICE)
    g, beta = gate.gdn_gate_fwd(e, e, A_log, dt_bias)
    assert g.shape == beta.shape == (2, 0, 3)
    da, db, dA, dbias = gate.gdn_gate_bwd(g, beta, e, e, A_log, dt_bias)
    assert da.shape == (2, 0, 3) and torch.equal(dA, torch.zeros_like(dA)) and torch.equal(dbias, torch.zeros_like(dbias))


# ------------------------------------------------------------------------------------------------
# gated RMSNorm

def norm_inputs(lead, D, dtype=torch.float32, w_dtype=None, gap=3):
    """x and z as views of one wider buffer ``[*lead, 2D + gap]`` (NaN in the gap), weight near 1."""
    buf = torch.full((*lead, 2 * D + gap), float("nan"), dtype=dtype, device=DEVICE)
    buf[..., :D] = torch.randn(*lead, D, device=DEVICE).to(dtype)
    buf[..., D + gap:] = (torch.randn(*lead, D, device=DEVICE) * 2).to(dtype)
    buf.requires_grad_()
    w = (1 + 0.3 * torch.randn(D, device=DEVICE)).to(w_dtype or dtype).requires_grad_()
    return buf, buf[..., :D], buf[..., D + gap:], w


def check_norm(x, z, w, leaves, eps=1e-6, tol=1e-5):
    y = norm.gated_rms_norm(x, z, w, eps)
    ref_in = [t.double() for t in (x, z, w)] if x.dtype == torch.float32 else [x, z, w]
    y_ref = reference.gated_rms_norm(*ref_in, eps=eps)
    assert y.dtype == x.dtype and y.shape == x.shape and rel_err(y, y_ref) <= tol
    up = [torch.randn(y.shape, device=DEVICE).to(x.dtype)]
    for name, p, q in zip(("d(x, z)", "dweight"), grads([y], leaves, up), grads([y_ref], leaves, up)):
        assert torch.isfinite(p).all(), name
        assert rel_err(p, q) <= tol, (name, rel_err(p, q))


@pytest.mark.parametrize("D", [16, 24, 128])
@pytest.mark.parametrize("M", [1, 2, 3, 63, 64, 65])
def test_norm_matches_fp64_reference_on_strided_rows(M, D):
    buf, x, z, w = norm_inputs((M,), D)
    check_norm(x, z, w, (buf, w))


def test_norm_leading_dims_flattened_by_view_read_in_place(monkeypatch):
    spy = LaunchSpy(norm._norm_fwd_kernel)
    monkeypatch.setattr(norm, "_norm_fwd_kernel", spy)
    buf, x, z, w = norm_inputs((2, 5, 3), 24)          # [B, T, H, Dv] rows of a wider buffer
    check_norm(x, z, w, (buf, w))
    args = spy.launches[0]
    assert args[0].data_ptr() == x.data_ptr() and args[0].stride() == (2 * 24 + 3, 1)
    assert args[1].data_ptr() == z.data_ptr()


def test_norm_leading_dims_that_need_a_copy():
    buf, x, z, w = norm_inputs((3, 6), 24)
    x, z = x[:, :5], z[:, 1:]                           # rows no single stride can walk
    check_norm(x, z, w, (buf, w))


@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
def test_norm_bf16_matches_reference(w_dtype):
    buf, x, z, w = norm_inputs((65,), 24, dtype=torch.bfloat16, w_dtype=w_dtype)
    check_norm(x, z, w, (buf, w), tol=3e-3)   # a bf16 ulp is 3.9e-3


def test_norm_float64_and_wide_non_power_of_two_rows():
    buf, x, z, w = norm_inputs((3,), 40, dtype=torch.float64)
    y = norm.gated_rms_norm(x, z, w)
    assert rel_err(y, reference.gated_rms_norm(x, z, w)) <= 1e-13
    buf, x, z, w = norm_inputs((5,), 1000)
    check_norm(x, z, w, (buf, w), eps=1e-5)


def test_norm_backward_recomputes_rstd_when_not_saved():
    _, x, z, w = norm_inputs((7,), 24)
    x, z, w = x.detach(), z.detach(), w.detach()
    y, rstd = norm.gated_rms_norm_fwd(x, z, w, 1e-6)
    assert rstd.shape == (7,) and rstd.dtype == torch.float32
    dy = torch.randn_like(y)
    saved, recomputed = norm.gated_rms_norm_bwd(dy, x, z, w, rstd, 1e-6), norm.gated_rms_norm_bwd(dy, x, z, w, None, 1e-6)
    assert all(rel_err(p, q) <= 1e-6 for p, q in zip(saved, recomputed))


@pytest.mark.parametrize("tiles", [(64, 64, None, None), (256, 64, 2, 8), (64, 512, 8, 2)])
def test_norm_many_tiles_per_program_sum_every_row_deterministically(monkeypatch, tiles):
    """The forward's and the backward's tiles and warps are set apart (_TILE / _NUM_WARPS and
    _TILE_BWD / _NUM_WARPS_BWD); BLOCK_M = 2 rows for D = 24 at 64 elements."""
    for name, value in zip(("_TILE", "_TILE_BWD", "_NUM_WARPS", "_NUM_WARPS_BWD"), tiles):
        monkeypatch.setattr(norm, name, value)
    monkeypatch.setattr(norm, "_MAX_PROGRAMS", 3)   # 33 tiles over 3 programs: each loops
    spies = {k: LaunchSpy(getattr(norm, k)) for k in ("_norm_fwd_kernel", "_norm_bwd_kernel")}
    for name, spy in spies.items():
        monkeypatch.setattr(norm, name, spy)
    buf, x, z, w = norm_inputs((65,), 24)
    check_norm(x, z, w, (buf, w))
    fwd, bwd = spies["_norm_fwd_kernel"].kwargs[0], spies["_norm_bwd_kernel"].kwargs[0]
    assert (fwd["BLOCK_M"], fwd["num_warps"]) == (tiles[0] // 32, tiles[2] or 4)   # each pass: its own knobs
    assert (bwd["BLOCK_M"], bwd["num_warps"]) == (tiles[1] // 32, tiles[3] or 4)
    x, z, w = x.detach(), z.detach(), w.detach()
    dy = torch.randn(65, 24, device=DEVICE)
    y, rstd = norm.gated_rms_norm_fwd(x, z, w, 1e-6)
    first, again = (norm.gated_rms_norm_bwd(dy, x, z, w, rstd, 1e-6) for _ in range(2))
    assert all(torch.equal(p, q) for p, q in zip(first, again))


def test_norm_expanded_upstream_grad_empty_input_and_too_wide_rows():
    _, x, z, w = norm_inputs((4, 3), 16)
    x, z, w = x.detach(), z.detach(), w.detach()
    y, rstd = norm.gated_rms_norm_fwd(x, z, w, 1e-6)
    dy = torch.randn(16, device=DEVICE).expand(4, 3, 16)                   # row strides 0
    got = norm.gated_rms_norm_bwd(dy, x, z, w, rstd, 1e-6)
    want = norm.gated_rms_norm_bwd(dy.contiguous(), x, z, w, rstd, 1e-6)
    assert all(torch.equal(p, q) for p, q in zip(got, want))
    e = torch.empty(0, 3, 16, device=DEVICE)
    y, rstd = norm.gated_rms_norm_fwd(e, e, w, 1e-6)
    assert y.shape == (0, 3, 16) and rstd.shape == (0, 3)
    dx, dz, dw = norm.gated_rms_norm_bwd(y, e, e, w, rstd, 1e-6)
    assert dx.shape == (0, 3, 16) and torch.equal(dw, torch.zeros_like(dw))
    wide = torch.randn(2, 1025, device=DEVICE)
    with pytest.raises(ValueError, match=r"D\) must be in \[1, 1024\]"):
        norm.gated_rms_norm_fwd(wide, wide, torch.ones(1025, device=DEVICE), 1e-6)


# ------------------------------------------------------------------------------------------------
# static check: nothing specialises on a length or a count

def _scan_tool():
    for base in (ROOT, ROOT.parent):
        path = base / "shared" / "tools" / "scan_triton.py"
        if path.exists():
            return path
    pytest.skip("shared/tools/scan_triton.py is not beside this checkout")


def test_triton_kernels_pass_the_no_specialisation_scan():
    out = subprocess.run([sys.executable, str(_scan_tool()), str(ROOT / "kernels" / "triton")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().endswith("violations: 0")


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_l2norm_pair_is_one_launch_per_pass_and_matches_float64(monkeypatch, dtype, tol):
    """q and k normalised (and their gradients taken) in one launch each (``PAIR``): q a head slice of a
    wider buffer, k a transposed-layout view, rows not a multiple of the block; against float64 autograd."""
    from gdn_layer.kernels.triton import l2norm
    g = torch.Generator().manual_seed(5)
    B, T, H, D = 2, 9, 3, 24
    buf = torch.randn(B, T, H * D + 7, generator=g)
    q = buf[..., 7:].unflatten(-1, (H, D)).to(DEVICE, dtype)
    k = torch.randn(B, H, T, D, generator=g).transpose(1, 2).to(DEVICE, dtype)    # [B, T, H, D], T stride D
    dq, dk = (torch.randn(B, T, H, D, generator=g).to(DEVICE, dtype) for _ in range(2))
    fwd, bwd = LaunchSpy(l2norm._l2norm_fwd_kernel), LaunchSpy(l2norm._l2norm_bwd_kernel)
    monkeypatch.setattr(l2norm, "_l2norm_fwd_kernel", fwd)
    monkeypatch.setattr(l2norm, "_l2norm_bwd_kernel", bwd)
    qn, kn = l2norm.l2norm_pair_fwd(q, k)
    gq, gk = l2norm.l2norm_pair_bwd(q, dq, k, dk)
    assert len(fwd.launches) == len(bwd.launches) == 1
    assert fwd.kwargs[0]["PAIR"] and bwd.kwargs[0]["PAIR"]
    for x, dy, y, dx in ((q, dq, qn, gq), (k, dk, kn, gk)):
        x64 = x.detach().double().cpu().requires_grad_()
        ref = x64 * torch.rsqrt(x64.square().sum(-1, keepdim=True) + l2norm.EPS)
        ref.backward(dy.double().cpu())
        assert y.dtype == dtype and y.is_contiguous() and dx.is_contiguous()
        assert rel_err(y.cpu(), ref) <= tol and rel_err(dx.cpu(), x64.grad) <= tol
    # the single-tensor path is the same kernel without PAIR, and agrees with the pair
    assert torch.equal(l2norm.l2norm_fwd(k), kn) and torch.equal(l2norm.l2norm_bwd(k, dk), gk)
    assert not fwd.kwargs[1]["PAIR"]


def test_the_cuda_backends_normalise_q_and_k_in_one_launch(monkeypatch):
    """fla's and FlashQLA's input preparation (``_prep``) take the pair kernel: one launch, ``PAIR``."""
    from gdn_layer.kernels import fla_backend, flash_qla_backend
    from gdn_layer.kernels.triton import l2norm
    spy = LaunchSpy(l2norm._l2norm_fwd_kernel)
    monkeypatch.setattr(l2norm, "_l2norm_fwd_kernel", spy)
    q, k, v = (torch.randn(1, 10, 2, 16, device=DEVICE) for _ in range(3))
    beta = torch.rand(1, 10, 2, device=DEVICE)
    qn, kn, _, _ = fla_backend._prep(q, k, v, beta, True)
    flash_qla_backend._prep(q, k, v, beta, beta, True)
    assert len(spy.launches) == 2 and all(kw["PAIR"] for kw in spy.kwargs)
    torch.testing.assert_close(kn, k * torch.rsqrt(k.square().sum(-1, keepdim=True) + l2norm.EPS))


def test_gate_with_no_heads_launches_nothing_and_returns_empty():
    """H = 0 (an empty head dim): empty outputs and gradients, not a division by zero in the block sizes."""
    a = torch.randn(1, 5, 0, device=DEVICE)
    A_log, dt_bias = torch.randn(0, device=DEVICE), torch.randn(0, device=DEVICE)
    g, beta = gate.gdn_gate_fwd(a, a, A_log, dt_bias)
    da, db, dA, ddt = gate.gdn_gate_bwd(g, beta, a, a, A_log, dt_bias)
    assert g.shape == beta.shape == da.shape == db.shape == (1, 5, 0) and dA.shape == ddt.shape == (0,)
