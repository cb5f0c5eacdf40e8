"""The conv's backward kernels (launched by ``conv.py``'s ``causal_conv1d_bwd``; shared helpers in
``conv_tiles.py``).

- ``_conv_dz_kernel``, over its own tiles (``DZ_BLOCK_T`` or ``DZ_BLOCK_T_PLAIN`` x ``_dz_block_c(C)``): the
  pre-activation's gradient dz (z recomputed from x; the forward saves nothing but its inputs) into a ``[B, T, C]``
  scratch buffer, plus each
  program's partial sums of dweight and dbias over its tiles (summed over the programs in torch
  afterwards: deterministic, no atomics). Without bias and initial states (the layer's conv in training) about
  one wave of programs, each software-pipelining its tiles' loads (``DZ_PROGRAMS_PLAIN``, ``DZ_NUM_STAGES_PLAIN``).
- ``_conv_dx_kernel``, over the plain forward's tiles (the other forward's with dfinal):
  ``dx_p = sum_j weight[:, W-1-j] dz_{p+j}`` (+ dfinal). Two passes instead of one: a fused pass would
  recompute z at each of the W shifts (W^2 taps per element) and spills registers; the scratch round trip
  costs less.
- ``_conv_state_bwd_kernel``, over the N sequences x channel blocks: ``d initial_state[n]``, with the
  dz of the sequence's first W-1 tokens recomputed in fp32 (the scratch dz may be 16-bit).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .conv_tiles import _load_parts, _preact, _row, _seq_pos, _seq_span, _tap, _tile, _w4, _w_at


@triton.jit
def _dz(x, init, w0, w1, w2, w3, w, bias, g, x_base, init_base, r, c, valid, near, cmask,
        stride_xt, stride_xc, stride_wc, stride_ww, stride_bc, stride_ic, stride_ik,
        W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
        ALIGN: tl.constexpr):
    """Gradient of the pre-activation at position r of a sequence, from ``g`` = dy there (0 where not
    valid)."""
    if SILU:
        z = _preact(x, init, w0, w1, w2, w3, w, bias, x_base, init_base, r, c, valid, near, cmask,
                    stride_xt, stride_xc, stride_wc, stride_ww, stride_bc, stride_ic, stride_ik,
                    W, HAS_BIAS, HAS_INIT, ACC, ALIGN)
        sig = 1.0 / (1.0 + tl.exp(-z))
        g = g * sig * (1.0 + z * (1.0 - sig))
    return g


@triton.jit
def _dw_col(dw_part, part, acc, W: tl.constexpr, i: tl.constexpr, cmask):
    """Stores the tokens' sum of ``acc`` (dz times the input i taps back) as dweight entry W-1-i."""
    tl.store(dw_part + part * W + (W - 1 - i), tl.sum(acc, 0), mask=cmask)


@triton.jit(do_not_specialize=["T", "NT", "stride_xb", "sd0b", "sd1b", "sd2b"])
def _conv_dz_kernel(x, w, bias, init, seq_idx, cu, dy, dy1, dy2, e0, e1, sd0b, sd0t, sd0c, sd1b, sd1t, sd1c,
                    sd2b, sd2t, sd2c, dz, dw_part, db_part,
                    T, NT, C, stride_xb, stride_xt, stride_xc, stride_wc, stride_ww, stride_bc,
                    stride_in, stride_ic, stride_ik,
                    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
                    IS_VARLEN: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_W: tl.constexpr, PARTS: tl.constexpr,
                    X_ALIGN: tl.constexpr, DY_ALIGN: tl.constexpr, STAGES: tl.constexpr):
    """dz (the pre-activation's gradient) for token tiles p, p + P, ... (of NT), and the program's
    partial dweight [C, W] and dbias [C] summed over its tiles (row p of the parts). dy comes as the
    parts ``dy, dy1, dy2`` split at columns ``e0, e1`` (``_load_parts``).

    z is recomputed from x (W taps); the taps are read again for dweight (cache hits). The dweight and
    dbias products of the first 4 taps are summed elementwise over the program's tiles and reduced over
    tokens once at its end (a per-tile reduction crosses warps); taps past 4 (W > 4) reduce per tile.
    """
    pid = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    kw = tl.arange(0, BLOCK_W)
    w0, w1, w2, w3 = _w4(w, c[None, :], (c < C)[None, :], stride_wc, stride_ww, W, ACC)
    acc_db = tl.zeros((BLOCK_T, BLOCK_C), ACC)
    acc0 = tl.zeros((BLOCK_T, BLOCK_C), ACC)
    acc1 = tl.zeros((BLOCK_T, BLOCK_C), ACC)
    acc2 = tl.zeros((BLOCK_T, BLOCK_C), ACC)
    acc3 = tl.zeros((BLOCK_T, BLOCK_C), ACC)
    acc_dw = tl.zeros((BLOCK_C, BLOCK_W), ACC)      # taps past 4: [channel, tap index of weight]
    for tile in tl.range(pid, NT, tl.num_programs(0), num_stages=STAGES):   # (DZ_NUM_STAGES)
        b, t, c, tmask, cmask = _tile(tile, T, C, BLOCK_T, BLOCK_C, IS_VARLEN)
        x_base, init_base, r, near = _seq_pos(t, b, tmask, seq_idx, cu, stride_xb, stride_xt, stride_in, W, IS_VARLEN)
        c2, cm2 = c[None, :], cmask[None, :]
        valid = tmask[:, None] & cm2
        g = _load_parts(dy, dy1, dy2, b, t[:, None], c2, valid, e0, e1, sd0b, sd0t, sd0c, sd1b, sd1t, sd1c,
                        sd2b, sd2t, sd2c, ACC, PARTS, DY_ALIGN)
        g = _dz(x, init, w0, w1, w2, w3, w, bias, g, x_base, init_base, r, c2, valid, near, cm2,
                stride_xt, stride_xc, stride_wc, stride_ww, stride_bc, stride_ic, stride_ik,
                W, HAS_BIAS, HAS_INIT, SILU, ACC, X_ALIGN)
        tl.store(dz + (b * T + t)[:, None] * C + c2, g.to(dz.dtype.element_ty), mask=valid)
        if HAS_BIAS:
            acc_db += g
        for i in tl.static_range(W):
            xi = _tap(x, init, x_base, init_base, r - i, c2, valid, near, stride_xt, stride_xc, stride_ic, stride_ik,
                      W, HAS_INIT, ACC, X_ALIGN)
            if i == 0:
                acc0 += g * xi
            elif i == 1:
                acc1 += g * xi
            elif i == 2:
                acc2 += g * xi
            elif i == 3:
                acc3 += g * xi
            else:
                acc_dw += tl.where(kw[None, :] == W - 1 - i, tl.sum(g * xi, 0)[:, None], 0.0)
    part = pid.to(tl.int64) * C + c
    cmask = c < C
    if HAS_BIAS:
        tl.store(db_part + part, tl.sum(acc_db, 0), mask=cmask)
    _dw_col(dw_part, part, acc0, W, 0, cmask)
    if W > 1:
        _dw_col(dw_part, part, acc1, W, 1, cmask)
    if W > 2:
        _dw_col(dw_part, part, acc2, W, 2, cmask)
    if W > 3:
        _dw_col(dw_part, part, acc3, W, 3, cmask)
    if W > 4:
        tl.store(dw_part + part[:, None] * W + kw[None, :], acc_dw,
                 mask=cmask[:, None] & (kw < W - 4)[None, :])


@triton.jit(do_not_specialize=["T", "NT", "sdxb"])
def _conv_dx_kernel(w, seq_idx, cu, dz, dfinal, dx, T, NT, C, stride_wc, stride_ww, stride_dfn, stride_dfc, stride_dfk,
                    sdxb, sdxt, W: tl.constexpr, HAS_DFINAL: tl.constexpr, IS_VARLEN: tl.constexpr, ACC: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, DX_ALIGN: tl.constexpr, STAGES: tl.constexpr):
    """dx for token tiles p, p + P, ... (``_tile_shape``'s, plain without dfinal): x_p feeds z_{p+j} through
    weight[:, W-1-j] (j < W, same sequence), so dx_p = sum_j weight[:, W-1-j] dz_{p+j}; dfinal adds to the last
    W-1 tokens of each sequence.

    dz is contiguous ``[B, T, C]`` (``_conv_dz_kernel``'s output); dx has batch / token strides ``sdxb``,
    ``sdxt`` and unit channel stride (a column slice of a wider gradient buffer, or contiguous), ``DX_ALIGN``
    its ``_row`` hint.
    """
    cw = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    w0, w1, w2, w3 = _w4(w, cw[None, :], (cw < C)[None, :], stride_wc, stride_ww, W, ACC)
    for tile in tl.range(tl.program_id(0), NT, tl.num_programs(0), num_stages=STAGES):   # (DX_NUM_STAGES)
        b, t, c, tmask, cmask = _tile(tile, T, C, BLOCK_T, BLOCK_C, IS_VARLEN)
        if IS_VARLEN:
            n = tl.load(seq_idx + t, mask=tmask, other=0).to(tl.int64)
            end1 = tl.load(cu + n + 1, mask=tmask, other=0)      # one past the sequence's last token
            n_row = n[:, None]
        else:
            end1 = T + tl.zeros((BLOCK_T,), tl.int64)
            n_row = b
        c2, cm2 = c[None, :], cmask[None, :]
        valid = tmask[:, None] & cm2
        tt, end = t[:, None], end1[:, None]
        rows = b * T + tt
        acc = tl.zeros((BLOCK_T, BLOCK_C), ACC)
        for j in tl.static_range(W):
            w_j = _w_at(w0, w1, w2, w3, w, c2, cm2, stride_wc, stride_ww, j, W, ACC)
            acc += w_j * tl.load(dz + (rows + j) * C + c2, mask=valid & (tt + j < end), other=0.0).to(ACC)
        if HAS_DFINAL:
            if tl.min(tl.where(tmask, end1 - t, W)) < W:
                k = W - 1 - (end - tt)  # x_p is final-state entry k when it is among the last W-1 tokens
                acc += tl.load(dfinal + n_row * stride_dfn + c2 * stride_dfc + k * stride_dfk,
                               mask=valid & (k >= 0), other=0.0).to(ACC)
        tl.store(dx + _row(b, tt, sdxb, sdxt, DX_ALIGN) + c2, acc.to(dx.dtype.element_ty), mask=valid)


@triton.jit(do_not_specialize=["T", "N", "stride_xb", "sd0b", "sd1b", "sd2b"])
def _conv_state_bwd_kernel(x, w, bias, init, cu, dy, dy1, dy2, e0, e1, sd0b, sd0t, sd0c, sd1b, sd1t, sd1c,
                           sd2b, sd2t, sd2c, dfinal, dinit,
                           T, N, C, stride_xb, stride_xt, stride_xc, stride_wc, stride_ww, stride_bc,
                           stride_in, stride_ic, stride_ik,
                           stride_dfn, stride_dfc, stride_dfk,
                           W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DFINAL: tl.constexpr,
                           IS_VARLEN: tl.constexpr, SILU: tl.constexpr, ACC: tl.constexpr,
                           BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, PARTS: tl.constexpr):
    """d initial_state[n, c, k] for sequences n = p, p + P, ... (P programs on axis 0) and a block of
    channels (all W-1 entries k).

    Entry k sits at relative position k-(W-1) and feeds z_{k-(W-1)+j} through weight[:, W-1-j] while
    that token exists; it is also final-state entry k-length when the sequence is shorter than W-1-k.
    dy as in ``_conv_dz_kernel``.
    """
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[:, None]
    k = tl.arange(0, BLOCK_K)[None, :]
    cmask = c < C
    kvalid = cmask & (k < W - 1)
    r = k - (W - 1)
    w0, w1, w2, w3 = _w4(w, c, cmask, stride_wc, stride_ww, W, ACC)
    for n32 in range(tl.program_id(0), N, tl.num_programs(0)):
        n, s, length, x_base = _seq_span(n32, cu, T, stride_xb, stride_xt, IS_VARLEN)
        if IS_VARLEN:
            dy_b, dy_t0 = 0, s        # dy of the sequence's tokens: row 0 from its first token
        else:
            dy_b, dy_t0 = n, 0
        init_base = n * stride_in
        acc = tl.zeros((BLOCK_C, BLOCK_K), ACC)
        for j in tl.static_range(W):
            rt = r + j
            at = kvalid & (rt >= 0) & (rt < length)
            g = _load_parts(dy, dy1, dy2, dy_b, dy_t0 + rt, c, at, e0, e1, sd0b, sd0t, sd0c, sd1b, sd1t, sd1c,
                            sd2b, sd2t, sd2c, ACC, PARTS, 1)
            dz = _dz(x, init, w0, w1, w2, w3, w, bias, g, x_base, init_base, rt, c, at, True, cmask,
                     stride_xt, stride_xc, stride_wc, stride_ww, stride_bc, stride_ic, stride_ik,
                     W, HAS_BIAS, True, SILU, ACC, 1)
            w_j = _w_at(w0, w1, w2, w3, w, c, cmask, stride_wc, stride_ww, j, W, ACC)
            acc += w_j * dz
        if HAS_DFINAL:
            kf = k - length
            acc += tl.load(dfinal + n * stride_dfn + c * stride_dfc + kf * stride_dfk,
                           mask=kvalid & (kf >= 0), other=0.0).to(ACC)
        tl.store(dinit + (n * C + c) * (W - 1) + k, acc.to(dinit.dtype.element_ty), mask=kvalid)
