"""The ``@triton.jit`` helpers the conv's forward and backward kernels share (inlined into them).

A program's token tile and channel block (``_tile``) and where those tokens sit in their sequences
(``_seq_pos``; a state kernel's sequence: ``_seq_span``); the taps: input (``_tap``, from x or the conv state)
and weight (``_w4``, ``_w_at``), and the pre-activation they sum to (``_preact``); reads and writes of a
``[B, T, C]`` tensor given whole or as three column parts (``_load_parts``, ``_store_parts``: the split conv's
q, k, v), with ``_row``'s alignment hint.
The kernels are in ``conv_fwd_kernels.py`` and ``conv_bwd_kernels.py``, their launchers in ``conv.py``.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tap(x, init, x_base, init_base, r, c, valid, near, stride_xt, stride_xc, stride_ic, stride_ik,
         W: tl.constexpr, HAS_INIT: tl.constexpr, ACC: tl.constexpr, ALIGN: tl.constexpr):
    """Input at position r of a sequence (r < 0: its conv state entry W-1+r); 0 where not valid.

    The state is read only when ``near`` (the block holds a position < 0): its channel stride is
    W-1, so these are scalar gathers that would otherwise cost more than the whole x tile.
    ``ALIGN`` (``_layout.rows_align``): every row of x starts a multiple of ALIGN elements from x, which lets
    the compiler read rows as vectors where Triton's own ``% 16`` specialisation of the row stride cannot tell
    (a row of ``C + 2 hv`` elements with hv not a multiple of 8). The hint is applied where the offset is
    computed: on a jit helper's argument ``tl.multiple_of`` has no op to mark and is lost.
    """
    row = x_base + r * stride_xt
    if ALIGN > 1:
        row = tl.multiple_of(row, [ALIGN, ALIGN])   # ([BLOCK_T, 1]: one value per dim)
    v = tl.load(x + row + c * stride_xc, mask=valid & (r >= 0), other=0.0).to(ACC)
    if HAS_INIT:
        if near:
            k = W - 1 + r
            v += tl.load(init + init_base + c * stride_ic + k * stride_ik, mask=valid & (r < 0), other=0.0).to(ACC)
    return v


@triton.jit
def _w_tap(w, c, cmask, stride_wc, stride_ww, i: tl.constexpr, W: tl.constexpr, ACC: tl.constexpr):
    """Tap i's weight (``weight[c, W-1-i]``, the input i tokens back) of channels c, in ACC; 0 for i >= W.

    The kernels load taps 0-3 once per program, before their tile loop (``_w4``): ``weight``
    is ``[C, W]``, so a tap's channels are W elements apart and each is a 2-byte load, which per tile
    would be more load instructions than the tile's own data."""
    if i < W:
        v = tl.load(w + c * stride_wc + (W - 1 - i) * stride_ww, mask=cmask, other=0.0).to(ACC)
    else:
        v = tl.zeros(c.shape, ACC)
    return v


@triton.jit
def _w4(w, c, cmask, stride_wc, stride_ww, W: tl.constexpr, ACC: tl.constexpr):
    """Taps 0-3's weights of channels c (``_w_tap``), loaded once per program."""
    return (_w_tap(w, c, cmask, stride_wc, stride_ww, 0, W, ACC), _w_tap(w, c, cmask, stride_wc, stride_ww, 1, W, ACC),
            _w_tap(w, c, cmask, stride_wc, stride_ww, 2, W, ACC), _w_tap(w, c, cmask, stride_wc, stride_ww, 3, W, ACC))


@triton.jit
def _w_at(w0, w1, w2, w3, w, c, cmask, stride_wc, stride_ww, i: tl.constexpr, W: tl.constexpr, ACC: tl.constexpr):
    """Tap i's weight: the preloaded ``w0``-``w3`` for i < 4 (``_w4``), loaded here past them (W > 4).
    (Four arguments, not a tuple: triton-ascend's frontend indexes no tuples.)"""
    if i == 0:
        v = w0
    elif i == 1:
        v = w1
    elif i == 2:
        v = w2
    elif i == 3:
        v = w3
    else:
        v = _w_tap(w, c, cmask, stride_wc, stride_ww, i, W, ACC)
    return v


@triton.jit
def _preact(x, init, w0, w1, w2, w3, w, bias, x_base, init_base, r, c, valid, near, cmask,
            stride_xt, stride_xc, stride_wc, stride_ww, stride_bc, stride_ic, stride_ik,
            W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, ACC: tl.constexpr,
            ALIGN: tl.constexpr):
    """Pre-activation z at position r of a sequence (``w0``-``w3``: taps 0-3's weights of channels c, ``_w4``)."""
    if HAS_BIAS:
        z = tl.load(bias + c * stride_bc, mask=cmask, other=0.0).to(ACC) + tl.zeros(valid.shape, ACC)
    else:
        z = tl.zeros(valid.shape, ACC)
    for i in tl.static_range(W):
        w_i = _w_at(w0, w1, w2, w3, w, c, cmask, stride_wc, stride_ww, i, W, ACC)
        z += w_i * _tap(x, init, x_base, init_base, r - i, c, valid, near, stride_xt, stride_xc, stride_ic, stride_ik,
                        W, HAS_INIT, ACC, ALIGN)
    return z


@triton.jit
def _row(b, tok, sb, st, ALIGN: tl.constexpr):
    """Offset of (batch row b, token ``tok`` [BLOCK_T, 1]) with batch / token strides ``sb``, ``st``; ``ALIGN``
    (``_layout.rows_align``): a multiple of ALIGN elements, so that rows are accessed as vectors. The hint goes on
    the token term too: packed, b is the constant 0, the sum folds away to that term, and a hint on the sum alone
    would be lost with it."""
    row = tok * st
    if ALIGN > 1:
        row = tl.multiple_of(row, [ALIGN, ALIGN])
    row = b * sb + row
    if ALIGN > 1:
        row = tl.multiple_of(row, [ALIGN, ALIGN])
    return row


@triton.jit
def _part_ptrs(p0, p1, p2, b, tok, c, e0, e1, sb0, st0, sc0, sb1, st1, sc1, sb2, st2, sc2, ALIGN: tl.constexpr):
    """Addresses of (batch row b, token ``tok``, column ``c``) of a ``[B, T, C]`` whole held as three
    parts ``[B, T, w_g]`` with strides ``(sb_g, st_g, sc_g)`` (part g has columns ``e_{g-1} .. e_g``,
    ``e_{-1} = 0``) in each part, and the column masks of the three parts. Each part is addressed with
    its own scalar strides (no select of pointers: a per-column pointer defeats vectorised access, and
    triton-ascend 3.2.0's ``triton-adapter-opt`` crashes on one)."""
    a0 = p0 + _row(b, tok, sb0, st0, ALIGN) + c * sc0
    a1 = p1 + _row(b, tok, sb1, st1, ALIGN) + (c - e0) * sc1
    a2 = p2 + _row(b, tok, sb2, st2, ALIGN) + (c - e1) * sc2
    return a0, a1, a2, c < e0, (c >= e0) & (c < e1), c >= e1


@triton.jit
def _load_parts(p0, p1, p2, b, tok, c, mask, e0, e1, sb0, st0, sc0, sb1, st1, sc1, sb2, st2, sc2,
                ACC: tl.constexpr, PARTS: tl.constexpr, ALIGN: tl.constexpr):
    """Values at (b, tok, c) of a ``[B, T, C]`` tensor given whole (``PARTS == 1``: ``p0``) or as three
    parts (``_part_ptrs``), in ACC; 0 where not ``mask``. Three masked loads, one per part. ``ALIGN``:
    ``_row``'s hint (1 where ``tok`` is not ``[BLOCK_T, 1]``)."""
    if PARTS == 1:
        return tl.load(p0 + _row(b, tok, sb0, st0, ALIGN) + c * sc0, mask=mask, other=0.0).to(ACC)
    a0, a1, a2, m0, m1, m2 = _part_ptrs(p0, p1, p2, b, tok, c, e0, e1, sb0, st0, sc0, sb1, st1, sc1, sb2, st2, sc2,
                                        ALIGN)
    v = tl.load(a0, mask=mask & m0, other=0.0).to(ACC)
    v += tl.load(a1, mask=mask & m1, other=0.0).to(ACC)
    return v + tl.load(a2, mask=mask & m2, other=0.0).to(ACC)


@triton.jit
def _store_parts(p0, p1, p2, b, tok, c, val, mask, e0, e1, sb0, st0, sc0, sb1, st1, sc1, sb2, st2, sc2,
                 PARTS: tl.constexpr, ALIGN: tl.constexpr):
    """Stores ``val`` at (b, tok, c) as ``_load_parts`` reads: three masked stores, one per part."""
    if PARTS == 1:
        tl.store(p0 + _row(b, tok, sb0, st0, ALIGN) + c * sc0, val.to(p0.dtype.element_ty), mask=mask)
    else:
        a0, a1, a2, m0, m1, m2 = _part_ptrs(p0, p1, p2, b, tok, c, e0, e1, sb0, st0, sc0, sb1, st1, sc1,
                                            sb2, st2, sc2, ALIGN)
        tl.store(a0, val.to(p0.dtype.element_ty), mask=mask & m0)
        tl.store(a1, val.to(p1.dtype.element_ty), mask=mask & m1)
        tl.store(a2, val.to(p2.dtype.element_ty), mask=mask & m2)



@triton.jit(do_not_specialize=["tile", "T"])
def _tile(tile, T, C, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Token tile ``tile`` of the ``cdiv(T, BLOCK_T) * B`` tiles (folding batch row b and token block)
    and this program's channel block (axis 1). Returns ``(b, t, c, t < T, c < C)`` with t the tile's token
    positions in row b and c its channels.

    Packed (``IS_VARLEN``, B == 1) b is the constant 0: a runtime row times a batch stride (a
    ``do_not_specialize`` argument, it changes with T) would hide the rows' 16-byte alignment from the
    compiler, which then reads and writes 2-byte elements one by one instead of 16-byte vectors."""
    if IS_VARLEN:
        b = tl.zeros((), tl.int64)
        t = (tile + tl.zeros((), tl.int64)) * BLOCK_T + tl.arange(0, BLOCK_T)
    else:
        n_tb = tl.cdiv(T, BLOCK_T)
        b = (tile // n_tb).to(tl.int64)
        t = (tile % n_tb).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    return b, t, c, t < T, c < C


@triton.jit(do_not_specialize=["stride_xb"])
def _seq_pos(t, b, tmask, seq_idx, cu, stride_xb, stride_xt, stride_in, W: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Where the tile's tokens ``t`` (of batch row b; ``_tile``) sit in their sequences: ``(x_base, init_base, r,
    near)``, the offsets of each token's sequence in x and in the conv state, its position ``r [BLOCK_T, 1]`` in
    that sequence, and whether the tile holds a position < W-1 (``_tap``'s ``near``: it reads the conv state).
    Packed (``IS_VARLEN``, B == 1) from each token's sequence index ``seq_idx`` and its start ``cu``."""
    if IS_VARLEN:  # B == 1; positions are relative to each token's own sequence start
        n = tl.load(seq_idx + t, mask=tmask, other=0).to(tl.int64)
        s = tl.load(cu + n, mask=tmask, other=0)
        x_base = (s * stride_xt)[:, None]
        init_base = (n * stride_in)[:, None]
        r1 = t - s
    else:
        x_base = b * stride_xb
        init_base = b * stride_in
        r1 = t
    near = tl.min(tl.where(tmask, r1, W)) < W - 1
    return x_base, init_base, r1[:, None], near


@triton.jit(do_not_specialize=["n32", "T", "stride_xb"])
def _seq_span(n32, cu, T, stride_xb, stride_xt, IS_VARLEN: tl.constexpr):
    """Sequence ``n32`` of a state kernel's loop: ``(n, s, length, x_base)``, its index as int64, its first token
    (packed: ``cu[n]`` of the one row; else 0 of row n), its length and that token's offset in x."""
    n = n32 + tl.zeros((), tl.int64)
    if IS_VARLEN:
        s = tl.load(cu + n)
        length = tl.load(cu + n + 1) - s
        x_base = s * stride_xt
    else:
        s = tl.zeros((), tl.int64)
        length = T + tl.zeros((), tl.int64)
        x_base = n * stride_xb
    return n, s, length, x_base
