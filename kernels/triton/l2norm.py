"""L2 normalisation of q / k heads over the head dim: ``y = x * rsqrt(sum(x^2) + eps)`` (fp32 math).

fla's own ``l2norm_fwd`` buckets the row count into a ``tl.constexpr`` autotune key (``NB``), so it
re-autotunes and recompiles when the packed length crosses a bucket; this one never does.

Layout: ``x [B, T, H, D]`` with ``stride(-1) == 1`` and any strides on B, T and H (a view of the conv
output is read in place). Rows ``M = B*T*H`` are flattened as ``(b*T + t) * H + h``.
Grid: ``(min(cdiv(M, BLOCK_M), 65535),)`` (``_grid.py``); program p normalises row tiles p, p + P, ...
of ``BLOCK_M`` rows (P programs).
``l2norm_pair_fwd`` / ``l2norm_pair_bwd`` take q and k (same shape) in one launch: each program does
its row tiles of both (``PAIR``); the backends normalise the gated delta rule's q and k so.
Runtime (never specialised): ``M``, ``T``, ``H`` and every stride (the B stride passed as 0 when B == 1,
``_layout.row_strides``). Compile-time: ``D`` (head dim), the block sizes derived from it and ``ALIGN``
(``_layout.rows_align``: rows start a multiple of that many elements apart, so they are read as vectors;
from the H and T strides, never from T when B == 1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import reference
from ._grid import cdiv, next_power_of_2, programs
from ._layout import row_strides, rows_align, unit_last

EPS = reference.L2NORM_EPS
BLOCK_M = 16


@triton.jit(do_not_specialize=["start", "M", "T", "H", "stride_b", "stride_t", "stride_h"])
def _load_rows(x, start, M, T, H, stride_b, stride_t, stride_h, eps, D: tl.constexpr, BD: tl.constexpr,
               BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """Rows ``[start, start + BLOCK)`` of x (fp32, masked), their flat indices, the mask and 1 / ||row||.
    ``ALIGN``: every row starts a multiple of ALIGN elements into x (``_layout.rows_align``)."""
    rows = start + tl.arange(0, BLOCK).to(tl.int64)
    cols = tl.arange(0, BD)
    h = rows % H
    bt = rows // H
    src = (bt // T) * stride_b + (bt % T) * stride_t + h * stride_h
    if ALIGN > 1:
        src = tl.multiple_of(src, ALIGN)
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    bx = tl.load(x + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return bx, rows, cols, mask, 1.0 / tl.sqrt(tl.sum(bx * bx, 1) + eps)


@triton.jit(do_not_specialize=["start", "M", "T", "H", "stride_b", "stride_t", "stride_h"])
def _fwd_rows(x, y, start, M, T, H, stride_b, stride_t, stride_h, eps, D: tl.constexpr, BD: tl.constexpr,
              BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    bx, rows, cols, mask, rstd = _load_rows(x, start, M, T, H, stride_b, stride_t, stride_h, eps, D, BD, BLOCK,
                                            ALIGN)
    tl.store(y + rows[:, None] * D + cols[None, :], (bx * rstd[:, None]).to(y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["start", "M", "T", "H", "stride_b", "stride_t", "stride_h"])
def _bwd_rows(x, dy, dx, start, M, T, H, stride_b, stride_t, stride_h, eps, D: tl.constexpr, BD: tl.constexpr,
              BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    bx, rows, cols, mask, rstd = _load_rows(x, start, M, T, H, stride_b, stride_t, stride_h, eps, D, BD, BLOCK,
                                            ALIGN)
    bdy = tl.load(dy + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    by = bx * rstd[:, None]
    bdx = (bdy - tl.sum(bdy * by, 1)[:, None] * by) * rstd[:, None]
    tl.store(dx + rows[:, None] * D + cols[None, :], bdx.to(dx.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "T", "H", "stride_b", "stride_t", "stride_h", "stride_b2", "stride_t2",
                               "stride_h2"])
def _l2norm_fwd_kernel(x, y, x2, y2, M, T, H, stride_b, stride_t, stride_h, stride_b2, stride_t2, stride_h2, eps,
                       D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, PAIR: tl.constexpr,
                       ALIGN: tl.constexpr):
    """y = l2norm(x) for row tiles p, p + P, ...; with ``PAIR`` also y2 = l2norm(x2) (same shape as x,
    its own strides): q and k in one launch."""
    for start in range(tl.program_id(0) * BLOCK, M, tl.num_programs(0) * BLOCK):
        _fwd_rows(x, y, start, M, T, H, stride_b, stride_t, stride_h, eps, D, BD, BLOCK, ALIGN)
        if PAIR:
            _fwd_rows(x2, y2, start, M, T, H, stride_b2, stride_t2, stride_h2, eps, D, BD, BLOCK, ALIGN)


@triton.jit(do_not_specialize=["M", "T", "H", "stride_b", "stride_t", "stride_h", "stride_b2", "stride_t2",
                               "stride_h2"])
def _l2norm_bwd_kernel(x, dy, dx, x2, dy2, dx2, M, T, H, stride_b, stride_t, stride_h, stride_b2, stride_t2,
                       stride_h2, eps, D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr, PAIR: tl.constexpr,
                       ALIGN: tl.constexpr):
    """dx of ``_l2norm_fwd_kernel`` (the norm recomputed from x; dy contiguous); with ``PAIR`` also dx2."""
    for start in range(tl.program_id(0) * BLOCK, M, tl.num_programs(0) * BLOCK):
        _bwd_rows(x, dy, dx, start, M, T, H, stride_b, stride_t, stride_h, eps, D, BD, BLOCK, ALIGN)
        if PAIR:
            _bwd_rows(x2, dy2, dx2, start, M, T, H, stride_b2, stride_t2, stride_h2, eps, D, BD, BLOCK, ALIGN)


@triton.jit(do_not_specialize=["M"])
def _l2norm_bwd_from_output_kernel(y, rstd, dy, dx, M, D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr):
    """dx of ``y = x * rstd`` from the saved output: ``(dy - y sum(dy y)) * rstd`` for row tiles p, p + P, ...
    of the M rows of D elements (y, dy, dx contiguous ``[M, D]``, rstd ``[M]`` fp32)."""
    cols = tl.arange(0, BD)
    for start in range(tl.program_id(0) * BLOCK, M, tl.num_programs(0) * BLOCK):
        rows = start + tl.arange(0, BLOCK).to(tl.int64)
        mask = (rows < M)[:, None] & (cols < D)[None, :]
        at = rows[:, None] * D + cols[None, :]
        by = tl.load(y + at, mask=mask, other=0.0).to(tl.float32)
        bdy = tl.load(dy + at, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(rstd + rows, mask=rows < M, other=0.0)
        bdx = (bdy - tl.sum(bdy * by, 1)[:, None] * by) * r[:, None]
        tl.store(dx + at, bdx.to(dx.dtype.element_ty), mask=mask)


def _launch_args(x: torch.Tensor):
    B, T, H, D = x.shape
    return B * T * H, T, H, D, next_power_of_2(D)


def _torch_fwd(x, eps):
    return (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)).contiguous()


def _torch_bwd(x, dy, eps):
    rstd = torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)
    y = x * rstd
    return ((dy - (dy * y).sum(-1, keepdim=True) * y) * rstd).contiguous()


def l2norm_fwd(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """``x [B, T, H, D]`` (strided) -> contiguous ``[B, T, H, D]`` in x's dtype (float64 stays float64:
    computed in torch, as the kernel's math is fp32)."""
    return l2norm_pair_fwd(x, None, eps)[0]


def l2norm_bwd(x: torch.Tensor, dy: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Gradient of ``l2norm_fwd`` w.r.t. x (recomputes the norm from x); contiguous, x's dtype."""
    return l2norm_pair_bwd(x, dy, None, None, eps)[0]


def l2norm_bwd_from_output(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Gradient of ``y = x * rstd`` (``rstd = 1 / sqrt(sum(x^2, -1) + eps)``) w.r.t. x from the saved output
    and factor, without x: ``(dy - y sum(dy y, -1)) rstd``. ``y``, ``dy [..., D]``, ``rstd [...]`` (fp32, or
    float64: then computed in torch); returns a contiguous ``[..., D]`` in y's dtype. (fla's ``l2norm_bwd``
    takes the same saved pair.)"""
    if rstd.dtype == torch.float64 or y.dtype == torch.float64:
        f64 = [t.to(torch.float64) for t in (y, rstd, dy)]
        return reference.l2norm_bwd_from_output(*f64).to(y.dtype).contiguous()
    D = y.shape[-1]
    y, dy, rstd = y.contiguous(), dy.contiguous(), rstd.contiguous()
    dx = torch.empty(y.shape, dtype=y.dtype, device=y.device)
    M = rstd.numel()
    if M:
        _l2norm_bwd_from_output_kernel[(programs(cdiv(M, BLOCK_M)),)](
            y, rstd, dy, dx, M, D=D, BD=next_power_of_2(D), BLOCK=BLOCK_M)
    return dx


def l2norm_pair_fwd(q: torch.Tensor, k: torch.Tensor | None, eps: float = EPS):
    """``(l2norm_fwd(q), l2norm_fwd(k))`` in one launch when q and k have the same shape and dtype (the
    gated delta rule's q and k: ``[B, T, Hk, Dk]``); k None: ``(l2norm_fwd(q), None)``."""
    if k is not None and (k.shape != q.shape or k.dtype != q.dtype):
        return l2norm_fwd(q, eps), l2norm_fwd(k, eps)
    if q.dtype == torch.float64:
        return _torch_fwd(q, eps), (None if k is None else _torch_fwd(k, eps))
    q = unit_last(q)
    k2 = q if k is None else unit_last(k)
    M, T, H, D, BD = _launch_args(q)
    yq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    yk = yq if k is None else torch.empty(k2.shape, dtype=k2.dtype, device=k2.device)
    if M:
        _l2norm_fwd_kernel[(programs(cdiv(M, BLOCK_M)),)](
            q, yq, k2, yk, M, T, H, *row_strides(q, 3), *row_strides(k2, 3), eps, D=D, BD=BD,
            BLOCK=BLOCK_M, PAIR=k is not None, ALIGN=rows_align([q, k2], 3))
    return yq, (None if k is None else yk)


def l2norm_pair_bwd(q: torch.Tensor, dq: torch.Tensor, k: torch.Tensor | None, dk: torch.Tensor | None,
                    eps: float = EPS):
    """``(l2norm_bwd(q, dq), l2norm_bwd(k, dk))`` in one launch (as ``l2norm_pair_fwd``); k None:
    ``(l2norm_bwd(q, dq), None)``."""
    if k is not None and (k.shape != q.shape or k.dtype != q.dtype):
        return l2norm_bwd(q, dq, eps), l2norm_bwd(k, dk, eps)
    if q.dtype == torch.float64:
        return _torch_bwd(q, dq, eps), (None if k is None else _torch_bwd(k, dk, eps))
    q = unit_last(q)
    dq = dq.contiguous()   # (read with contiguous row offsets)
    k2, dk2 = (q, dq) if k is None else (unit_last(k), dk.contiguous())
    M, T, H, D, BD = _launch_args(q)
    dxq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dxk = dxq if k is None else torch.empty(k2.shape, dtype=k2.dtype, device=k2.device)
    if M:
        _l2norm_bwd_kernel[(programs(cdiv(M, BLOCK_M)),)](
            q, dq, dxq, k2, dk2, dxk, M, T, H, *row_strides(q, 3), *row_strides(k2, 3), eps, D=D, BD=BD,
            BLOCK=BLOCK_M, PAIR=k is not None, ALIGN=rows_align([q, k2], 3))
    return dxq, (None if k is None else dxk)
