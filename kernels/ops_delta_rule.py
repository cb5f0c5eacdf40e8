"""The gated delta rule's ops, chunk and recurrent (one schema; how ops are made: ``ops_library.py``).

``chunk_gated_delta_rule`` / ``recurrent_gated_delta_rule``:
``(q, k, v, g, beta, initial_state?, cu_seqlens?, scale, output_final_state, use_qk_l2norm, backend,
save_residuals) -> (o [B,T,Hv,Dv] v.dtype, final [N,Hv,Dk,Dv] fp32|fp64, r0, r1)``; r0, r1 the backend's
residuals (``Backend.chunk_residuals``: what its backward would otherwise recompute, opaque here), empty
unless ``save_residuals``, which the Function asks in eager mode only (and only when an input needs a
gradient); the backward op takes them back last. The fake implementation returns them empty: it is right
only for ``save_residuals=False`` (what ``torch.compile`` traces), since their shapes are the backend's.
A dense call reaches a backend with ``dense_as_packed`` as one pack (``_as_packed``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..derived import derived_from_sizes
from . import cu_cache
from .ops_library import _EMPTY, _define, _distinct, _empty_like_none, _entry, _first_order, _own, _vjp, library
from .reference import compute_dtype as math_dtype   # fp64 when any input is fp64, else fp32 (None ignored)
from .registry import backend_by_name

_LIB = library(globals().get("_LIB"))      # (on importlib.reload: the previous definitions go first)


def _delta_rule_fake(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm, backend,
                     save_residuals):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    shape = (N, v.shape[2], q.shape[3], v.shape[3]) if output_final_state else _EMPTY
    # (residuals: empty, which is right where they are asked for only outside torch.compile: DeltaRule)
    return (v.new_empty(v.shape), q.new_empty(shape, dtype=math_dtype(q, k, v, g, beta, initial_state)),
            q.new_empty(_EMPTY), q.new_empty(_EMPTY))


_DENSE_CU: dict = {}


def dense_cu(B: int, T: int, device: torch.device) -> torch.Tensor:
    """``[0, T, 2T, ..., B*T]`` on ``device``, one read-only tensor per shape (16 kept, by the project's
    caching rule: ``gdn_layer.derived``) with its host values recorded (``cu_cache``): the backends'
    per-``cu_seqlens`` caches then hit for every dense call of that shape, and nothing reads it back
    from the device."""
    def build():
        cu = torch.arange(0, B * T + 1, T, device=device, dtype=torch.int64)
        cu_cache.remember(cu, "host", torch.arange(0, B * T + 1, T, dtype=torch.int64, device="cpu"))
        return cu
    return derived_from_sizes(_DENSE_CU, (B, T, str(device)), build, max_entries=16)


def _as_packed(b, cu_seqlens, *tensors):
    """A dense ``[B, T, ...]`` call as one pack ``[1, B*T, ...]`` with ``cu = [0, T, 2T, ..., B*T]``, for
    backends with ``dense_as_packed`` (the math is the same: each row is its own sequence). Returns
    ``(cu, tensors, unfold)``; ``unfold(x)`` gives a ``[1, B*T, ...]`` result its ``[B, T, ...]`` shape back.
    Unchanged (and ``unfold`` the identity) for packed calls, other backends and empty inputs."""
    q = tensors[0]
    B, T = q.shape[:2]
    if cu_seqlens is not None or not b.dense_as_packed or B * T == 0:
        return cu_seqlens, tensors, lambda x: x
    cu = dense_cu(B, T, q.device)
    flat = tuple(t.reshape(1, B * T, *t.shape[2:]) for t in tensors)
    return cu, flat, lambda x: x.reshape(B, T, *x.shape[2:])


def _residuals(out, backend: str, fwd_attr: str) -> tuple:
    """The residuals of a forward asked for them: ``out[2]``, ``()`` or a pair of tensors (``Backend.chunk_residuals``),
    else RuntimeError naming the backend."""
    r = out[2] if isinstance(out, (tuple, list)) and len(out) == 3 else None
    if not isinstance(r, (tuple, list)) or len(r) not in (0, 2) or not all(isinstance(t, Tensor) for t in r):
        got = (f"{len(out)} values" if isinstance(out, (tuple, list)) and len(out) != 3
               else f"residuals {type(r).__name__}" + (f" of {len(r)}" if isinstance(r, (tuple, list)) else ""))
        raise RuntimeError(f"backend {backend!r} has chunk_residuals=True, so its {fwd_attr} called with "
                           f"residuals=True must return (o, final, residuals) with residuals () or a pair of "
                           f"tensors; got {got}")
    return tuple(r)


def _make_delta_rule_ops(kind: str):
    fwd_attr, bwd_attr = f"{kind}_gated_delta_rule", f"{kind}_gated_delta_rule_bwd"

    def op(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Optional[Tensor],
           cu_seqlens: Optional[Tensor], scale: float, output_final_state: bool, use_qk_l2norm: bool,
           backend: str, save_residuals: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        b = backend_by_name(backend)
        cu, (fq, fk, fv, fg, fbeta), unfold = _as_packed(b, cu_seqlens, q, k, v, g, beta)
        out = getattr(b, fwd_attr)(fq, fk, fv, fg, fbeta, scale=scale, initial_state=initial_state,
                                   output_final_state=output_final_state, cu=cu, use_qk_l2norm=use_qk_l2norm,
                                   **({"residuals": True} if save_residuals else {}))
        o, final = out[:2]
        residuals = _residuals(out, backend, fwd_attr) if save_residuals else ()
        o = unfold(o)
        dt = math_dtype(q, k, v, g, beta, initial_state)
        final = final.to(dt) if final is not None else q.new_empty(_EMPTY, dtype=dt)
        inputs = (q, k, v, g, beta, initial_state)
        return (_own(o.to(v.dtype), *inputs), _own(final, *inputs),
                *((_own(r, *inputs) for r in residuals) if residuals else (q.new_empty(_EMPTY), q.new_empty(_EMPTY))))

    fwd_op = _define(_LIB, f"{kind}_gated_delta_rule", op, _delta_rule_fake)

    def bwd(do: Tensor, dfinal: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
            initial_state: Optional[Tensor], cu_seqlens: Optional[Tensor], scale: float, output_final_state: bool,
            use_qk_l2norm: bool, backend: str, r0: Tensor, r1: Tensor
            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        b = backend_by_name(backend)
        custom = getattr(b, bwd_attr)
        if custom is not None:
            cu, (fdo, fq, fk, fv, fg, fbeta), unfold = _as_packed(b, cu_seqlens, do, q, k, v, g, beta)
            kw = {}
            if kind == "chunk" and b.chunk_residuals:
                kw["residuals"] = (r0, r1) if r0.numel() or r1.numel() else None
            dq, dk, dv, dg, dbeta, dh0 = custom(fdo, dfinal, fq, fk, fv, fg, fbeta, scale=scale,
                                                initial_state=initial_state, cu=cu, use_qk_l2norm=use_qk_l2norm, **kw)
            dq, dk, dv, dg, dbeta = map(unfold, (dq, dk, dv, dg, dbeta))
        else:
            fwd = getattr(b, fwd_attr)

            def f(q, k, v, g, beta, h0):
                cu, (q, k, v, g, beta), unfold = _as_packed(b, cu_seqlens, q, k, v, g, beta)
                o, fin = fwd(q, k, v, g, beta, scale=scale, initial_state=h0,
                             output_final_state=output_final_state, cu=cu, use_qk_l2norm=use_qk_l2norm)
                return (unfold(o), fin) if output_final_state else (unfold(o),)

            dq, dk, dv, dg, dbeta, dh0 = _vjp(f, (q, k, v, g, beta, initial_state), (do, dfinal)[:1 + output_final_state])
        grads = [x.to(ref.dtype) for x, ref in zip((dq, dk, dv, dg, dbeta), (q, k, v, g, beta))]
        dh0 = _empty_like_none(dh0 if initial_state is not None else None, q)
        return _distinct((*grads, dh0), do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens)

    def bwd_fake(do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm,
                 backend, r0, r1):
        dh0 = q.new_empty(_EMPTY) if initial_state is None else initial_state.new_empty(initial_state.shape)
        return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
                beta.new_empty(beta.shape), dh0)

    bwd_op = _define(_LIB, f"{kind}_gated_delta_rule_bwd", bwd, bwd_fake)

    class DeltaRule(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm,
                    backend):
            # the backend's residuals (Backend.chunk_residuals) are kept for its backward in eager mode only:
            # the fake implementation cannot know their shapes
            save = (kind == "chunk" and backend_by_name(backend).chunk_residuals and any(ctx.needs_input_grad[:6])
                    and not torch.compiler.is_compiling())
            o, final, r0, r1 = fwd_op(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                                      use_qk_l2norm, backend, save)
            ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *((r0, r1) if save else ()))
            ctx.args = (scale, output_final_state, use_qk_l2norm, backend)
            return o, final

        @staticmethod
        def backward(ctx, do, dfinal):
            q, k, v, g, beta, initial_state, cu_seqlens, *residuals = ctx.saved_tensors
            scale, output_final_state, use_qk_l2norm, backend = ctx.args
            dfinal = dfinal if output_final_state else None
            r0, r1 = residuals or (q.new_empty(_EMPTY), q.new_empty(_EMPTY))
            grads = bwd_op(do, dfinal, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                           use_qk_l2norm, backend, r0, r1)
            dq, dk, dv, dg, dbeta, dh0 = _first_order(fwd_attr, grads, (do, dfinal, q, k, v, g, beta, initial_state))
            return dq, dk, dv, dg, dbeta, (dh0 if initial_state is not None else None), None, None, None, None, None

    def no_autograd(*args):
        return fwd_op(*args, False)[:2]

    return _entry(DeltaRule, no_autograd)


chunk_gated_delta_rule_op = _make_delta_rule_ops("chunk")
recurrent_gated_delta_rule_op = _make_delta_rule_ops("recurrent")
