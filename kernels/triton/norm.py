"""Gated RMSNorm in Triton: ``y = weight * rmsnorm(x) * silu(z)`` over the last dim ``D``.

Contract: ``kernels/reference.py::gated_rms_norm`` (transformers' ``Qwen3NextRMSNormGated``), with its
rounding order: ``x * rsqrt(mean(x^2) + eps)`` in the compute dtype (fp32; float64 for float64 x),
rounded to x's dtype; times ``weight`` in ``promote(weight, x)`` dtype; times ``silu(z)`` in the compute
dtype; rounded to x's dtype.

Shapes: ``x, z: [..., D]`` (same shape, ``stride(-1) == 1``), ``D <= 1024`` (any value: the block is
``next_power_of_2(D)`` wide and masked); ``weight: [D]``. Leading dims are flattened to ``M`` rows by a
view when the strides allow (rows of a wider buffer are read in place), else by a copy. The kernels
walk tiles of ``BLOCK_M`` rows by the whole ``D``; the grid is one axis of at most 65 535 programs
(``_grid.py``), each looping over its tiles. ``N`` (the row count, M), the
program count ``NB`` and the row strides are runtime arguments (``do_not_specialize``): a new token
count or packing compiles nothing. ``ALIGN`` (``_rows_align``, from the buffers' widths) tells the compiler
that rows start a multiple of that many elements apart, so that they are read as vectors. Block sizes
depend on ``D`` only; one fixed config, no autotune.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _grid
from ._grid import cdiv, next_power_of_2, programs
from ._layout import row_align, unit_last
from ._math import compute_tl_dtype, rne_by, sigmoid, tl_dtype

MAX_D = 1024
# Elements per tile (BLOCK_M * BLOCK_D) of the forward and the backward, and their warps (None: 4 up to
# D = 256, else 8); read at call time so tests can shrink tiles and benchmarks/bench_triton_norm.py can sweep.
# H200, Qwen3-Next's shape (32k tokens, 32 heads, D = 128, bf16; benchmarks/bench_triton_norm.py): forward
# 0.233 ms at 1024 elements on 2 warps (0.248 at 4096 on 4), backward 0.412 ms at 2048 on 8 warps (0.563
# at 4096 on 4, which takes 251 registers on sm_90 against 74). The backward was timed with rstd saved;
# the CUDA backends let it recompute rstd (one more row sum), not timed yet. Tuned at D = 128 only.
_TILE = 1024
_TILE_BWD = 2048
_NUM_WARPS = 2
_NUM_WARPS_BWD = 8
# Round to x's (and weight's) dtype by the GPU's own conversions (``_math.rne_by``) on CUDA; False: by bit
# arithmetic everywhere. Read at call time (benchmarks/bench_triton_norm.py times both).
HW_RNE = True
# Backward grid cap: bounds the [NB, D] partial dweight buffer; each program then loops over tiles.
_MAX_PROGRAMS = 1024


def _blocks(D: int, tile: int, num_warps: int | None) -> tuple[int, int, int]:
    BLOCK_D = next_power_of_2(D)
    return max(1, tile // BLOCK_D), BLOCK_D, num_warps or (4 if BLOCK_D <= 256 else 8)


@triton.jit
def _forward_terms(xv, wv, rstd, x_ty: tl.constexpr, P_DTYPE: tl.constexpr, C_DTYPE: tl.constexpr,
                   HW_RNE: tl.constexpr):
    """``xhat``, ``t = round_x(xhat)`` and ``h = round_P(weight * t)``, all in the compute dtype."""
    xhat = xv * rstd[:, None]
    t = rne_by(xhat, x_ty, HW_RNE)
    h = rne_by(wv[None, :] * t, P_DTYPE, HW_RNE)
    return xhat, t, h


@triton.jit
def _rstd(xv, eps, D: tl.constexpr):
    return 1.0 / tl.sqrt(tl.sum(xv * xv, 1) / D + eps)


@triton.jit
def _row_off(rows, stride, ALIGN: tl.constexpr):
    """``rows [BLOCK_M] * stride`` as ``[BLOCK_M, 1]``, hinted a multiple of ``ALIGN`` (``_rows_align``)."""
    off = rows[:, None] * stride
    if ALIGN > 1:
        off = tl.multiple_of(off, [ALIGN, ALIGN])
    return off


@triton.jit(do_not_specialize=["N", "stride_x", "stride_z"])
def _norm_fwd_kernel(x, z, w, y, rstd, N, stride_x, stride_z, eps,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                     C_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, ALIGN: tl.constexpr, HW_RNE: tl.constexpr):
    """Grid ``(min(cdiv(N, BLOCK_M), 65535),)``; program p normalises row tiles p, p + P, ... of
    ``BLOCK_M`` rows (P programs).

    Writes y (contiguous ``[N, D]``) and rstd ``[N]`` (compute dtype) for those rows.
    """
    cols = tl.arange(0, BLOCK_D)
    m_c = cols < D
    wv = tl.load(w + cols, mask=m_c, other=0.0).to(C_DTYPE)
    for start in range(tl.program_id(0) * BLOCK_M, N, tl.num_programs(0) * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
        m_r = rows < N
        mask = m_r[:, None] & m_c[None, :]
        xv = tl.load(x + _row_off(rows, stride_x, ALIGN) + cols[None, :], mask=mask, other=0.0).to(C_DTYPE)
        zv = tl.load(z + _row_off(rows, stride_z, ALIGN) + cols[None, :], mask=mask, other=0.0).to(C_DTYPE)
        r = _rstd(xv, eps, D)
        _, _, h = _forward_terms(xv, wv, r, x.dtype.element_ty, P_DTYPE, C_DTYPE, HW_RNE)
        out = h * (zv * sigmoid(zv))
        tl.store(y + rows[:, None] * D + cols[None, :], rne_by(out, y.dtype.element_ty, HW_RNE).to(y.dtype.element_ty),
                 mask=mask)
        tl.store(rstd + rows, r.to(rstd.dtype.element_ty), mask=m_r)


@triton.jit(do_not_specialize=["N", "NB", "stride_dy", "stride_x", "stride_z"])
def _norm_bwd_kernel(dy, x, z, w, rstd, dx, dz, dw_part, N, NB, stride_dy, stride_x, stride_z, eps,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                     C_DTYPE: tl.constexpr, P_DTYPE: tl.constexpr, HAS_RSTD: tl.constexpr, ALIGN: tl.constexpr,
                     HW_RNE: tl.constexpr):
    """Grid ``(NB,)``; program p takes row tiles p, p + NB, p + 2 NB, ... of ``BLOCK_M`` rows.

    Writes dx, dz (contiguous ``[N, D]``) of its rows and row p of ``dw_part [NB, D]`` (compute dtype),
    the sum over its rows of ``dy * silu(z) * round_x(xhat)``. Without a saved rstd it recomputes it.
    """
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    m_c = cols < D
    wv = tl.load(w + cols, mask=m_c, other=0.0).to(C_DTYPE)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=C_DTYPE)
    for start in range(pid * BLOCK_M, N, NB * BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
        m_r = rows < N
        mask = m_r[:, None] & m_c[None, :]
        xv = tl.load(x + _row_off(rows, stride_x, ALIGN) + cols[None, :], mask=mask, other=0.0).to(C_DTYPE)
        zv = tl.load(z + _row_off(rows, stride_z, ALIGN) + cols[None, :], mask=mask, other=0.0).to(C_DTYPE)
        dyv = tl.load(dy + _row_off(rows, stride_dy, ALIGN) + cols[None, :], mask=mask, other=0.0).to(C_DTYPE)
        if HAS_RSTD:
            r = tl.load(rstd + rows, mask=m_r, other=0.0).to(C_DTYPE)
        else:
            r = _rstd(xv, eps, D)
        xhat, t, h = _forward_terms(xv, wv, r, x.dtype.element_ty, P_DTYPE, C_DTYPE, HW_RNE)
        sig = sigmoid(zv)
        dzv = dyv * h * sig * (1.0 + zv * (1.0 - sig))
        # grads rounded where the reference's autograd rounds them (to the dtype of the tensor they
        # belong to): h lives in P, round_x(xhat) in x's dtype
        dh = rne_by(dyv * (zv * sig), P_DTYPE, HW_RNE)
        acc += rne_by(dh * t, P_DTYPE, HW_RNE)
        dxhat = rne_by(dh * wv[None, :], x.dtype.element_ty, HW_RNE)
        # d/dx of x * rsqrt(mean(x^2) + eps): rstd * (dxhat - xhat * mean(dxhat * xhat)); eps cancels
        dxv = (dxhat - xhat * (tl.sum(dxhat * xhat, 1) / D)[:, None]) * r[:, None]
        off = rows[:, None] * D + cols[None, :]
        tl.store(dx + off, rne_by(dxv, dx.dtype.element_ty, HW_RNE).to(dx.dtype.element_ty), mask=mask)
        tl.store(dz + off, rne_by(dzv, dz.dtype.element_ty, HW_RNE).to(dz.dtype.element_ty), mask=mask)
    tl.store(dw_part + pid * D + cols, tl.sum(acc, 0), mask=m_c)


def _hw_rne(x: torch.Tensor) -> bool:
    """Round by the device's conversions (``_math.rne_by``) on CUDA, when ``HW_RNE`` is on."""
    return HW_RNE and _grid.on_cuda(x)


def _rows_align(D: int, *rows: torch.Tensor) -> tuple:
    """``(ALIGN, row strides)`` for the kernels: the row strides of the ``[M, D]`` views (0 for a single row,
    whose stride torch renumbers by shape), and how many elements (a power of 2, at most 16 bytes' worth) they
    are all multiples of (``_layout.row_align``; from D for a single row, as the layer's many-row calls
    give). The strides are runtime arguments; ``ALIGN`` depends on the buffers' widths, never on M."""
    if rows[0].shape[0] == 1:
        return row_align(rows[0].element_size(), D), tuple(0 for _ in rows)
    strides = tuple(r.stride(0) for r in rows)
    return row_align(rows[0].element_size(), *strides), strides


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """``[..., D]`` as ``[M, D]`` with a row stride: a view when the strides allow, else a copy."""
    return unit_last(t.reshape(-1, D))


def _dtypes(x, weight):
    return compute_tl_dtype(x), tl_dtype(torch.promote_types(weight.dtype, x.dtype))


def _check_d(D: int) -> None:
    if not 1 <= D <= MAX_D:
        raise ValueError(f"gated_rms_norm: x.shape[-1] (D) must be in [1, {MAX_D}] for the Triton kernel, got {D}")


def gated_rms_norm_fwd(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float):
    """``(y, rstd)``; inputs already validated (same shape, ``stride(-1) == 1``, ``weight: [D]``).

    Args:
        x, z: ``[..., D]`` with ``D <= 1024``, any leading dims and row strides. weight: ``[D]``.
        eps: added to ``mean(x^2)``.

    Returns:
        y ``[..., D]`` contiguous in x's dtype; rstd ``x.shape[:-1]`` in the compute dtype (fp32, or
        float64 for float64 x), ``1 / sqrt(mean(x^2) + eps)``.

    Raises:
        ValueError: D outside ``[1, 1024]``.
    """
    D = x.shape[-1]
    _check_d(D)
    c_dt, p_dt = _dtypes(x, weight)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float64 if c_dt == tl.float64 else torch.float32,
                       device=x.device)
    M = rstd.numel()
    if M == 0:
        return y, rstd
    x2, z2 = _rows(x, D), _rows(z, D)
    BLOCK_M, BLOCK_D, num_warps = _blocks(D, _TILE, _NUM_WARPS)
    align, strides = _rows_align(D, x2, z2)
    _norm_fwd_kernel[(programs(cdiv(M, BLOCK_M)),)](
        x2, z2, weight.contiguous(), y, rstd, M, *strides, float(eps),
        D=D, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, C_DTYPE=c_dt, P_DTYPE=p_dt, ALIGN=align, HW_RNE=_hw_rne(x),
        num_warps=num_warps)
    return y, rstd


def gated_rms_norm_bwd(dy, x, z, weight, rstd, eps):
    """Gradients of ``gated_rms_norm_fwd``: ``(dx, dz, dweight)``.

    Args:
        dy: ``[..., D]`` grad of y (any strides). x, z, weight, eps: the forward's inputs.
        rstd: the forward's rstd, or None to recompute it from x and eps.

    Returns:
        dx ``[..., D]`` in x's dtype, dz in z's dtype (both contiguous), dweight ``[D]`` in weight's
        dtype: per-program partial sums over the M rows (compute dtype) added by ``torch.sum`` in a
        fixed order: deterministic, no atomics.

    Raises:
        ValueError: D outside ``[1, 1024]``.
    """
    D = x.shape[-1]
    _check_d(D)
    c_dt, p_dt = _dtypes(x, weight)
    acc_dtype = torch.float64 if c_dt == tl.float64 else torch.float32
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(z.shape, dtype=z.dtype, device=z.device)
    M = x.numel() // D
    BLOCK_M, BLOCK_D, num_warps = _blocks(D, _TILE_BWD, _NUM_WARPS_BWD)
    NB = min(cdiv(M, BLOCK_M), _MAX_PROGRAMS)
    dw_part = torch.empty(NB, D, dtype=acc_dtype, device=x.device)
    if NB > 0:
        x2, z2, dy2 = _rows(x, D), _rows(z, D), _rows(dy, D)
        has_rstd = rstd is not None
        rstd = rstd.reshape(-1) if has_rstd else x2     # x2 stands in for an absent pointer
        align, strides = _rows_align(D, dy2, x2, z2)
        _norm_bwd_kernel[(NB,)](
            dy2, x2, z2, weight.contiguous(), rstd, dx, dz, dw_part, M, NB, *strides, float(eps),
            D=D, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, C_DTYPE=c_dt, P_DTYPE=p_dt, HAS_RSTD=has_rstd,
            ALIGN=align, HW_RNE=_hw_rne(x), num_warps=num_warps)
    return dx, dz, dw_part.sum(0).to(weight.dtype)


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, weight, eps):
        y, rstd = gated_rms_norm_fwd(x, z, weight, eps)
        ctx.save_for_backward(x, z, weight, rstd)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        x, z, weight, rstd = ctx.saved_tensors
        dx, dz, dweight = gated_rms_norm_bwd(dy, x, z, weight, rstd, ctx.eps)
        return dx, dz, dweight, None


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Differentiable ``y = weight * rmsnorm(x) * silu(z)`` (``gated_rms_norm_fwd`` / ``_bwd``; same shapes)."""
    return _GatedRMSNorm.apply(x, z, weight, eps)
