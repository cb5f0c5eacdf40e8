"""The GatedDeltaNet gate in Triton: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``.

Contract: ``kernels/reference.py::gdn_gate`` (Mamba2's discretisation as used by transformers'
Qwen3NextGatedDeltaNet). Shapes: ``a, b: [B, T, H]`` with ``stride(-1) == 1`` and any strides on
dims 0 and 1 (views into the all-to-all receive buffer are read in place); ``A_log, dt_bias: [H]``.
``g`` comes back contiguous in the compute dtype (fp32; float64 when ``a``, ``A_log`` or ``dt_bias``
is float64), ``beta`` contiguous in ``b``'s dtype (computed in fp32, or float64 for float64 ``b``).

Both kernels walk the ``N = B * T`` token rows in tiles of ``BLOCK_T`` rows by all ``H`` heads; the
grid is one axis (axis 0 takes up to 2^31 - 1 programs, axes 1 and 2 only 65 535). ``T``, ``N``, the
program count ``NB`` and every stride are runtime arguments (``do_not_specialize``): a new sequence
length or packing compiles nothing. Block sizes depend on ``H`` only; one fixed config, no autotune.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._grid import cdiv, next_power_of_2, programs
from ._layout import out_buffer, unit_last
from ._math import cast_rne, compute_tl_dtype, rne, sigmoid, softplus

# Elements per tile (BLOCK_T * BLOCK_H); read at call time so tests can shrink it to force many tiles.
_TILE = 2048
# Backward grid cap: bounds the [NB, H] partial-sum buffers; each program then loops over tiles.
_MAX_PROGRAMS = 1024
_NUM_WARPS = 4


def _blocks(H: int) -> tuple[int, int]:
    BLOCK_H = next_power_of_2(max(H, 1))
    return max(1, _TILE // BLOCK_H), BLOCK_H


# inlined into its callers, so do_not_specialize changes nothing here; it keeps the scan's rule uniform
@triton.jit(do_not_specialize=["T", "stride_b", "stride_t"])
def _row_offsets(rows, T, stride_b, stride_t):
    """int64 element offsets of token rows ``rows`` (flat ``b * T + t``) in a ``[B, T, H]`` view."""
    i_b = rows // T
    return i_b * stride_b + (rows - i_b * T) * stride_t


@triton.jit(do_not_specialize=["T", "N", "stride_ab", "stride_at", "stride_bb", "stride_bt"])
def _gate_fwd_kernel(a, b, A_log, dt_bias, g, beta, T, N, stride_ab, stride_at, stride_bb, stride_bt,
                     H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                     G_DTYPE: tl.constexpr, BETA_DTYPE: tl.constexpr):
    """Grid ``(min(cdiv(N, BLOCK_T), 65535),)``; program p writes g and beta of token-row tiles p, p + P,
    ... of ``BLOCK_T`` rows (P programs)."""
    heads = tl.arange(0, BLOCK_H)
    m_h = heads < H
    neg_A = -tl.exp(tl.load(A_log + heads, mask=m_h, other=0.0).to(G_DTYPE))
    bias = tl.load(dt_bias + heads, mask=m_h, other=0.0).to(G_DTYPE)
    for start in range(tl.program_id(0) * BLOCK_T, N, tl.num_programs(0) * BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T).to(tl.int64)
        mask = (rows < N)[:, None] & m_h[None, :]
        off_a = _row_offsets(rows, T, stride_ab, stride_at)[:, None] + heads[None, :]
        off_b = _row_offsets(rows, T, stride_bb, stride_bt)[:, None] + heads[None, :]
        off_o = rows[:, None] * H + heads[None, :]
        x = tl.load(a + off_a, mask=mask, other=0.0).to(G_DTYPE) + bias[None, :]
        tl.store(g + off_o, (neg_A[None, :] * softplus(x)).to(g.dtype.element_ty), mask=mask)
        bv = tl.load(b + off_b, mask=mask, other=0.0).to(BETA_DTYPE)
        tl.store(beta + off_o, cast_rne(sigmoid(bv), beta.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T", "N", "NB", "stride_ab", "stride_at", "stride_bb", "stride_bt",
                               "stride_dgb", "stride_dgt", "stride_dbb", "stride_dbt",
                               "stride_dab", "stride_dat", "stride_d_bb", "stride_d_bt"])
def _gate_bwd_kernel(dg, dbeta, a, b, A_log, dt_bias, da, db, dA_part, dbias_part, T, N, NB,
                     stride_ab, stride_at, stride_bb, stride_bt, stride_dgb, stride_dgt, stride_dbb, stride_dbt,
                     stride_dab, stride_dat, stride_d_bb, stride_d_bt,
                     H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                     G_DTYPE: tl.constexpr, BETA_DTYPE: tl.constexpr,
                     HAS_DG: tl.constexpr, HAS_DBETA: tl.constexpr):
    """Grid ``(NB,)``; program p takes tiles p, p + NB, p + 2 NB, ... of ``BLOCK_T`` token rows.

    Writes da, db (batch / token strides ``stride_da*``, ``stride_d_b*``) for its rows and one row ``p`` of
    each partial-sum buffer ``[NB, H]``:
    ``dA_part = -exp(A_log) * sum(dg * softplus(a + dt_bias))`` and ``dbias_part = sum(da)`` (the
    caller sums over p: a fixed order, so the result is deterministic). A missing dg (dbeta) gives
    zero da and partials (zero db).
    """
    pid = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    m_h = heads < H
    neg_A = -tl.exp(tl.load(A_log + heads, mask=m_h, other=0.0).to(G_DTYPE))
    bias = tl.load(dt_bias + heads, mask=m_h, other=0.0).to(G_DTYPE)
    acc_A = tl.zeros((BLOCK_T, BLOCK_H), dtype=G_DTYPE)
    acc_bias = tl.zeros((BLOCK_T, BLOCK_H), dtype=G_DTYPE)
    for start in range(pid * BLOCK_T, N, NB * BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T).to(tl.int64)
        mask = (rows < N)[:, None] & m_h[None, :]
        if HAS_DG:
            off_a = _row_offsets(rows, T, stride_ab, stride_at)[:, None] + heads[None, :]
            off_dg = _row_offsets(rows, T, stride_dgb, stride_dgt)[:, None] + heads[None, :]
            x = tl.load(a + off_a, mask=mask, other=0.0).to(G_DTYPE) + bias[None, :]
            dgv = tl.load(dg + off_dg, mask=mask, other=0.0).to(G_DTYPE)
            # softplus' = sigmoid below torch's threshold, exactly 1 above it (softplus(x) = x there)
            dx = dgv * neg_A[None, :] * tl.where(x > 20.0, 1.0, sigmoid(x))
            acc_A += dgv * softplus(x)
            acc_bias += dx
        else:
            dx = tl.zeros((BLOCK_T, BLOCK_H), dtype=G_DTYPE)
        off_da = _row_offsets(rows, T, stride_dab, stride_dat)[:, None] + heads[None, :]
        tl.store(da + off_da, cast_rne(dx, da.dtype.element_ty), mask=mask)
        if HAS_DBETA:
            off_b = _row_offsets(rows, T, stride_bb, stride_bt)[:, None] + heads[None, :]
            off_db = _row_offsets(rows, T, stride_dbb, stride_dbt)[:, None] + heads[None, :]
            # torch differentiates sigmoid through its output, rounded to b's dtype: do the same
            y = sigmoid(tl.load(b + off_b, mask=mask, other=0.0).to(BETA_DTYPE))
            y = rne(y, b.dtype.element_ty)
            dbv = tl.load(dbeta + off_db, mask=mask, other=0.0).to(BETA_DTYPE)
            dy = dbv * (1.0 - y) * y
        else:
            dy = tl.zeros((BLOCK_T, BLOCK_H), dtype=BETA_DTYPE)
        off_db_out = _row_offsets(rows, T, stride_d_bb, stride_d_bt)[:, None] + heads[None, :]
        tl.store(db + off_db_out, cast_rne(dy, db.dtype.element_ty), mask=mask)
    tl.store(dA_part + pid * H + heads, tl.sum(acc_A, 0) * neg_A, mask=m_h)
    tl.store(dbias_part + pid * H + heads, tl.sum(acc_bias, 0), mask=m_h)


def _dtypes(a, b, A_log, dt_bias):
    g_dt = compute_tl_dtype(a, A_log, dt_bias)
    return g_dt, (tl.float64 if b.dtype == torch.float64 else tl.float32)


def gdn_gate_fwd(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """``(g, beta)`` of the gate; inputs already validated (shapes, dtypes, devices, ``stride(-1) == 1``).

    Args:
        a, b: ``[B, T, H]``, any strides (read in place when the head dim is unit-stride, else copied).
        A_log, dt_bias: ``[H]``, fp32 or bf16 (float64 allowed).

    Returns:
        g ``[B, T, H]`` contiguous in the compute dtype (fp32; float64 if a, A_log or dt_bias is float64);
        beta ``[B, T, H]`` contiguous in b's dtype.
    """
    B, T, H = a.shape
    a, b, A_log, dt_bias = unit_last(a, b, A_log, dt_bias)     # (no-ops for the layer's own tensors)
    g_dt, beta_dt = _dtypes(a, b, A_log, dt_bias)
    g = torch.empty(B, T, H, dtype=torch.float64 if g_dt == tl.float64 else torch.float32, device=a.device)
    beta = torch.empty(B, T, H, dtype=b.dtype, device=b.device)
    N = B * T
    if N == 0 or H == 0:
        return g, beta
    BLOCK_T, BLOCK_H = _blocks(H)
    _gate_fwd_kernel[(programs(cdiv(N, BLOCK_T)),)](
        a, b, A_log, dt_bias, g, beta, T, N, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        H=H, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, G_DTYPE=g_dt, BETA_DTYPE=beta_dt, num_warps=_NUM_WARPS)
    return g, beta


def gdn_gate_bwd(dg, dbeta, a, b, A_log, dt_bias, da=None, db=None):
    """Gradients of ``gdn_gate_fwd``: ``(da, db, dA_log, ddt_bias)``, each in its input's dtype.

    Args:
        dg: ``[B, T, H]`` grad of g, or None (then da, dA_log, ddt_bias are zero).
        dbeta: ``[B, T, H]`` grad of beta, or None (then db is zero).
        a, b, A_log, dt_bias: the forward's inputs (a, b with any strides on dims 0 and 1).
        da, db: None, or ``[B, T, H]`` tensors of a's / b's dtype with unit head stride to write the
            gradients into (column slices of the layer's ``[q | k | v | a | b]`` gradient).

    Returns:
        da, db ``[B, T, H]`` (new and contiguous, or the given ones); dA_log, ddt_bias ``[H]``. The two ``[H]``
        reductions over the ``B * T`` rows are per-program partial sums (compute dtype) added by ``torch.sum``
        in a fixed order: deterministic, no atomics.
    """
    B, T, H = a.shape
    a, b, A_log, dt_bias = unit_last(a, b, A_log, dt_bias)
    g_dt, beta_dt = _dtypes(a, b, A_log, dt_bias)
    acc_dtype = torch.float64 if g_dt == tl.float64 else torch.float32
    da, db = out_buffer(da, a, "da"), out_buffer(db, b, "db")
    N = B * T
    BLOCK_T, BLOCK_H = _blocks(H)
    NB = min(cdiv(N, BLOCK_T), _MAX_PROGRAMS) if H > 0 else 0   # (no heads: nothing to launch)
    dA_part = torch.empty(NB, H, dtype=acc_dtype, device=a.device)
    dbias_part = torch.empty(NB, H, dtype=acc_dtype, device=a.device)
    if NB > 0:
        has_dg, has_dbeta = dg is not None, dbeta is not None
        # an absent grad's pointer is never read; a and b stand in for it
        dg = unit_last(dg) if has_dg else a          # (upstream grads may come expanded)
        dbeta = unit_last(dbeta) if has_dbeta else b
        _gate_bwd_kernel[(NB,)](
            dg, dbeta, a, b, A_log, dt_bias, da, db, dA_part, dbias_part, T, N, NB,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            dg.stride(0), dg.stride(1), dbeta.stride(0), dbeta.stride(1),
            da.stride(0), da.stride(1), db.stride(0), db.stride(1),
            H=H, BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H, G_DTYPE=g_dt, BETA_DTYPE=beta_dt,
            HAS_DG=has_dg, HAS_DBETA=has_dbeta, num_warps=_NUM_WARPS)
    return da, db, dA_part.sum(0).to(A_log.dtype), dbias_part.sum(0).to(dt_bias.dtype)


class _GdnGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, A_log, dt_bias):
        ctx.set_materialize_grads(False)    # an unused output's grad stays None: its half is skipped
        ctx.save_for_backward(a, b, A_log, dt_bias)
        return gdn_gate_fwd(a, b, A_log, dt_bias)

    @staticmethod
    def backward(ctx, dg, dbeta):
        return gdn_gate_bwd(dg, dbeta, *ctx.saved_tensors)


def gdn_gate(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Differentiable ``(g, beta)``: ``gdn_gate_fwd`` forward, ``gdn_gate_bwd`` backward (same shapes)."""
    return _GdnGate.apply(a, b, A_log, dt_bias)
