"""L2 normalisation of q / k heads over the head dim: ``y = x * rsqrt(sum(x^2) + eps)`` (fp32 math).

fla's own ``l2norm_fwd`` buckets the row count into a ``tl.constexpr`` autotune key (``NB``), so it
re-autotunes and recompiles when the packed length crosses a bucket; this one never does.

Layout: ``x [B, T, H, D]`` with ``stride(-1) == 1`` and any strides on B, T and H (a view of the conv
output is read in place). Rows ``M = B*T*H`` are flattened as ``(b*T + t) * H + h``.
Grid: ``(min(cdiv(M, BLOCK_M), 65535),)`` (``_grid.py``); program p normalises row tiles p, p + P, ...
of ``BLOCK_M`` rows (P programs).
Runtime (never specialised): ``M``, ``T``, ``H`` and every stride. Compile-time: ``D`` (head dim) and
the block sizes derived from it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._grid import programs
from ._layout import unit_last

EPS = 1e-6
BLOCK_M = 16


@triton.jit(do_not_specialize=["start", "M", "T", "H", "stride_b", "stride_t", "stride_h"])
def _load_rows(x, start, M, T, H, stride_b, stride_t, stride_h, eps, D: tl.constexpr, BD: tl.constexpr,
               BLOCK: tl.constexpr):
    """Rows ``[start, start + BLOCK)`` of x (fp32, masked), their flat indices, the mask and 1 / ||row||."""
    rows = start + tl.arange(0, BLOCK).to(tl.int64)
    cols = tl.arange(0, BD)
    h = rows % H
    bt = rows // H
    src = (bt // T) * stride_b + (bt % T) * stride_t + h * stride_h
    mask = (rows < M)[:, None] & (cols < D)[None, :]
    bx = tl.load(x + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return bx, rows, cols, mask, 1.0 / tl.sqrt(tl.sum(bx * bx, 1) + eps)


@triton.jit(do_not_specialize=["M", "T", "H", "stride_b", "stride_t", "stride_h"])
def _l2norm_fwd_kernel(x, y, M, T, H, stride_b, stride_t, stride_h, eps,
                       D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr):
    for start in range(tl.program_id(0) * BLOCK, M, tl.num_programs(0) * BLOCK):
        bx, rows, cols, mask, rstd = _load_rows(x, start, M, T, H, stride_b, stride_t, stride_h, eps, D, BD, BLOCK)
        tl.store(y + rows[:, None] * D + cols[None, :], (bx * rstd[:, None]).to(y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M", "T", "H", "stride_b", "stride_t", "stride_h"])
def _l2norm_bwd_kernel(x, dy, dx, M, T, H, stride_b, stride_t, stride_h, eps,
                       D: tl.constexpr, BD: tl.constexpr, BLOCK: tl.constexpr):
    for start in range(tl.program_id(0) * BLOCK, M, tl.num_programs(0) * BLOCK):
        bx, rows, cols, mask, rstd = _load_rows(x, start, M, T, H, stride_b, stride_t, stride_h, eps, D, BD, BLOCK)
        bdy = tl.load(dy + rows[:, None] * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        by = bx * rstd[:, None]
        bdx = (bdy - tl.sum(bdy * by, 1)[:, None] * by) * rstd[:, None]
        tl.store(dx + rows[:, None] * D + cols[None, :], bdx.to(dx.dtype.element_ty), mask=mask)


def _launch_args(x: torch.Tensor):
    B, T, H, D = x.shape
    M = B * T * H
    return M, T, H, x.stride(0), x.stride(1), x.stride(2), D, triton.next_power_of_2(D)


def l2norm_fwd(x: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """``x [B, T, H, D]`` (strided) -> contiguous ``[B, T, H, D]`` in x's dtype (float64 stays float64:
    computed in torch, as the kernel's math is fp32)."""
    if x.dtype == torch.float64:
        return (x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)).contiguous()
    x = unit_last(x)
    M, T, H, sb, st, sh, D, BD = _launch_args(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if M:
        _l2norm_fwd_kernel[(programs(triton.cdiv(M, BLOCK_M)),)](x, y, M, T, H, sb, st, sh, eps, D=D, BD=BD, BLOCK=BLOCK_M)
    return y


def l2norm_bwd(x: torch.Tensor, dy: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """Gradient of ``l2norm_fwd`` w.r.t. x (recomputes the norm from x); contiguous, x's dtype."""
    if x.dtype == torch.float64:
        rstd = torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)
        y = x * rstd
        return ((dy - (dy * y).sum(-1, keepdim=True) * y) * rstd).contiguous()
    x = unit_last(x)
    M, T, H, sb, st, sh, D, BD = _launch_args(x)
    dy = dy.contiguous()   # (read with contiguous row offsets)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if M:
        _l2norm_bwd_kernel[(programs(triton.cdiv(M, BLOCK_M)),)](x, dy, dx, M, T, H, sb, st, sh, eps, D=D, BD=BD, BLOCK=BLOCK_M)
    return dx
