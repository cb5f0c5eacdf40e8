"""Every backend's math behind one set of ``torch.library`` operators (namespace ``gdn_layer``).

Why: ``torch.compile`` sees one opaque op per kernel (with a fake implementation for shapes), so a new
packed length or sequence count is just new symbolic sizes, never a graph break or a recompile; and
autograd is written once, here, for every backend.

Each op takes the resolved backend's name as a string argument and calls that backend's forward
callable; its backward is a second op that calls the backend's backward callable, or, for a
backend that gives none (the torch reference, or a user-registered pure-torch backend), the
vector-Jacobian product of its forward through ``torch.func.vjp`` (plain autograd does not record
inside an op). Backward ops recompute what they need from the inputs: nothing but the inputs
is saved for backward, except what a backend's chunk forward hands its backward (``Backend.chunk_residuals``)
and the conv's normalised q / k with their factors (``conv_gate``).

How: each op is defined with ``torch.library.Library.define`` (the schema inferred from the Python
signature, ``torch.library.infer_schema``), one kernel for every device (``CompositeExplicitAutograd``)
and a fake implementation (``torch.library.register_fake``); autograd is a ``torch.autograd.Function``
around the forward op whose backward calls the backward op. That costs the host about half of what
``torch.library.custom_op`` with ``register_autograd`` costs per forward+backward (its Python wrappers
check aliasing and fill defaults on every call): on this project's 2-core CPU, 15 against 32 µs per op
(docs/performance.md, session 12). The public entry points are the ``*_op`` callables below: the
Function where autograd records, the operator itself under ``no_grad`` / ``inference_mode``. The
``torch.ops.gdn_layer`` operators have no autograd formula of their own: called directly on tensors that
require grad, what autograd sees depends on the backend's kernel (nothing, for the Triton kernels: torch
warns at backward and the inputs get no gradient). Call ``gdn_layer.kernels``' functions instead.
The gradients are first-order only: differentiating them (``create_graph=True``, then backward) raises.

Ops (inputs already validated by ``api.py``; optional outputs come back as empty tensors):

- ``chunk_gated_delta_rule`` / ``recurrent_gated_delta_rule``:
  ``(q, k, v, g, beta, initial_state?, cu_seqlens?, scale, output_final_state, use_qk_l2norm, backend,
  save_residuals) -> (o [B,T,Hv,Dv] v.dtype, final [N,Hv,Dk,Dv] fp32|fp64, r0, r1)``; r0, r1 the backend's
  residuals (``Backend.chunk_residuals``: what its backward would otherwise recompute, opaque here), empty
  unless ``save_residuals``, which the Function asks in eager mode only (and only when an input needs a
  gradient); the backward op takes them back last. The fake implementation returns them empty: it is right
  only for ``save_residuals=False`` (what ``torch.compile`` traces), since their shapes are the backend's
- ``causal_conv1d``: ``(x, weight, bias?, initial_state?, cu_seqlens?, activation, output_final_state,
  backend) -> (y [B,T,C] x.dtype, final [N,C,W-1] fp32|fp64)``
- ``causal_conv1d_split``: the same with ``split_sizes`` (3 channel counts summing to C, zeros allowed)
  after ``cu_seqlens`` -> ``(y0, y1, y2 [B,T,size_i] x.dtype, final)``: y in parts, as ``split`` and
  ``contiguous`` would give; one launch on a backend with ``conv_splits``, else one conv per part
- ``gdn_gate``: ``(a, b, A_log, dt_bias, backend) -> (g [B,T,H] fp32|fp64, beta b.dtype)``
- ``gated_rms_norm``: ``(x, z, weight, eps, backend) -> y x.dtype``
- ``conv_gate``: the layer's conv and gate from its pre-conv buffer in one op, ``(mixed [B,T,C+2H], weight,
  A_log, dt_bias, initial_state?, cu_seqlens?, split_sizes, activation, output_final_state, l2norm_dim,
  backend) -> (y0, y1, y2, g, beta, final, rstd0, rstd1)`` (``causal_conv1d_split`` of ``mixed[..., :C]``
  without bias, ``gdn_gate`` of its last 2H columns; ``l2norm_dim`` > 0: y0 and y1 L2-normalised per head of
  that many channels, inside the conv on a backend with ``conv_l2norm``, and ``rstd0, rstd1
  [B,T,size_i/l2norm_dim]`` their factors in the math dtype, empty without l2norm_dim, which the backward takes
  with y0 and y1); its backward returns one ``dmixed`` buffer, written in place by the kernels of a
  backend with ``grads_into`` (no ``[dx | da | db]`` concatenation), its parts copied in on the others
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..derived import derived_from_sizes
from . import cu_cache
from .reference import compute_dtype as math_dtype   # fp64 when any input is fp64, else fp32 (None ignored)
from .reference import l2norm_bwd_from_output, l2norm_rstd
from .registry import backend_by_name, fuses_l2norm

_EMPTY = (0,)
if isinstance(globals().get("_LIB"), torch.library.Library):
    # importlib.reload of this module (IPython's autoreload): the previous run's definitions, kernels and
    # fakes go first, as torch.library.custom_op does for a redefined op; a second copy of the module
    # (sys.modules purged while the first is alive) cannot define the namespace again and raises
    _LIB._destroy()
_LIB = torch.library.Library("gdn_layer", "DEF")


def _define(name: str, kernel, fake):
    """The operator ``gdn_layer::name`` with ``kernel``'s annotated signature as its schema, ``kernel`` for
    every device and ``fake`` for tracing and the meta device; returns its ``OpOverload``.

    ``kernel`` runs without recording autograd: the ops are differentiated by their Functions alone, and under
    ``create_graph=True`` a backward op's inputs (saved tensors, upstream gradients) require grad, where a
    torch-side part written into a gradient buffer's view would otherwise be refused (``_first_order`` ties the
    results to their inputs instead)."""
    _LIB.define(name + torch.library.infer_schema(kernel, mutates_args=()))
    _LIB.impl(name, torch.no_grad()(kernel), "CompositeExplicitAutograd")
    torch.library.register_fake(f"gdn_layer::{name}", fake, lib=_LIB)
    return getattr(torch.ops.gdn_layer, name).default


def _entry(function, op):
    """The public callable of an op: ``function.apply`` (autograd), or the operator ``op`` itself where
    autograd records nothing: grad disabled, or inference mode (where torch's own ops record nothing even
    under ``enable_grad``, and a Function could not save inference tensors). Always the Function while
    ``torch.compile`` traces (it traces grad mode itself)."""
    def call(*args):
        if torch.compiler.is_compiling() or (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()):
            return function.apply(*args)
        return op(*args)
    return call


class _NotTwiceDifferentiable(torch.autograd.Function):
    """Identity on an op's gradients computed under ``create_graph=True``; differentiating them raises."""

    @staticmethod
    def forward(ctx, name, count, *tensors):
        ctx.name = name
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"gdn_layer::{ctx.name} is not twice differentiable: its gradient was taken with "
                           "create_graph=True and is now being differentiated (double backward is not supported)")


def _first_order(name: str, grads: tuple, inputs) -> tuple:
    """``grads``, the backward operator's results; under ``create_graph=True`` (grad enabled in the
    backward) tied to ``inputs`` (the upstream gradients and saved tensors) through
    ``_NotTwiceDifferentiable``, so that a double backward reaching them raises instead of returning a
    partial or zero second derivative (the backward operators record no autograd)."""
    if not torch.is_grad_enabled():
        return grads
    anchors = [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]
    if not anchors:
        return grads
    return tuple(_NotTwiceDifferentiable.apply(name, len(grads), *grads, *anchors))   # (all tensors: empty, not None)


def _storages(tensors) -> set:
    """The storage addresses of the non-empty tensors among ``tensors`` (None skipped)."""
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None and t.numel()}


def _own(t: Tensor, *inputs, taken: set | None = None) -> Tensor:
    """``t`` made contiguous (the fake implementations promise contiguous outputs), and a copy of it
    where it shares memory with an input (a custom op must not alias them: e.g. the state of a
    zero-length sequence is its initial state). ``taken``: the inputs' storages, if already gathered."""
    t = t.contiguous()
    if t.numel() == 0:
        return t.new_empty(t.shape)
    if t.untyped_storage().data_ptr() in (_storages(inputs) if taken is None else taken):
        return t.clone()
    return t


def _distinct(outputs, *inputs) -> tuple:
    """``outputs`` with each one that shares memory with an input or an earlier output copied."""
    taken = _storages(inputs)
    result = []
    for t in outputs:
        t = _own(t, taken=taken)
        if t.numel():
            taken.add(t.untyped_storage().data_ptr())
        result.append(t)
    return tuple(result)


def _empty_like_none(t: Tensor | None, ref: Tensor) -> Tensor:
    return ref.new_empty(_EMPTY) if t is None else t


def _vjp(fwd, primals: tuple, cotangents: tuple) -> list:
    """Gradients of ``fwd(*primals)`` (pure torch, returning a tuple of tensors) for ``cotangents``.

    ``None`` primals get ``None`` gradients; a ``None`` cotangent counts as zeros.
    """
    slots = [i for i, p in enumerate(primals) if p is not None]

    def f(*diff):
        args = list(primals)
        for i, d in zip(slots, diff):
            args[i] = d
        return tuple(fwd(*args))

    outs, pullback = torch.func.vjp(f, *(primals[i].detach() for i in slots))
    cts = tuple(torch.zeros_like(o) if c is None else c for o, c in zip(outs, cotangents))
    full = [None] * len(primals)
    for i, d in zip(slots, pullback(cts)):
        full[i] = d
    return full


# ------------------------------------------------------------------------------------------------
# gated delta rule (chunk and recurrent share one schema)

def _delta_rule_fake(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm, backend,
                     save_residuals):
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    shape = (N, v.shape[2], q.shape[3], v.shape[3]) if output_final_state else _EMPTY
    # (residuals: empty, which is right where they are asked for only outside torch.compile: DeltaRule)
    return (v.new_empty(v.shape), q.new_empty(shape, dtype=math_dtype(q, k, v, g, beta, initial_state)),
            q.new_empty(_EMPTY), q.new_empty(_EMPTY))


_DENSE_CU: dict = {}


def _dense_cu(B: int, T: int, device: torch.device) -> torch.Tensor:
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
    cu = _dense_cu(B, T, q.device)
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

    fwd_op = _define(f"{kind}_gated_delta_rule", op, _delta_rule_fake)

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

    bwd_op = _define(f"{kind}_gated_delta_rule_bwd", bwd, bwd_fake)

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


# ------------------------------------------------------------------------------------------------
# causal conv1d

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


_conv_fwd_op = _define("causal_conv1d", _causal_conv1d, _causal_conv1d_fake)
_conv_bwd_op = _define("causal_conv1d_bwd", _causal_conv1d_bwd, lambda dy, dfinal, x, weight, bias, initial_state, *_:
                       _conv_bwd_fake(x, weight, bias, initial_state))


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


_conv_split_fwd_op = _define("causal_conv1d_split", _causal_conv1d_split, _causal_conv1d_split_fake)
_conv_split_bwd_op = _define("causal_conv1d_split_bwd", _causal_conv1d_split_bwd,
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


# ------------------------------------------------------------------------------------------------
# gate

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


_gate_fwd_op = _define("gdn_gate", _gdn_gate, _gdn_gate_fake)
_gate_bwd_op = _define("gdn_gate_bwd", _gdn_gate_bwd, lambda dg, dbeta, a, b, A_log, dt_bias, backend:
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


# ------------------------------------------------------------------------------------------------
# conv and gate of the layer's pre-conv buffer, one op

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


def _into_kwargs(impl, **buffers) -> dict:
    """The output views to hand a backend's backward: those given, on a backend with ``grads_into``."""
    return {k: v for k, v in buffers.items() if v is not None} if impl.grads_into else {}


def _into(buffer: Optional[Tensor], got: Tensor) -> Tensor:
    """``got``, the gradient computed for ``buffer`` (a view to fill, or None: ``got`` as it is). A ``grads_into``
    backend wrote ``buffer`` in place and returned it; another result (a backend without the flag, or one that
    returned a tensor of its own) is copied in."""
    if buffer is None:
        return got
    if not (got.data_ptr() == buffer.data_ptr() and got.shape == buffer.shape and got.stride() == buffer.stride()):
        buffer.copy_(got)
    return buffer


_conv_gate_fwd_op = _define("conv_gate", _conv_gate, _conv_gate_fake)
_conv_gate_bwd_op = _define("conv_gate_bwd", _conv_gate_bwd,
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


# ------------------------------------------------------------------------------------------------
# gated RMSNorm

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


_norm_fwd_op = _define("gated_rms_norm", _gated_rms_norm, _gated_rms_norm_fake)
_norm_bwd_op = _define("gated_rms_norm_bwd", _gated_rms_norm_bwd, lambda dy, x, z, weight, eps, backend:
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
