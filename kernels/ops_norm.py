"""The gated RMSNorm op, ``gated_rms_norm``: ``(x, z, weight, eps, backend) -> y x.dtype`` (how ops are made:
``ops_library.py``).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .ops_library import _define, _distinct, _entry, _first_order, _own, _vjp, library
from .registry import backend_by_name

_LIB = library(globals().get("_LIB"))      # (on importlib.reload: the previous definitions go first)


def _gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float, backend: str) -> Tensor:
    return _own(backend_by_name(backend).gated_rms_norm(x, z, weight, eps).to(x.dtype).contiguous(), x, z)


def _gated_rms_norm_bwd(dy: Tensor, x: Tensor, z: Tensor, weight: Tensor, eps: float,
                        backend: str) -> tuple[Tensor, Tensor, Tensor]:
    impl = backend_by_name(backend)
    if impl.gated_rms_norm_bwd is not None:
        grads = impl.gated_rms_norm_bwd(dy, x, z, weight, eps)
    else:
        grads = _vjp(lambda x, z, w: (impl.gated_rms_norm(x, z, w, eps),), (x, z, weight), (dy,))
    return _distinct([d.to(t.dtype) for d, t in zip(grads, (x, z, weight))], dy, x, z, weight)


def _gated_rms_norm_fake(x, z, weight, eps, backend):
    return x.new_empty(x.shape)


_norm_fwd_op = _define(_LIB, "gated_rms_norm", _gated_rms_norm, _gated_rms_norm_fake)
_norm_bwd_op = _define(_LIB, "gated_rms_norm_bwd", _gated_rms_norm_bwd, lambda dy, x, z, weight, eps, backend:
                       (x.new_empty(x.shape), z.new_empty(z.shape), weight.new_empty(weight.shape)))


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, weight, eps, backend):
        ctx.save_for_backward(x, z, weight)
        ctx.args = (eps, backend)
        return _norm_fwd_op(x, z, weight, eps, backend)

    @staticmethod
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        return (*_first_order("gated_rms_norm", _norm_bwd_op(dy, *saved, *ctx.args), (dy, *saved)), None, None)


gated_rms_norm_op = _entry(_GatedRMSNorm, _norm_fwd_op)
