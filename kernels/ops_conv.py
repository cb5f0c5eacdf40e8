"""The causal conv1d ops, whole and split (how ops are made: ``ops_library.py``).

- ``causal_conv1d``: ``(x, weight, bias?, initial_state?, cu_seqlens?, activation, output_final_state,
  backend) -> (y [B,T,C] x.dtype, final [N,C,W-1] fp32|fp64)``
- ``causal_conv1d_split``: the same with ``split_sizes`` (3 channel counts summing to C, zeros allowed)
  after ``cu_seqlens`` -> ``(y0, y1, y2 [B,T,size_i] x.dtype, final)``: y in parts, as ``split`` and
  ``contiguous`` would give; one launch on a backend with ``conv_splits``, else one conv per part

``_split_conv_fwd`` / ``_split_conv_bwd`` also serve the layer's ``conv_gate`` op (``ops_conv_gate.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .ops_library import (_EMPTY, _define, _distinct, _empty_like_none, _entry, _first_order, _into, _into_kwargs,
                          _own, _vjp, library)
from .reference import compute_dtype as math_dtype   # fp64 when any input is fp64, else fp32 (None ignored)
from .reference import l2norm_bwd_from_output, l2norm_rstd
from .registry import backend_by_name, fuses_l2norm

_LIB = library(globals().get("_LIB"))      # (on importlib.reload: the previous definitions go first)


def _causal_conv1d(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                   cu_seqlens: Optional[Tensor], activation: str, output_final_state: bool,
                   backend: str) -> tuple[Tensor, Tensor]:
    y, final = backend_by_name(backend).causal_conv1d(
        x, weight, bias=bias, activation=activation, cu=cu_seqlens, initial_state=initial_state,
        output_final_state=output_final_state)
    dt = math_dtype(x, weight, bias, initial_state)
    final = final.to(dt) if final is not None else x.new_empty(_EMPTY, dtype=dt)
    return _own(y.to(x.dtype).contiguous(), x, initial_state), _own(final, x, initial_state)


def _causal_conv1d_fake(x, weight, bias, initial_state, cu_seqlens, activation, output_final_state, backend):
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    shape = (N, x.shape[2], weight.shape[1] - 1) if output_final_state else _EMPTY
    return x.new_empty(x.shape), x.new_empty(shape, dtype=math_dtype(x, weight, bias, initial_state))


def _causal_conv1d_bwd(dy: Tensor, dfinal: Optional[Tensor], x: Tensor, weight: Tensor, bias: Optional[Tensor],
                       initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], activation: str,
                       output_final_state: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = _conv_bwd(backend_by_name(backend), dy, dfinal, x, weight, bias, initial_state, cu_seqlens,
                      activation, output_final_state)
    return _distinct(grads, dy, dfinal, x, weight, bias, initial_state, cu_seqlens)


def _conv_bwd(b, dy, dfinal, x, weight, bias, initial_state, cu_seqlens, activation, output_final_state,
              dx_into=None, l2norm_out=None):
    """``(dx, dweight, dbias, dinitial)`` in the inputs' dtypes (empty for a None bias / initial state);
    dy is a tensor, or a list of parts for a backend with ``conv_splits``. ``dx_into``: None, or a view
    (x's shape and dtype) that dx is written into and returned as (``_into``). ``l2norm_out``: ``(y, rstd)`` of
    a conv whose backend normalised its output (``registry.fuses_l2norm``; dy is that of the normalised y)."""
    if b.causal_conv1d_bwd is not None:
        fused = {"l2norm_out": tuple(l2norm_out)} if l2norm_out is not None else {}
        dx, dw, db, dh0 = b.causal_conv1d_bwd(dy, dfinal, x, weight, bias, activation=activation, cu=cu_seqlens,
                                              initial_state=initial_state, **_into_kwargs(b, dx=dx_into), **fused)
    else:
        def f(x, weight, bias, h0):
            y, fin = b.causal_conv1d(x, weight, bias=bias, activation=activation, cu=cu_seqlens, initial_state=h0,
                                     output_final_state=output_final_state)
            return (y, fin) if output_final_state else (y,)

        dx, dw, db, dh0 = _vjp(f, (x, weight, bias, initial_state), (dy, dfinal)[:1 + output_final_state])
    return (_into(dx_into, dx.to(x.dtype)), dw.to(weight.dtype),
            _empty_like_none(None if bias is None else db.to(bias.dtype), x),
            _empty_like_none(None if initial_state is None else dh0.to(initial_state.dtype), x))


def _conv_bwd_fake(x, weight, bias, initial_state):
    return (x.new_empty(x.shape), weight.new_empty(weight.shape),
            x.new_empty(_EMPTY) if bias is None else bias.new_empty(bias.shape),
            x.new_empty(_EMPTY) if initial_state is None else initial_state.new_empty(initial_state.shape))


_conv_fwd_op = _define(_LIB, "causal_conv1d", _causal_conv1d, _causal_conv1d_fake)
_conv_bwd_op = _define(_LIB, "causal_conv1d_bwd", _causal_conv1d_bwd, lambda dy, dfinal, x, weight, bias,
                       initial_state, *_: _conv_bwd_fake(x, weight, bias, initial_state))


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, cu_seqlens, activation, output_final_state, backend):
        ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
        ctx.args = (activation, output_final_state, backend)
        return _conv_fwd_op(x, weight, bias, initial_state, cu_seqlens, activation, output_final_state, backend)

    @staticmethod
    def backward(ctx, dy, dfinal):
        x, weight, bias, initial_state, cu_seqlens = ctx.saved_tensors
        activation, output_final_state, backend = ctx.args
        grads = _conv_bwd_op(dy, dfinal if output_final_state else None, x, weight, bias, initial_state,
                             cu_seqlens, activation, output_final_state, backend)
        dx, dw, db, dh0 = _first_order("causal_conv1d", grads, (dy, dfinal, x, weight, bias, initial_state))
        return (dx, dw, db if bias is not None else None, dh0 if initial_state is not None else None,
                None, None, None, None)


causal_conv1d_op = _entry(_CausalConv1d, _conv_fwd_op)


def _causal_conv1d_split(x: Tensor, weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                         cu_seqlens: Optional[Tensor], split_sizes: list[int], activation: str,
                         output_final_state: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    ys, final, _ = _split_conv_fwd(backend_by_name(backend), x, weight, bias, initial_state, cu_seqlens,
                                   split_sizes, activation, output_final_state)
    return _distinct([*ys, final], x, initial_state)


def _split_conv_fwd(b, x, weight, bias, initial_state, cu_seqlens, split_sizes, activation, output_final_state,
                    l2norm_dim=0):
    """``(ys, final, rstds)`` of ``causal_conv1d_split`` on backend ``b`` (ys in x's dtype, final in the math
    dtype, empty without output_final_state). ``l2norm_dim`` > 0: the first two parts (q and k) L2-normalised over
    each head of that many channels (in the conv where ``registry.fuses_l2norm``, else in torch after it),
    rstds their factors ``[B, T, size // l2norm_dim]`` (math dtype) for ``_split_conv_bwd``; else rstds empty."""
    sizes = list(split_sizes)
    kwargs = dict(activation=activation, cu=cu_seqlens, output_final_state=output_final_state)
    fused = bool(l2norm_dim) and fuses_l2norm(b)
    dt = math_dtype(x, weight, bias, initial_state)
    rstds = [x.new_empty(_EMPTY, dtype=dt), x.new_empty(_EMPTY, dtype=dt)]
    if b.conv_splits:
        ys, final = b.causal_conv1d(x, weight, bias=bias, initial_state=initial_state, split_sizes=sizes, **kwargs)
        if not isinstance(ys, (list, tuple)) or len(ys) != len(sizes):
            raise TypeError(f"backend {b.name!r} has conv_splits=True, so its causal_conv1d must return a list of "
                            f"[B, T, size] tensors for split_sizes={sizes}; set conv_splits=False if it does not")
    else:   # one conv per non-empty part: no copies (each part's y is contiguous)
        ys, finals = [], []
        for i, (w, (xi, wi, bi, hi)) in enumerate(zip(sizes, _split_inputs(sizes, x, weight, bias, initial_state))):
            if w == 0:
                ys.append(x.new_empty(*x.shape[:2], 0))
                if fused and i < 2:
                    rstds[i] = x.new_empty(*x.shape[:2], 0, dtype=dt)
                continue
            if fused and i < 2:
                yi, fi, ri = b.causal_conv1d(xi, wi, bias=bi, initial_state=hi, l2norm_dim=l2norm_dim, **kwargs)
                rstds[i] = ri.to(dt)
            else:
                yi, fi = b.causal_conv1d(xi, wi, bias=bi, initial_state=hi, **kwargs)
            ys.append(yi)
            finals.append(fi)
        final = torch.cat(finals, 1) if output_final_state else None
    ys = [y.to(x.dtype) for y in ys]
    if l2norm_dim and not fused:
        for i in range(min(2, len(ys))):
            heads = ys[i].to(dt).unflatten(-1, (-1, l2norm_dim))
            rstds[i] = l2norm_rstd(heads)
            ys[i] = (heads * rstds[i][..., None]).flatten(-2).to(x.dtype)
    final = final.to(dt) if final is not None else x.new_empty(_EMPTY, dtype=dt)
    return ys, final, rstds


def _l2norm_heads_bwd(y: Tensor, rstd: Tensor, dy: Tensor) -> Tensor:
    """``reference.l2norm_bwd_from_output`` per head of ``y, dy [B, T, C]`` (``rstd [B, T, heads]``), in rstd's
    dtype."""
    heads = lambda t: t.to(rstd.dtype).unflatten(-1, (rstd.shape[-1], -1))   # noqa: E731
    return l2norm_bwd_from_output(heads(y), rstd, heads(dy)).flatten(-2)


def _causal_conv1d_split_fake(x, weight, bias, initial_state, cu_seqlens, split_sizes, activation, output_final_state,
                              backend):
    N = x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    shape = (N, x.shape[2], weight.shape[1] - 1) if output_final_state else _EMPTY
    return (*(x.new_empty(*x.shape[:2], w) for w in split_sizes),
            x.new_empty(shape, dtype=math_dtype(x, weight, bias, initial_state)))


def _causal_conv1d_split_bwd(dy0: Tensor, dy1: Tensor, dy2: Tensor, dfinal: Optional[Tensor], x: Tensor,
                             weight: Tensor, bias: Optional[Tensor], initial_state: Optional[Tensor],
                             cu_seqlens: Optional[Tensor], activation: str, output_final_state: bool,
                             backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = _split_conv_bwd(backend_by_name(backend), (dy0, dy1, dy2), dfinal, x, weight, bias, initial_state,
                            cu_seqlens, activation, output_final_state)
    return _distinct(grads, dy0, dy1, dy2, dfinal, x, weight, bias, initial_state, cu_seqlens)


def _split_conv_bwd(b, dys, dfinal, x, weight, bias, initial_state, cu_seqlens, activation, output_final_state,
                    dx_into=None, l2norm_out=None):
    """``_conv_bwd`` of a split conv (``dys``: the 3 parts' gradients): one call on a backend with
    ``conv_splits``, else one per non-empty part, as the forward ran it, the gradients concatenated (dx
    written into ``dx_into``'s column parts instead, when given). ``l2norm_out``: None, or ``[(y0, rstd0),
    (y1, rstd1)]`` of a ``_split_conv_fwd`` with ``l2norm_dim`` (dys of the first two parts are those of the
    normalised outputs): through the norm in the backend's conv backward where ``registry.fuses_l2norm``, else
    here."""
    sizes = [d.shape[-1] for d in dys]
    fused = l2norm_out is not None and fuses_l2norm(b)
    if l2norm_out is not None and not fused:
        dys = [_l2norm_heads_bwd(*l2norm_out[i], dy).to(dy.dtype) if i < 2 and sizes[i] else dy
               for i, dy in enumerate(dys)]
    if b.conv_splits and b.causal_conv1d_bwd is not None:
        return _conv_bwd(b, list(dys), dfinal, x, weight, bias, initial_state, cu_seqlens, activation,
                         output_final_state, dx_into)
    dfs = [None] * 3 if dfinal is None else dfinal.split(sizes, 1)
    dxs = [None] * 3 if dx_into is None else dx_into.split(sizes, -1)
    parts = [_conv_bwd(b, dy, df, xi, wi, bi, hi, cu_seqlens, activation, output_final_state, dxi,
                       l2norm_out[i] if fused and i < 2 else None)
             for i, (w, dy, df, dxi, (xi, wi, bi, hi)) in enumerate(zip(
                 sizes, dys, dfs, dxs, _split_inputs(sizes, x, weight, bias, initial_state))) if w]
    dx = dx_into if dx_into is not None else torch.cat([g[0] for g in parts], -1)
    db = x.new_empty(_EMPTY) if bias is None else torch.cat([g[2] for g in parts])
    dh0 = x.new_empty(_EMPTY) if initial_state is None else torch.cat([g[3] for g in parts], 1)
    return dx, torch.cat([g[1] for g in parts]), db, dh0


def _split_inputs(sizes, x, weight, bias, initial_state) -> list:
    """``(x_i, weight_i, bias_i, initial_state_i)`` per part of the channels (views; None stays None)."""
    def split(t, dim):
        return [None] * len(sizes) if t is None else t.split(sizes, dim)
    return list(zip(x.split(sizes, -1), weight.split(sizes, 0), split(bias, 0), split(initial_state, 1)))


_conv_split_fwd_op = _define(_LIB, "causal_conv1d_split", _causal_conv1d_split, _causal_conv1d_split_fake)
_conv_split_bwd_op = _define(_LIB, "causal_conv1d_split_bwd", _causal_conv1d_split_bwd,
                             lambda dy0, dy1, dy2, dfinal, x, weight, bias, initial_state, *_:
                             _conv_bwd_fake(x, weight, bias, initial_state))


class _CausalConv1dSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, initial_state, cu_seqlens, split_sizes, activation, output_final_state,
                backend):
        ctx.save_for_backward(x, weight, bias, initial_state, cu_seqlens)
        ctx.args = (activation, output_final_state, backend)      # (the parts' sizes come back as dy's widths)
        return _conv_split_fwd_op(x, weight, bias, initial_state, cu_seqlens, split_sizes, activation,
                                  output_final_state, backend)

    @staticmethod
    def backward(ctx, dy0, dy1, dy2, dfinal):
        x, weight, bias, initial_state, cu_seqlens = ctx.saved_tensors
        activation, output_final_state, backend = ctx.args
        # (an output that feeds nothing comes as zeros: the Function materialises None gradients)
        grads = _conv_split_bwd_op(dy0, dy1, dy2, dfinal if output_final_state else None, x, weight, bias,
                                   initial_state, cu_seqlens, activation, output_final_state, backend)
        dx, dw, db, dh0 = _first_order("causal_conv1d_split", grads,
                                       (dy0, dy1, dy2, dfinal, x, weight, bias, initial_state))
        return (dx, dw, db if bias is not None else None, dh0 if initial_state is not None else None,
                None, None, None, None, None)


causal_conv1d_split_op = _entry(_CausalConv1dSplit, _conv_split_fwd_op)
