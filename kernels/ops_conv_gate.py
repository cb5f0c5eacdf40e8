"""The layer's conv and gate from its pre-conv buffer in one op, ``conv_gate`` (how ops are made:
``ops_library.py``).

``(mixed [B,T,C+2H], weight, A_log, dt_bias, initial_state?, cu_seqlens?, split_sizes, activation,
output_final_state, l2norm_dim, backend) -> (y0, y1, y2, g, beta, final, rstd0, rstd1)``: ``causal_conv1d_split``
of ``mixed[..., :C]`` without bias (``ops_conv.py``), ``gdn_gate`` of its last 2H columns (``ops_gate.py``);
``l2norm_dim`` > 0: y0 and y1 L2-normalised per head of that many channels, inside the conv on a backend with
``conv_l2norm``, and ``rstd0, rstd1 [B,T,size_i/l2norm_dim]`` their factors in the math dtype, empty without
l2norm_dim, which the backward takes with y0 and y1. Its backward returns one ``dmixed`` buffer, written in place
by the kernels of a backend with ``grads_into`` (no ``[dx | da | db]`` concatenation), its parts copied in on the
others.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .ops_conv import _causal_conv1d_split_fake, _split_conv_bwd, _split_conv_fwd
from .ops_gate import _gate_bwd, _gdn_gate, _gdn_gate_fake
from .ops_library import _EMPTY, _define, _distinct, _entry, _first_order, library
from .reference import compute_dtype as math_dtype   # fp64 when any input is fp64, else fp32 (None ignored)
from .registry import backend_by_name

_LIB = library(globals().get("_LIB"))      # (on importlib.reload: the previous definitions go first)


def _mixed_split(mixed: Tensor, split_sizes, A_log: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``mixed [B, T, C + 2H]`` as its views ``x [B, T, C]`` (C = sum of split_sizes), ``a``, ``b [B, T, H]``."""
    H = A_log.shape[0]
    return mixed.split([sum(split_sizes), H, H], -1)


def _conv_gate(mixed: Tensor, weight: Tensor, A_log: Tensor, dt_bias: Tensor, initial_state: Optional[Tensor],
               cu_seqlens: Optional[Tensor], split_sizes: list[int], activation: str, output_final_state: bool,
               l2norm_dim: int, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    x, a, b = _mixed_split(mixed, split_sizes, A_log)
    ys, final, rstds = _split_conv_fwd(backend_by_name(backend), x, weight, None, initial_state, cu_seqlens,
                                       split_sizes, activation, output_final_state, l2norm_dim)
    g, beta = _gdn_gate(a, b, A_log, dt_bias, backend)
    return _distinct([*ys, g, beta, final, *rstds], mixed, initial_state)


def _conv_gate_fake(mixed, weight, A_log, dt_bias, initial_state, cu_seqlens, split_sizes, activation,
                    output_final_state, l2norm_dim, backend):
    x, a, b = _mixed_split(mixed, split_sizes, A_log)
    *ys, final = _causal_conv1d_split_fake(x, weight, None, initial_state, cu_seqlens, split_sizes, activation,
                                           output_final_state, backend)
    dt = math_dtype(x, weight, None, initial_state)
    rstds = [x.new_empty(*x.shape[:2], w // l2norm_dim, dtype=dt) if l2norm_dim else x.new_empty(_EMPTY, dtype=dt)
             for w in split_sizes[:2]]
    return (*ys, *_gdn_gate_fake(a, b, A_log, dt_bias, backend), final, *rstds)


def _conv_gate_bwd(dy0: Tensor, dy1: Tensor, dy2: Tensor, dg: Tensor, dbeta: Tensor, dfinal: Optional[Tensor],
                   mixed: Tensor, weight: Tensor, A_log: Tensor, dt_bias: Tensor, initial_state: Optional[Tensor],
                   cu_seqlens: Optional[Tensor], y0: Optional[Tensor], y1: Optional[Tensor], rstd0: Optional[Tensor],
                   rstd1: Optional[Tensor], split_sizes: list[int], activation: str, output_final_state: bool,
                   backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(dmixed, dweight, dA_log, ddt_bias, dinitial)``: the conv's and the gate's backwards each fill their
    columns of one ``dmixed`` buffer (``_into``: in place on a backend with ``grads_into``, else copied in).
    ``y0, y1, rstd0, rstd1``: the forward's normalised q and k and their factors (``l2norm_dim``), or None."""
    impl = backend_by_name(backend)
    x, a, b = _mixed_split(mixed, split_sizes, A_log)
    dmixed = torch.empty(mixed.shape, dtype=mixed.dtype, device=mixed.device)
    dx, da, db = _mixed_split(dmixed, split_sizes, A_log)
    l2norm_out = None if y0 is None else [(y0, rstd0), (y1, rstd1)]
    _, dw, _, dh0 = _split_conv_bwd(impl, (dy0, dy1, dy2), dfinal, x, weight, None, initial_state, cu_seqlens,
                                    activation, output_final_state, dx, l2norm_out)
    _, _, dA, ddt = _gate_bwd(impl, dg, dbeta, a, b, A_log, dt_bias, da, db)
    return _distinct([dmixed, dw, dA, ddt, dh0], dy0, dy1, dy2, dg, dbeta, dfinal, mixed, weight, A_log, dt_bias,
                     initial_state)


_conv_gate_fwd_op = _define(_LIB, "conv_gate", _conv_gate, _conv_gate_fake)
_conv_gate_bwd_op = _define(_LIB, "conv_gate_bwd", _conv_gate_bwd,
                            lambda dy0, dy1, dy2, dg, dbeta, dfinal, mixed, weight, A_log, dt_bias, initial_state, *_:
                            (mixed.new_empty(mixed.shape), weight.new_empty(weight.shape),
                             A_log.new_empty(A_log.shape), dt_bias.new_empty(dt_bias.shape),
                             mixed.new_empty(_EMPTY) if initial_state is None
                             else initial_state.new_empty(initial_state.shape)))


class _ConvGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed, weight, A_log, dt_bias, initial_state, cu_seqlens, split_sizes, activation,
                output_final_state, l2norm_dim, backend):
        outs = _conv_gate_fwd_op(mixed, weight, A_log, dt_bias, initial_state, cu_seqlens, split_sizes, activation,
                                 output_final_state, l2norm_dim, backend)
        # with l2norm_dim the backward goes through the norm from the normalised q, k and their factors (the
        # chunk op saves the same q and k: no memory of their own)
        normed = (outs[0], outs[1], outs[6], outs[7]) if l2norm_dim else (None,) * 4
        ctx.save_for_backward(mixed, weight, A_log, dt_bias, initial_state, cu_seqlens, *normed)
        ctx.mark_non_differentiable(outs[6], outs[7])
        ctx.args = (split_sizes, activation, output_final_state, backend)
        return outs

    @staticmethod
    def backward(ctx, dy0, dy1, dy2, dg, dbeta, dfinal, _drstd0, _drstd1):
        saved = ctx.saved_tensors
        mixed, weight, A_log, dt_bias, initial_state = saved[:5]
        split_sizes, activation, output_final_state, backend = ctx.args
        # (an output that feeds nothing comes as zeros: the Function materialises None gradients)
        grads = _conv_gate_bwd_op(dy0, dy1, dy2, dg, dbeta, dfinal if output_final_state else None, *saved,
                                  split_sizes, activation, output_final_state, backend)
        dmixed, dw, dA, ddt, dh0 = _first_order("conv_gate", grads, (dy0, dy1, dy2, dg, dbeta, dfinal, *saved[:5]))
        return (dmixed, dw, dA, ddt, dh0 if initial_state is not None else None, None, None, None, None, None,
                None)


conv_gate_op = _entry(_ConvGate, _conv_gate_fwd_op)
