"""Varlen depthwise causal conv1d (+ SiLU) with conv states: Triton forward, backward and autograd.

Math (per sequence n of a pack, channel c, ``W`` taps, ``xin`` = the sequence preceded by its
conv state ``initial_state[n]``, zeros when None)::

    z_t = bias_c + sum_{i=0}^{W-1} weight[c, W-1-i] * xin_{t-i}        y_t = silu(z_t) or z_t
    final_state[n] = the last W-1 entries of [initial_state[n] | x_n]     (oldest first)

Five kernels, all with one fixed config (block sizes from C, W and the variant only) and every length- or
count-derived argument (``T``, ``N``, tile counts, batch strides) a runtime argument in ``do_not_specialize``, so a new
packed layout compiles nothing:

Grids are persistent (``_grid.py``): axis 1 is the channel block, axis 0 holds at most
``65535 // cdiv(C, BLOCK_C)`` programs and program p takes tiles (or sequences) p, p + P, ... of its
axis, so no launch exceeds triton-ascend's 65 535 programs at any T or N.

- ``_conv_fwd_kernel``, over the ``cdiv(T, BLOCK_T) * B`` token tiles x channel blocks: y for a tile
  of tokens x channels, tap i read as the x tile i tokens earlier (W overlapping loads, served by the
  caches).
  With ``l2norm_dim`` (the gated delta rule's q and k) each head of that many channels is L2-normalised in
  the same pass and its factor ``rstd`` written out: the backward takes the norm's gradient from y and rstd
  (``triton/l2norm.py``, one launch) before the dz pass, with no recompute.
- ``_conv_state_fwd_kernel``, over the N sequences x channel blocks: gathers ``final_state[n]``.
- ``_conv_dz_kernel``, over its own tiles (``DZ_BLOCK_T`` or ``DZ_BLOCK_T_PLAIN`` x ``_dz_block_c(C)``): the
  pre-activation's gradient dz (z recomputed from x; the forward saves nothing but its inputs) into a ``[B, T, C]``
  scratch buffer, plus each
  program's partial sums of dweight and dbias over its tiles (summed over the programs in torch
  afterwards: deterministic, no atomics). Without bias and initial states (the layer's conv in training) about
  one wave of programs, each software-pipelining its tiles' loads (``DZ_PROGRAMS_PLAIN``, ``DZ_NUM_STAGES_PLAIN``).
- ``_conv_dx_kernel``, over the plain forward's tiles (the other forward's with dfinal):
  ``dx_p = sum_j weight[:, W-1-j] dz_{p+j}`` (+ dfinal). Two passes instead of one: a fused pass had to
  recompute z at each of the W shifts (W^2 taps per element) and spilled registers; the scratch round trip
  costs less.
- ``_conv_state_bwd_kernel``, over the N sequences x channel blocks: ``d initial_state[n]``, with the
  dz of the sequence's first W-1 tokens recomputed in fp32 (the scratch dz may be 16-bit).

With ``cu`` (packed, B == 1) each token's sequence index comes from ``torch.searchsorted`` on the
device (no host sync). x is read in place through its strides (typically a channel slice of a wider
buffer); y comes back contiguous, dx contiguous or into a given column slice. Math in fp32, or in float64
when any input is float64.
The kernels use no CUDA-only intrinsics and run under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import cu_cache, reference
from . import _grid
from ._grid import cdiv, next_power_of_2, programs
from ._layout import narrow_offsets, out_buffer, row_strides, rows_align
from .l2norm import EPS as L2NORM_EPS
from .l2norm import l2norm_bwd_from_output

# Measured on an H200 (benchmarks/bench_triton_conv.py, C = 8192, W = 4, bf16): 32 x 64 tiles with 4 warps
# were the fastest of those tried; the backward spills registers from 64 x 64 up (4-5x slower).
# Session 16, after the 16-byte accesses (bench_triton_conv.py --sweep, 32k tokens): the layer's variant
# (neither bias nor initial states) runs its forward in 0.401 ms with 16 x 128 tiles against 0.504 ms with
# 32 x 64, and the backward (dz pass unchanged, dx pass on these tiles) in 1.200 against 1.326 ms; with bias
# and initial states the forward is slower on 16 x 128 (1.264 against 1.019 ms). So the forward takes
# PLAIN_BLOCK_T x 128-channel tiles without bias and initial states, BLOCK_T x 64 otherwise, and the dx pass
# the plain tiles unless it adds dfinal (its 16 x 128 variant spills 8 bytes of registers on sm_90, 32 x 64 none).
BLOCK_T = 32
PLAIN_BLOCK_T = 16
NUM_WARPS = 4
# programs of the backward's dz pass over all channel blocks (it takes cdiv(tiles, programs) tiles each): with
# bias or initial states DZ_PROGRAMS, without either (the layer's conv in training) DZ_PROGRAMS_PLAIN, about one
# wave of an H200's 132 SMs, each program pipelining its many tiles (DZ_NUM_STAGES_PLAIN below)
DZ_PROGRAMS = 8192
DZ_PROGRAMS_PLAIN = 512
# the dz pass's own tile and warps (it holds five [DZ_BLOCK_T, block] accumulators); its channel block is
# _dz_block_c(C). H200, benchmarks/bench_triton_conv.py --sweep (C = 8192, bf16, 32k tokens, with bias and
# initial states): backward 3.30 ms with 16 x 64 tiles on 2 warps, 4.02 ms with 32 x 64 on 4. That variant
# takes 255 registers and spills on both tiles (sm_90, Triton 3.7.1); the layer's conv has neither bias nor
# (in training) initial states: 184-190 registers, no spill on either tile. So the sweep may not carry over.
# Session 15 (H200, the same bench after the 16-byte accesses and the hoisted tap weights; the layer's variant,
# neither bias nor initial states): 1.325 ms with 16 x 64 tiles on 4 warps, 1.538 ms with 32 x 64 on 4 (with
# both: 4.01 / 3.56 ms). So the plain variant takes DZ_BLOCK_T_PLAIN, the other DZ_BLOCK_T.
DZ_BLOCK_T = 32
DZ_BLOCK_T_PLAIN = 16
# (Not kept: the q / k L2 norm's backward inside the dz pass, y and rstd recomputed in a one-head tile. H200,
# session 23, Qwen3-Next's q and k at 32k: 0.915 / 1.132 / 0.993 ms at 8 / 4 / 16 x 128 tiles against 0.764 for the
# separate ``l2norm_bwd_from_output`` launch + plain dz pass; patch in docs/measurements/h200_issue23_s23/.)
DZ_NUM_WARPS = 4
# software pipelining of the dz pass's tile loop (``tl.range(num_stages=)``): 1 compiles the plain loop (the same
# PTX as ``range``); from 2 Triton prefetches the next tiles' x and dy through shared memory (cp.async), which
# only pays where a program takes several tiles. Session 18, H200, benchmarks/bench_triton_conv.py --stages (32k
# tokens; ms of the backward, dz and dx passes): the layer's three convs of Qwen3-Next (no bias or states) 1.382
# at 1 stage and 8 192 programs, 1.202 at 1 stage and 512, **1.124 at 3 stages and 512** (2 stages 1.171, 4:
# 1.180-1.245); with bias and initial states pipelining is 3.5-5x slower (11.97-17.39 against 3.43 ms) and
# 8 192 programs stay best. So the plain variant takes DZ_NUM_STAGES_PLAIN (on CUDA with 16-bit inputs and W <= 4
# only, ``_stages``) and DZ_PROGRAMS_PLAIN.
DZ_NUM_STAGES = 1
DZ_NUM_STAGES_PLAIN = 3
# the same two knobs of the forward and of the dx pass (all their variants). Session 19, H200,
# benchmarks/bench_triton_conv.py --stages-fwd-dx (32k tokens, the layer's three convs of Qwen3-Next): the forward
# 0.458 ms with one tile per program (65 535 programs) against 0.395 ms with 4 096 programs on the plain loop,
# the dx pass 1.125 against 1.083 (software pipelining, 2-4 stages, helped neither). So 4 096 and 1 stage.
FWD_PROGRAMS = DX_PROGRAMS = 4096
FWD_NUM_STAGES = DX_NUM_STAGES = 1


def _block_c(C: int) -> int:
    return min(64, max(16, next_power_of_2(C)))


def _plain_block_c(C: int) -> int:
    """Channel block of the plain forward and of the dx pass (``PLAIN_BLOCK_T`` tokens)."""
    return min(128, max(16, next_power_of_2(C)))


def _dz_block_c(C: int) -> int:
    return _block_c(C)


def _tile_shape(C: int, plain: bool) -> tuple[int, int]:
    """``(BLOCK_T, BLOCK_C)`` of the forward and the dx pass: the plain tile (``PLAIN_BLOCK_T`` x
    ``_plain_block_c``) for the forward without bias and initial states and the dx pass without dfinal, else
    ``BLOCK_T`` x ``_block_c``."""
    return (PLAIN_BLOCK_T, _plain_block_c(C)) if plain else (BLOCK_T, _block_c(C))


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
        r = r1[:, None]
        near = tl.min(tl.where(tmask, r1, W)) < W - 1
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
        n = n32 + tl.zeros((), tl.int64)
        if IS_VARLEN:
            s = tl.load(cu + n)
            length = tl.load(cu + n + 1) - s
            x_base = s * stride_xt
        else:
            length = T + tl.zeros((), tl.int64)
            x_base = n * stride_xb
        v = _tap(x, init, x_base, n * stride_in, length - (W - 1) + k, c, valid, True, stride_xt, stride_xc,
                 stride_ic, stride_ik, W, HAS_INIT, ACC, 1)
        tl.store(final + (n * C + c) * (W - 1) + k, v, mask=valid)


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
        if IS_VARLEN:
            n = tl.load(seq_idx + t, mask=tmask, other=0).to(tl.int64)
            s = tl.load(cu + n, mask=tmask, other=0)
            x_base = (s * stride_xt)[:, None]
            init_base = (n * stride_in)[:, None]
            r1 = t - s
        else:
            x_base = b * stride_xb
            init_base = b * stride_in
            r1 = t
        r = r1[:, None]
        near = tl.min(tl.where(tmask, r1, W)) < W - 1
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
        n = n32 + tl.zeros((), tl.int64)
        if IS_VARLEN:
            s = tl.load(cu + n)
            length = tl.load(cu + n + 1) - s
            x_base = s * stride_xt
            dy_b, dy_t0 = 0, s        # dy of the sequence's tokens: row 0 from its first token
        else:
            length = T + tl.zeros((), tl.int64)
            x_base = n * stride_xb
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


def _stages(stages: int, x: torch.Tensor, W: int) -> int:
    """``stages`` where the pipelining was measured, on CUDA with 16-bit inputs and W <= 4 (the layer's
    conv); 1 (the plain loop) otherwise: Ascend's compiler reads ``num_stages`` its own way, and with 8-byte
    inputs and W >= 6, or fp32 and W = 16, three stages of prefetched taps exceed an H200's 227 KB of shared
    memory (sm_90 compile on the CPU)."""
    return stages if _grid.on_cuda(x) and x.element_size() <= 2 and W <= 4 else 1


def _compute_dtype(*tensors):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _seq_index(cu, T):
    """Per-token sequence index of a pack (the last n with cu[n] <= t: empty segments are skipped), on
    device; computed once per ``cu`` tensor and T (``cu_cache``), shared by the forward and backward
    of every conv that sees this pack."""
    if cu is None:
        return None
    return cu_cache.derived(cu, ("conv_seq_index", T), lambda: torch.searchsorted(
        cu, torch.arange(T, device=cu.device, dtype=cu.dtype), right=True, out_int32=True) - 1)


def _strides3(t):
    return (0, 0, 0) if t is None else t.stride()


def _narrow_params(weight, bias, initial_state):
    """``weight [C, W]``, ``bias [C]``, ``initial_state [N, C, W - 1]`` through ``narrow_offsets`` (the
    kernels' channel and tap offsets are 32-bit)."""
    return narrow_offsets(weight, (0, 1)), narrow_offsets(bias, (0,)), narrow_offsets(initial_state, (1, 2))


def _as_parts(whole_or_parts, C):
    """``(args, PARTS)``: the ``_load_parts`` / ``_store_parts`` arguments ``(p0, p1, p2, e0, e1, *strides of
    the three)`` for a ``[B, T, C]`` tensor given whole (``PARTS`` 1) or as a list of 1-3 ``[B, T, w]`` parts
    with widths summing to C (``PARTS`` 3). An empty part takes another's pointer (never read: its columns
    are empty)."""
    if isinstance(whole_or_parts, torch.Tensor):
        t = whole_or_parts
        return (t, t, t, C, C, *t.stride(), *t.stride(), *t.stride()), 1
    parts = list(whole_or_parts)
    widths = [p.shape[-1] for p in parts] + [0] * (3 - len(parts))
    held = next((p for p in parts if p.numel() > 0), parts[0])   # (all empty: T = 0, only the state's pass runs)
    parts = [p if p.numel() > 0 else held for p in parts] + [held] * (3 - len(parts))
    e0, e1 = widths[0], widths[0] + widths[1]
    return (*parts, e0, e1, *(st for p in parts for st in p.stride())), 3


def _l2norm_fused(l2norm_dim, C, bias, initial_state, split_sizes) -> bool:
    """Whether the forward kernel normalises the output heads itself (``L2_D``): the layer's conv (no bias, no
    initial state, one part) with a power-of-two head dim of at most ``_plain_block_c``'s 128 channels, so
    that every channel block holds whole heads. Else the launcher normalises in torch after the conv.

    Raises:
        ValueError: ``l2norm_dim`` does not divide C, or comes with ``split_sizes``.
    """
    if not l2norm_dim:
        return False
    if l2norm_dim < 0 or C % l2norm_dim:
        raise ValueError(f"l2norm_dim must be a positive divisor of the channel count {C}, got {l2norm_dim}")
    if split_sizes is not None:
        raise ValueError("l2norm_dim normalises a whole conv's output; it does not go with split_sizes")
    return (bias is None and initial_state is None and l2norm_dim <= 128
            and l2norm_dim & (l2norm_dim - 1) == 0)


def _heads(t, D):
    """``[B, T, C]`` as ``[B, T, C // D, D]`` (a view)."""
    return t.unflatten(-1, (-1, D))


def causal_conv1d_fwd(x, weight, bias, cu, initial_state, activation, output_final_state, split_sizes=None,
                      l2norm_dim=0):
    """Forward launcher (inputs already validated).

    Args: x ``[B, T, C]`` (any strides; read in place), weight ``[C, W]``, bias ``[C]`` or None,
    cu int64 ``[N + 1]`` on x's device (B == 1) or None, initial_state ``[N, C, W - 1]`` or None,
    activation ``"silu"``/``"swish"`` or None/``"identity"``; split_sizes: None, or 1-3 channel counts
    summing to C (q, k, v of the layer), to get y as that many contiguous tensors in one launch;
    l2norm_dim: 0, or a divisor D of C: y is L2-normalised over each head of D channels after the activation,
    ``y * rstd`` with ``rstd = 1 / sqrt(sum_head y^2 + 1e-6)`` (the gated delta rule's q / k norm, fla's
    ``l2norm``), in the kernel where ``_l2norm_fused`` allows (the layer's conv), else in torch after it.
    Returns ``(y, final_state [N, C, W - 1] fp32 (float64 when any input is float64) or None)``, y
    ``[B, T, C]`` contiguous in x's dtype, or with ``split_sizes`` a list of ``[B, T, size]``; with
    ``l2norm_dim`` ``(y, final_state, rstd [B, T, C // D])`` (fp32, or float64), which ``causal_conv1d_bwd``
    takes back with y as ``l2norm_out``.
    """
    B, T, C = x.shape
    if l2norm_dim and not _l2norm_fused(l2norm_dim, C, bias, initial_state, split_sizes):
        y, final = causal_conv1d_fwd(x, weight, bias, cu, initial_state, activation, output_final_state)
        h = _heads(y, l2norm_dim).to(_compute_dtype(x, weight, bias, initial_state))
        rstd = reference.l2norm_rstd(h, L2NORM_EPS)
        return (h * rstd[..., None]).flatten(-2).to(x.dtype), final, rstd
    l2_d = l2norm_dim
    x = narrow_offsets(x)
    weight, bias, initial_state = _narrow_params(weight, bias, initial_state)
    W = weight.shape[1]
    N = B if cu is None else cu.shape[0] - 1
    dt = _compute_dtype(x, weight, bias, initial_state)
    acc = tl.float64 if dt == torch.float64 else tl.float32
    silu = activation in ("silu", "swish")
    if split_sizes is None:
        y = torch.empty(B, T, C, dtype=x.dtype, device=x.device)
    else:
        y = [torch.empty(B, T, w, dtype=x.dtype, device=x.device) for w in split_sizes]
    dummy = x
    rstd = torch.empty(B, T, C // l2_d, dtype=dt, device=x.device) if l2_d else None
    sin = _strides3(initial_state)
    block_c = _block_c(C)
    n_cb = cdiv(C, block_c)
    if B * T > 0 and C > 0:
        tile_t, tile_c = _tile_shape(C, bias is None and initial_state is None)
        assert tile_c % max(l2_d, 1) == 0   # (_l2norm_fused: whole heads per channel block)
        n_tiles, n_tcb = cdiv(T, tile_t) * B, cdiv(C, tile_c)
        y_parts, parts = _as_parts(y, C)
        _conv_fwd_kernel[(programs(n_tiles, n_tcb, FWD_PROGRAMS), n_tcb)](
            x, weight, dummy if bias is None else bias, dummy if initial_state is None else initial_state,
            dummy if cu is None else _seq_index(cu, T), dummy if cu is None else cu, *y_parts,
            T, n_tiles, C, x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1),
            0 if bias is None else bias.stride(0), *sin, dummy if rstd is None else rstd, L2NORM_EPS,
            W=W, HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, IS_VARLEN=cu is not None,
            SILU=silu, ACC=acc, BLOCK_T=tile_t, BLOCK_C=tile_c, PARTS=parts, X_ALIGN=rows_align([x], 2),
            Y_ALIGN=rows_align(y_parts[:3], 2), STAGES=FWD_NUM_STAGES, L2_D=l2_d, num_warps=NUM_WARPS)
    final = None
    if output_final_state:
        final = torch.empty(N, C, W - 1, dtype=dt, device=x.device)
        if final.numel() > 0:
            _conv_state_fwd_kernel[(programs(N, n_cb), n_cb)](
                x, dummy if initial_state is None else initial_state, dummy if cu is None else cu, final,
                T, N, C, x.stride(0), x.stride(1), x.stride(2), *sin,
                W=W, HAS_INIT=initial_state is not None, IS_VARLEN=cu is not None, ACC=acc,
                BLOCK_K=next_power_of_2(W - 1), BLOCK_C=block_c)
    return (y, final) if not l2_d else (y, final, rstd)


def causal_conv1d_bwd(dy, dfinal, x, weight, bias, cu, initial_state, activation, dx=None, l2norm_out=None):
    """Backward launcher: ``(dx, dweight, dbias, dinitial)``, each in its input's dtype.

    dy ``[B, T, C]``, or the list of ``[B, T, size]`` gradients of a ``split_sizes`` forward's outputs,
    and dfinal ``[N, C, W - 1]`` (or None) may have any strides. dbias is None
    without bias, dinitial None without initial_state. dweight and dbias are per-program partial sums
    of the dz pass, reduced in torch (deterministic).

    dx: None (a new contiguous ``[B, T, C]`` comes back), or a ``[B, T, C]`` tensor of x's dtype with unit
    channel stride to write dx into (a column slice of the layer's ``[q | k | v | a | b]`` gradient: no
    concatenation afterwards); it comes back as the first result.

    l2norm_out: None, or ``(y, rstd)`` of a forward with ``l2norm_dim`` (dy a tensor, the gradient of that
    normalised y): first through the norm from the saved pair, without recomputing the conv
    (``triton/l2norm.py``'s ``l2norm_bwd_from_output``, one launch), then the conv's backward.
    """
    B, T, C = x.shape
    if l2norm_out is not None and C > 0:
        y, rstd = l2norm_out
        D = C // rstd.shape[-1]
        dy = l2norm_bwd_from_output(_heads(y, D), rstd, _heads(dy, D)).flatten(-2)
    x = narrow_offsets(x)
    dy = narrow_offsets(dy) if isinstance(dy, torch.Tensor) else [narrow_offsets(d) for d in dy]
    weight, bias, initial_state = _narrow_params(weight, bias, initial_state)
    dfinal = narrow_offsets(dfinal, (1, 2))
    W = weight.shape[1]
    N = B if cu is None else cu.shape[0] - 1
    dt = _compute_dtype(x, weight, bias, initial_state)
    acc = tl.float64 if dt == torch.float64 else tl.float32
    silu = activation in ("silu", "swish")
    block_c, dz_block_c = _block_c(C), _dz_block_c(C)
    # the dx pass on the plain forward's tile; with dfinal on the other (16 x 128 spills 8 bytes there, 32 x 64 not)
    dx_block_t, dx_block_c = _tile_shape(C, dfinal is None)
    n_cb, dz_n_cb, dx_n_cb = cdiv(C, block_c), cdiv(C, dz_block_c), cdiv(C, dx_block_c)
    plain = bias is None and initial_state is None     # the layer's conv in training: its own dz-pass settings
    dz_block_t = DZ_BLOCK_T_PLAIN if plain else DZ_BLOCK_T
    dz_stages = _stages(DZ_NUM_STAGES_PLAIN, x, W) if plain else DZ_NUM_STAGES
    dz_programs = DZ_PROGRAMS_PLAIN if plain else DZ_PROGRAMS
    n_tiles, dz_n_tiles = cdiv(T, dx_block_t) * B, cdiv(T, dz_block_t) * B
    # the dz pass reduces its dweight / dbias sums once per program: at most about DZ_PROGRAMS(_PLAIN) programs
    # (each taking several tiles at long T), the dx pass one tile per program where the grid allows
    n_prog = programs(dz_n_tiles, dz_n_cb, dz_programs) if C > 0 else 0
    dx = out_buffer(dx, x, "dx")
    # dz in fp32 (float64) for fp32/fp64 inputs; in the 16-bit input dtype otherwise: it only feeds dx,
    # which is rounded to that dtype anyway (dweight and dbias are summed from the fp32 values in
    # registers, and the fp32 initial-state gradient recomputes the dz it needs)
    dz = torch.empty(B, T, C, dtype=dt if x.element_size() >= 4 else x.dtype, device=x.device)
    # every entry is written (a program's channels past C are masked, and those are not in the buffer)
    dw_part = torch.empty(n_prog, C, W, dtype=dt, device=x.device)
    db_part = torch.empty(n_prog, C, dtype=dt, device=x.device)
    dummy = x
    sin, sdf = _strides3(initial_state), _strides3(dfinal)
    flags = dict(W=W, IS_VARLEN=cu is not None, ACC=acc)
    dy_parts, parts = _as_parts(dy, C)
    seq_idx = dummy if cu is None else _seq_index(cu, T)
    cu_arg, df_arg = (dummy if cu is None else cu), (dummy if dfinal is None else dfinal)
    if n_prog > 0 and C > 0:
        _conv_dz_kernel[(n_prog, dz_n_cb)](
            x, weight, dummy if bias is None else bias, dummy if initial_state is None else initial_state,
            seq_idx, cu_arg, *dy_parts, dz, dw_part, db_part,
            T, dz_n_tiles, C, x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1),
            0 if bias is None else bias.stride(0), *sin,
            HAS_BIAS=bias is not None, HAS_INIT=initial_state is not None, SILU=silu, BLOCK_T=dz_block_t,
            BLOCK_C=dz_block_c, BLOCK_W=next_power_of_2(W), PARTS=parts, X_ALIGN=rows_align([x], 2),
            DY_ALIGN=rows_align(dy_parts[:3], 2), STAGES=dz_stages, num_warps=DZ_NUM_WARPS, **flags)
        _conv_dx_kernel[(programs(n_tiles, dx_n_cb, DX_PROGRAMS), dx_n_cb)](
            weight, seq_idx, cu_arg, dz, df_arg, dx, T, n_tiles, C, weight.stride(0), weight.stride(1), *sdf,
            *row_strides(dx, 2), HAS_DFINAL=dfinal is not None, BLOCK_T=dx_block_t, BLOCK_C=dx_block_c,
            DX_ALIGN=rows_align([dx], 2), STAGES=DX_NUM_STAGES, num_warps=NUM_WARPS, **flags)
    dinit = None
    if initial_state is not None:
        dinit = torch.empty(N, C, W - 1, dtype=initial_state.dtype, device=x.device)
        if dinit.numel() > 0:
            # recomputes dz of each sequence's first W-1 tokens in fp32 (dz above may be 16-bit)
            _conv_state_bwd_kernel[(programs(N, n_cb), n_cb)](
                x, weight, dummy if bias is None else bias, initial_state, cu_arg, *dy_parts, df_arg, dinit,
                T, N, C, x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1),
                0 if bias is None else bias.stride(0), *sin, *sdf,
                HAS_BIAS=bias is not None, HAS_DFINAL=dfinal is not None, SILU=silu,
                BLOCK_K=next_power_of_2(W - 1), BLOCK_C=block_c, PARTS=parts, num_warps=NUM_WARPS, **flags)
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = None if bias is None else db_part.sum(0).to(bias.dtype)
    return dx, dweight, dbias, dinit


class CausalConv1dFunction(torch.autograd.Function):
    """Ties ``causal_conv1d_fwd`` and ``causal_conv1d_bwd``; saves only the inputs (x as the view it came as)."""

    @staticmethod
    def forward(ctx, x, weight, bias, cu, initial_state, activation, output_final_state, l2norm_dim=0):
        y, final, *rstd = causal_conv1d_fwd(x, weight, bias, cu, initial_state, activation, output_final_state,
                                            l2norm_dim=l2norm_dim)
        ctx.save_for_backward(x, weight, bias, cu, initial_state, *((y, *rstd) if l2norm_dim else ()))
        ctx.activation = activation
        return y, final

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, weight, bias, cu, initial_state, *l2norm_out = ctx.saved_tensors
        dx, dweight, dbias, dinit = causal_conv1d_bwd(dy, dfinal, x, weight, bias, cu, initial_state, ctx.activation,
                                                      l2norm_out=l2norm_out or None)
        return dx, dweight, dbias, None, dinit, None, None, None


def causal_conv1d(x, weight, bias=None, activation="silu", cu=None, initial_state=None, output_final_state=False,
                  l2norm_dim=0):
    """Depthwise causal conv1d (+ SiLU) over packed sequences, differentiable; the contract of
    ``kernels.reference.causal_conv1d`` (inputs already validated).

    x ``[B, T, C]`` bf16/fp16/fp32/fp64 with unit channel stride (any other strides, read in place),
    weight ``[C, W]``, bias ``[C]`` or None, cu int64 ``[N + 1]`` (B == 1) or None, initial_state
    ``[N, C, W - 1]`` or None; l2norm_dim: 0, or y L2-normalised per head of that many channels
    (``causal_conv1d_fwd``). Returns ``(y [B, T, C] in x's dtype, final_state [N, C, W - 1] or
    None)``; math and final state in fp32 (float64 when any input is float64).
    """
    return CausalConv1dFunction.apply(x, weight, bias, cu, initial_state, activation, output_final_state, l2norm_dim)
