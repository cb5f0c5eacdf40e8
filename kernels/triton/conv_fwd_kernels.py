"""The conv's forward kernels (launched by ``conv.py``'s ``causal_conv1d_fwd``; shared helpers in
``conv_tiles.py``).

- ``_conv_fwd_kernel``, over the ``cdiv(T, BLOCK_T) * B`` token tiles x channel blocks: y for a tile
  of tokens x channels, tap i read as the x tile i tokens earlier (W overlapping loads, served by the
  caches).
  With ``l2norm_dim`` (the gated delta rule's q and k) each head of that many channels is L2-normalised in
  the same pass and its factor ``rstd`` written out: the backward takes the norm's gradient from y and rstd
  (``triton/l2norm.py``, one launch) before the dz pass, with no recompute.
- ``_conv_state_fwd_kernel``, over the N sequences x channel blocks: gathers ``final_state[n]``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .conv_tiles import _preact, _seq_pos, _seq_span, _store_parts, _tap, _tile, _w4


@triton.jit
def _head_sum(v, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr):
    """The sum over each head of D consecutive channels of ``v [BLOCK_T, BLOCK_C]`` (a channel block holds whole
    heads: ``BLOCK_C`` a multiple of D), ``[BLOCK_T, BLOCK_C // D]``: a row sum ``[BLOCK_T, 1]`` where the block is
    one head (no reshape)."""
    if BLOCK_C == D:
        out = tl.sum(v, 1)[:, None]
    else:
        out = tl.sum(tl.reshape(v, (BLOCK_T, BLOCK_C // D, D)), 2)
    return out


@triton.jit
def _head_rstd(v, eps, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr):
    """``1 / sqrt(sum v^2 + eps)`` over each head of ``v`` (``_head_sum``'s shape)."""
    return 1.0 / tl.sqrt(_head_sum(v * v, BLOCK_T, BLOCK_C, D) + eps)


@triton.jit
def _per_channel(h, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, D: tl.constexpr):
    """``h [BLOCK_T, BLOCK_C // D]`` (one value per head) on every channel of its head: ``[BLOCK_T, BLOCK_C]``
    (or ``[BLOCK_T, 1]``, broadcasting, where the block is one head)."""
    if BLOCK_C == D:
        out = h
    else:
        out = tl.reshape(tl.broadcast_to(h[:, :, None], (BLOCK_T, BLOCK_C // D, D)), (BLOCK_T, BLOCK_C))
    return out



@triton.jit(do_not_specialize=["T", "NT", "stride_xb", "sy0b", "sy1b", "sy2b"])
def _conv_fwd_kernel(x, w, bias, init, seq_idx, cu, y, y1, y2, e0, e1, sy0b, sy0t, sy0c, sy1b, sy1t, sy1c,
                     sy2b, sy2t, sy2c, T, NT, C, stride_xb, stride_xt, stride_xc, stride_wc, stride_ww, stride_bc,
                     stride_in, stride_ic, stride_ik, rstd, eps,
                     W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, IS_VARLEN: tl.constexpr,
                     SILU: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                     PARTS: tl.constexpr, X_ALIGN: tl.constexpr, Y_ALIGN: tl.constexpr, STAGES: tl.constexpr,
                     L2_D: tl.constexpr):
    """y for token tiles p, p + P, ... (of the NT = ``cdiv(T, BLOCK_T) * B``; P programs on axis 0) and
    channel block ``program_id(1)``; a tile is tokens [tb*BLOCK_T, +BLOCK_T) of batch row b. y is
    written as the parts ``y, y1, y2`` split at columns ``e0, e1`` (``_store_parts``). ``L2_D`` > 0: each
    head of that many channels L2-normalised after the activation (``y / sqrt(sum_head y^2 + eps)``), the
    factor written to ``rstd [B * T, C // L2_D]`` fp32 for the backward."""
    cw = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    w0, w1, w2, w3 = _w4(w, cw[None, :], (cw < C)[None, :], stride_wc, stride_ww, W, ACC)
    for tile in tl.range(tl.program_id(0), NT, tl.num_programs(0), num_stages=STAGES):   # (FWD_NUM_STAGES)
        b, t, c, tmask, cmask = _tile(tile, T, C, BLOCK_T, BLOCK_C, IS_VARLEN)
        x_base, init_base, r, near = _seq_pos(t, b, tmask, seq_idx, cu, stride_xb, stride_xt, stride_in, W, IS_VARLEN)
        valid = tmask[:, None] & cmask[None, :]
        z = _preact(x, init, w0, w1, w2, w3, w, bias, x_base, init_base, r, c[None, :], valid, near, cmask[None, :],
                    stride_xt, stride_xc, stride_wc, stride_ww, stride_bc, stride_ic, stride_ik,
                    W, HAS_BIAS, HAS_INIT, ACC, X_ALIGN)
        if SILU:
            z = z / (1.0 + tl.exp(-z))
        if L2_D > 0:
            r_head = _head_rstd(z, eps, BLOCK_T, BLOCK_C, L2_D)
            z = z * _per_channel(r_head, BLOCK_T, BLOCK_C, L2_D)
            head = tl.program_id(1) * (BLOCK_C // L2_D) + tl.arange(0, BLOCK_C // L2_D)
            tl.store(rstd + (b * T + t)[:, None] * (C // L2_D) + head[None, :], r_head,
                     mask=tmask[:, None] & (head < C // L2_D)[None, :])
        _store_parts(y, y1, y2, b, t[:, None], c[None, :], z, valid, e0, e1, sy0b, sy0t, sy0c, sy1b, sy1t, sy1c,
                     sy2b, sy2t, sy2c, PARTS, Y_ALIGN)


@triton.jit(do_not_specialize=["T", "N", "stride_xb"])
def _conv_state_fwd_kernel(x, init, cu, final, T, N, C, stride_xb, stride_xt, stride_xc, stride_in, stride_ic,
                           stride_ik, W: tl.constexpr, HAS_INIT: tl.constexpr, IS_VARLEN: tl.constexpr,
                           ACC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """final_state[n, c, k] for sequences n = p, p + P, ... (P programs on axis 0) and a block of
    channels (all W-1 entries k)."""
    c = (tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C))[:, None]
    k = tl.arange(0, BLOCK_K)[None, :]
    # entry k is input W-1+k-... of [init | x_n]: relative position length-(W-1)+k (< 0: still in init)
    valid = (c < C) & (k < W - 1)
    for n32 in range(tl.program_id(0), N, tl.num_programs(0)):
        n, _, length, x_base = _seq_span(n32, cu, T, stride_xb, stride_xt, IS_VARLEN)
        v = _tap(x, init, x_base, n * stride_in, length - (W - 1) + k, c, valid, True, stride_xt, stride_xc,
                 stride_ic, stride_ik, W, HAS_INIT, ACC, 1)
        tl.store(final + (n * C + c) * (W - 1) + k, v, mask=valid)
