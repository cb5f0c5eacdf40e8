"""The gate op, ``gdn_gate``: ``(a, b, A_log, dt_bias, backend) -> (g [B,T,H] fp32|fp64, beta b.dtype)`` (how
ops are made: ``ops_library.py``). ``_gdn_gate`` / ``_gate_bwd`` also serve the layer's ``conv_gate`` op
(``ops_conv_gate.py``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .ops_library import _define, _distinct, _entry, _first_order, _into, _into_kwargs, _own, _vjp, library
from .reference import compute_dtype as math_dtype   # fp64 when any input is fp64, else fp32 (None ignored)
from .registry import backend_by_name

_LIB = library(globals().get("_LIB"))      # (on importlib.reload: the previous definitions go first)


def _gdn_gate(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    g, beta = backend_by_name(backend).gdn_gate(a, b, A_log, dt_bias)
    return _own(g.to(math_dtype(a, A_log, dt_bias)), a), _own(beta.to(b.dtype), b)


def _gdn_gate_fake(a, b, A_log, dt_bias, backend):
    return a.new_empty(a.shape, dtype=math_dtype(a, A_log, dt_bias)), b.new_empty(b.shape)


def _gdn_gate_bwd(dg: Tensor, dbeta: Tensor, a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor,
                  backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _distinct(_gate_bwd(backend_by_name(backend), dg, dbeta, a, b, A_log, dt_bias), dg, dbeta, a, b, A_log,
                     dt_bias)


def _gate_bwd(impl, dg, dbeta, a, b, A_log, dt_bias, da_into=None, db_into=None) -> list:
    """``(da, db, dA_log, ddt_bias)`` in the inputs' dtypes; da and db written into ``da_into``, ``db_into``
    and returned as them, when given (``_into``)."""
    if impl.gdn_gate_bwd is not None:
        grads = impl.gdn_gate_bwd(dg, dbeta, a, b, A_log, dt_bias, **_into_kwargs(impl, da=da_into, db=db_into))
    else:
        grads = _vjp(impl.gdn_gate, (a, b, A_log, dt_bias), (dg, dbeta))
    da, db, dA, ddt = (d.to(x.dtype) for d, x in zip(grads, (a, b, A_log, dt_bias)))
    return [_into(da_into, da), _into(db_into, db), dA, ddt]


_gate_fwd_op = _define(_LIB, "gdn_gate", _gdn_gate, _gdn_gate_fake)
_gate_bwd_op = _define(_LIB, "gdn_gate_bwd", _gdn_gate_bwd, lambda dg, dbeta, a, b, A_log, dt_bias, backend:
                       tuple(x.new_empty(x.shape) for x in (a, b, A_log, dt_bias)))


class _GdnGate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, A_log, dt_bias, backend):
        ctx.save_for_backward(a, b, A_log, dt_bias)
        ctx.backend = backend
        return _gate_fwd_op(a, b, A_log, dt_bias, backend)

    @staticmethod
    def backward(ctx, dg, dbeta):
        saved = ctx.saved_tensors     # (unpacked once: non-reentrant checkpointing allows no second unpack)
        return (*_first_order("gdn_gate", _gate_bwd_op(dg, dbeta, *saved, ctx.backend), (dg, dbeta, *saved)),
                None)


gdn_gate_op = _entry(_GdnGate, _gate_fwd_op)
