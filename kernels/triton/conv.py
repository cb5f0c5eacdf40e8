"""Varlen depthwise causal conv1d (+ SiLU) with conv states: the Triton launchers, their tuning and autograd.

Math (per sequence n of a pack, channel c, ``W`` taps, ``xin`` = the sequence preceded by its
conv state ``initial_state[n]``, zeros when None)::

    z_t = bias_c + sum_{i=0}^{W-1} weight[c, W-1-i] * xin_{t-i}        y_t = silu(z_t) or z_t
    final_state[n] = the last W-1 entries of [initial_state[n] | x_n]     (oldest first)

Five kernels, all with one fixed config (block sizes from C, W and the variant only) and every length- or
count-derived argument (``T``, ``N``, tile counts, batch strides) a runtime argument in ``do_not_specialize``, so a new
packed layout compiles nothing: the forward's in ``conv_fwd_kernels.py``, the backward's in
``conv_bwd_kernels.py``, the helpers they share in ``conv_tiles.py``; this module chooses their tiles and
grids and launches them (argument preparation in ``conv_args.py``).

Grids are persistent (``_grid.py``): axis 1 is the channel block, axis 0 holds at most
``65535 // cdiv(C, BLOCK_C)`` programs and program p takes tiles (or sequences) p, p + P, ... of its
axis, so no launch exceeds triton-ascend's 65 535 programs at any T or N.

With ``cu`` (packed, B == 1) each token's sequence index comes from ``torch.searchsorted`` on the
device (no host sync). x is read in place through its strides (typically a channel slice of a wider
buffer); y comes back contiguous, dx contiguous or into a given column slice. Math in fp32, or in float64
when any input is float64.
The kernels use no CUDA-only intrinsics and run under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
import triton.language as tl

from .. import reference
from . import _grid
from ._grid import cdiv, next_power_of_2, programs
from ._layout import narrow_offsets, out_buffer, row_strides, rows_align
from .conv_args import _as_parts, _compute_dtype, _heads, _narrow_params, _seq_index, _strides3
from .conv_bwd_kernels import _conv_dx_kernel, _conv_dz_kernel, _conv_state_bwd_kernel
from .conv_fwd_kernels import _conv_fwd_kernel, _conv_state_fwd_kernel
from .l2norm import EPS as L2NORM_EPS
from .l2norm import l2norm_bwd_from_output

# Tiles of the forward and of the dx pass. Without bias and initial states (the layer's conv) the forward takes
# PLAIN_BLOCK_T x 128 channels (``_plain_block_c``): 0.401 ms against 0.504 ms on 32 x 64, and the backward with
# the dx pass on them 1.200 against 1.326 ms. With bias and initial states 16 x 128 is slower (1.264 against
# 1.019 ms), so that forward takes BLOCK_T x 64 (``_block_c``) on NUM_WARPS warps, the fastest of the tiles tried,
# and so does the dx pass that adds dfinal (16 x 128 spills 8 bytes of registers there on sm_90, 32 x 64 none).
# From 64 x 64 up the backward spills registers (4-5x slower).
# H200, C = 8192, W = 4, bf16, 32k tokens, 2026-12-02: ``python benchmarks/bench_triton_conv.py --sweep``.
BLOCK_T = 32
PLAIN_BLOCK_T = 16
NUM_WARPS = 4
# programs of the backward's dz pass over all channel blocks (it takes cdiv(tiles, programs) tiles each): with
# bias or initial states DZ_PROGRAMS, without either (the layer's conv in training) DZ_PROGRAMS_PLAIN, about one
# wave of an H200's 132 SMs, each program pipelining its many tiles (DZ_NUM_STAGES_PLAIN below)
DZ_PROGRAMS = 8192
DZ_PROGRAMS_PLAIN = 512
# the dz pass's own tile and warps (it holds five [DZ_BLOCK_T, block] accumulators); its channel block is
# _dz_block_c(C). Without bias and initial states (the layer's conv in training: 184-190 registers, no spill)
# 16 x 64 tiles run in 1.325 ms against 1.538 ms on 32 x 64; with both (255 registers, spilling on either tile
# on sm_90, Triton 3.7.1) 32 x 64 is the faster (3.56 against 4.01 ms). So the plain variant takes
# DZ_BLOCK_T_PLAIN, the other DZ_BLOCK_T. H200, C = 8192, W = 4, bf16, 32k tokens, 4 warps, 2026-12-02:
# ``python benchmarks/bench_triton_conv.py --sweep``.
DZ_BLOCK_T = 32
DZ_BLOCK_T_PLAIN = 16
DZ_NUM_WARPS = 4
# (The q / k L2 norm's backward is a launch of its own, ``l2norm_bwd_from_output``, before the plain dz pass: taken
# into the dz pass, y and rstd recomputed in a one-head tile, it cost 0.915 / 1.132 / 0.993 ms at 8 / 4 / 16 x 128
# tiles against 0.764 ms for the two launches. H200, Qwen3-Next's q and k at 32k tokens, 2026-12-03; the patch
# measured is in docs/measurements/2026-12-03-h200-c/.)

# software pipelining of the dz pass's tile loop (``tl.range(num_stages=)``): 1 compiles the plain loop (the same
# PTX as ``range``); from 2 Triton prefetches the next tiles' x and dy through shared memory (cp.async), which
# only pays where a program takes several tiles. Backward, dz and dx passes of the layer's three convs of
# Qwen3-Next (no bias or states): 1.382 ms at 1 stage and 8 192 programs, 1.202 at 1 stage and 512, **1.124 at 3
# stages and 512** (2 stages 1.171, 4: 1.180-1.245); with bias and initial states pipelining is 3.5-5x slower
# (11.97-17.39 against 3.43 ms) and 8 192 programs stay best. So the plain variant takes DZ_NUM_STAGES_PLAIN (on
# CUDA with 16-bit inputs and W <= 4 only, ``_stages``) and DZ_PROGRAMS_PLAIN. H200, 32k tokens, 2026-12-02:
# ``python benchmarks/bench_triton_conv.py --stages``.
DZ_NUM_STAGES = 1
DZ_NUM_STAGES_PLAIN = 3
# the same two knobs of the forward and of the dx pass (all their variants), for the layer's three convs of
# Qwen3-Next: the forward 0.458 ms with one tile per program (65 535 programs) against 0.395 ms with 4 096
# programs on the plain loop, the dx pass 1.125 against 1.083 (software pipelining, 2-4 stages, helped neither).
# So 4 096 and 1 stage. H200, 32k tokens, 2026-12-03: ``python benchmarks/bench_triton_conv.py --stages-fwd-dx``.
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


def _stages(stages: int, x: torch.Tensor, W: int) -> int:
    """``stages`` where the pipelining was measured, on CUDA with 16-bit inputs and W <= 4 (the layer's
    conv); 1 (the plain loop) otherwise: Ascend's compiler reads ``num_stages`` its own way, and with 8-byte
    inputs and W >= 6, or fp32 and W = 16, three stages of prefetched taps exceed an H200's 227 KB of shared
    memory (sm_90 compile on the CPU)."""
    return stages if _grid.on_cuda(x) and x.element_size() <= 2 and W <= 4 else 1


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
