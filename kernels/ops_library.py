"""How every backend's math becomes ``torch.library`` operators (namespace ``gdn_layer``), and what the ops share.

Why: ``torch.compile`` sees one opaque op per kernel (with a fake implementation for shapes), so a new
packed length or sequence count is just new symbolic sizes, never a graph break or a recompile; and
autograd is written once, in the ``ops_*.py`` modules, for every backend.

Each op takes the resolved backend's name as a string argument and calls that backend's forward
callable; its backward is a second op that calls the backend's backward callable, or, for a
backend that gives none (the torch reference, or a user-registered pure-torch backend), the
vector-Jacobian product of its forward through ``torch.func.vjp`` (``_vjp``: plain autograd does not record
inside an op). Backward ops recompute what they need from the inputs: nothing but the inputs
is saved for backward, except what a backend's chunk forward hands its backward (``Backend.chunk_residuals``)
and the conv's normalised q / k with their factors (``conv_gate``).

How: each op is defined with ``torch.library.Library.define`` (the schema inferred from the Python
signature, ``torch.library.infer_schema``), one kernel for every device (``CompositeExplicitAutograd``)
and a fake implementation (``torch.library.register_fake``): ``_define``; autograd is a ``torch.autograd.Function``
around the forward op whose backward calls the backward op. That costs the host about half of what
``torch.library.custom_op`` with ``register_autograd`` costs per forward+backward (its Python wrappers
check aliasing and fill defaults on every call): 15 against 32 µs per op on a 2-core CPU (docs/performance.md).
The public entry points are each module's ``*_op`` callables (``_entry``): the
Function where autograd records, the operator itself under ``no_grad`` / ``inference_mode``. The
``torch.ops.gdn_layer`` operators have no autograd formula of their own: called directly on tensors that
require grad, what autograd sees depends on the backend's kernel (nothing, for the Triton kernels: torch
warns at backward and the inputs get no gradient). Call ``gdn_layer.kernels``' functions instead.
The gradients are first-order only: differentiating them (``create_graph=True``, then backward) raises
(``_first_order``).

The ops (inputs already validated by ``api.py``; optional outputs come back as empty tensors), one module per
family: ``ops_delta_rule.py`` (``chunk_gated_delta_rule``, ``recurrent_gated_delta_rule``), ``ops_conv.py``
(``causal_conv1d``, ``causal_conv1d_split``), ``ops_gate.py`` (``gdn_gate``), ``ops_conv_gate.py`` (``conv_gate``:
the layer's conv and gate in one op) and ``ops_norm.py`` (``gated_rms_norm``). Each defines its ops in a
``library`` fragment of its own, so that reloading one module redefines its ops alone.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

_EMPTY = (0,)


def library(previous) -> torch.library.Library:
    """A fragment of the ``gdn_layer`` namespace for one module's ops. ``previous``: the module's ``_LIB`` before
    this run of it (``globals().get("_LIB")``): on ``importlib.reload`` (IPython's autoreload) its definitions,
    kernels and fakes go first, as ``torch.library.custom_op`` does for a redefined op; a second copy of the
    module (sys.modules purged while the first is alive) cannot define its ops again and raises."""
    if isinstance(previous, torch.library.Library):
        previous._destroy()
    return torch.library.Library("gdn_layer", "FRAGMENT")


def _define(lib: torch.library.Library, name: str, kernel, fake):
    """The operator ``gdn_layer::name``, defined in ``lib`` (``library``), with ``kernel``'s annotated signature as
    its schema, ``kernel`` for every device and ``fake`` for tracing and the meta device; returns its ``OpOverload``.

    ``kernel`` runs without recording autograd: the ops are differentiated by their Functions alone, and under
    ``create_graph=True`` a backward op's inputs (saved tensors, upstream gradients) require grad, where a
    torch-side part written into a gradient buffer's view would otherwise be refused (``_first_order`` ties the
    results to their inputs instead)."""
    lib.define(name + torch.library.infer_schema(kernel, mutates_args=()))
    lib.impl(name, torch.no_grad()(kernel), "CompositeExplicitAutograd")
    torch.library.register_fake(f"gdn_layer::{name}", fake, lib=lib)
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
