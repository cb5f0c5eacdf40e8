"""The split layout's two input projections of one ``x`` with one input gradient.

``mixed = x W_m^T`` (``[q | k | v | a | b]``, ``W_m`` the concatenated ``in_proj_qkv``, ``in_proj_a``,
``in_proj_b`` weights) and ``z = x W_z^T`` both read the layer's input. Through two ``F.linear`` calls autograd
adds their two input gradients in a separate elementwise pass over ``[T, hidden]`` (0.09 ms per step at
Qwen3-Next's shape, T = 32 768, on an H200: an ``aten::add`` under ``ViewBackward0``); here the second GEMM
accumulates into the first one's output instead (``addmm_``, beta = 1 in cuBLAS's epilogue), and the weights'
gradients are the same two GEMMs as ``F.linear``'s. In an autograd graph or a profile it is one node,
``_TwoProjectionsBackward``, running ``mm`` then ``addmm_`` for dx and one ``mm`` per weight.

The layer (``GatedDeltaNet._project``) uses it for ``projection_layout="split"`` without SP when all four
projections are plain bias-free ``nn.Linear`` modules (no hook, wrapper or replaced forward: those are called as
modules) of one dtype and device; ``two_projections`` itself then falls back to two ``F.linear`` calls in the
cases its docstring lists.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gdn_layer.state import autograd_records
from gdn_layer.submodules import unhooked


def plain_linear(m: nn.Module) -> bool:
    """A bias-free ``nn.Linear`` itself, whose weight may be used directly: no subclass, no ``forward``
    replaced on the instance (accelerate-style wrapping), no forward or backward hook of its own or global."""
    return type(m) is nn.Linear and m.bias is None and "forward" not in m.__dict__ and unhooked(m)


class _TwoProjections(torch.autograd.Function):
    """``(F.linear(x, w_m), F.linear(x, w_z))`` with ``dx = d_m @ w_m + d_z @ w_z`` in two GEMMs, the second
    accumulating into the first's output. Saves what ``F.linear`` would: x only for the weights' gradients, the
    weights only for x's; an output without a gradient contributes nothing (its weight's gradient stays None)."""

    # (forward takes ctx: with a separate setup_context, Function.apply binds the arguments through
    # inspect.signature at every call, some 15 us of host time)
    @staticmethod
    def forward(ctx, x, w_m, w_z):
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.save_for_backward(x if need_w else None, w_m if need_x else None, w_z if need_x else None)
        ctx.x_shape = x.shape
        ctx.set_materialize_grads(False)
        return F.linear(x, w_m), F.linear(x, w_z)

    @staticmethod
    def backward(ctx, d_m, d_z):
        x, w_m, w_z = ctx.saved_tensors
        rows = lambda t: t.reshape(-1, t.shape[-1])   # noqa: E731  ([..., n] -> [tokens, n]; a copy only if strided)
        dx = dw_m = dw_z = None
        if ctx.needs_input_grad[0]:
            if d_m is not None:
                dx = torch.mm(rows(d_m), w_m)
            if d_z is not None:
                dx = torch.mm(rows(d_z), w_z) if dx is None else dx.addmm_(rows(d_z), w_z)
            dx = None if dx is None else dx.view(ctx.x_shape)
        if ctx.needs_input_grad[1] and d_m is not None:
            dw_m = rows(d_m).t().mm(rows(x))
        if ctx.needs_input_grad[2] and d_z is not None:
            dw_z = rows(d_z).t().mm(rows(x))
        return dx, dw_m, dw_z


def _plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, torch.nn.Parameter)


def two_projections(x: torch.Tensor, w_m: torch.Tensor, w_z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(x, w_m), F.linear(x, w_z))``, bias-free, with the two input gradients summed inside the
    backward's GEMMs rather than by autograd.

    Args:
        x: ``[..., hidden]``; w_m: ``[F_m, hidden]``; w_z: ``[F_z, hidden]``; one floating dtype and device.

    Returns:
        ``[..., F_m]`` and ``[..., F_z]`` in x's dtype, values and gradients those of the two ``F.linear``
        calls (up to the order of one floating-point sum per input-gradient element).

    The fused backward is used only with grad mode on and ``x`` needing a gradient, plain tensors (no subclass
    such as DTensor), one floating dtype, a device type autocast knows (cpu, cuda, ...) with autocast off there,
    and not while ``torch.compile`` traces (its own fusion applies there); otherwise the two ``F.linear`` calls
    run as they are (and raise as they do). It saves the same tensors as they would. Unlike ``F.linear`` it has
    no forward-mode AD (``jvp``) or ``vmap`` rule (nor has the layer's conv / chunk ops: the layer supports neither).
    """
    dev = x.device.type
    if (torch.is_grad_enabled() and x.requires_grad and _plain(x) and _plain(w_m) and _plain(w_z)
            and x.dtype == w_m.dtype == w_z.dtype and x.is_floating_point() and dev != "meta"
            and torch.amp.is_autocast_available(dev) and not torch.is_autocast_enabled(dev)
            and not torch.compiler.is_compiling()):
        return _TwoProjections.apply(x, w_m, w_z)
    return F.linear(x, w_m), F.linear(x, w_z)


def few_token_projections(x: torch.Tensor, parts, z_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(mixed, z)`` by one GEMM per weight of ``parts`` and a concatenation of the outputs, for a call autograd
    does not record with fewer tokens than ``hidden`` (decode, a short chunk), else None. The layer's usual
    ``x @ cat(W_qkv, W_a, W_b)^T`` copies the weights (``hidden x (conv_dim + 2 Hv)`` elements, 34 MB in bf16 at
    Qwen3-Next's shape) at every call; with fewer tokens than ``hidden`` the outputs are the smaller copy.
    ``parts``: the weights of plain bias-free ``nn.Linear`` modules (``plain_linear``), ``z_weight`` too."""
    tokens = x.numel() // x.shape[-1]
    # (not while torch.compile traces: a branch on the token count would guard a dynamic length)
    if autograd_records(x, (*parts, z_weight)) or torch.compiler.is_compiling() or tokens >= x.shape[-1]:
        return None
    return torch.cat([F.linear(x, w) for w in parts], -1), F.linear(x, z_weight)


def split_projections(x: torch.Tensor, w_qkv: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor,
                      w_z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The split layout's ``(mixed [..., C + 2 Hv], z [..., Hv Dv])`` from plain bias-free projection weights of
    x's dtype and device: ``few_token_projections``, else one GEMM on the concatenated weights and one for z
    (``two_projections``)."""
    parts = (w_qkv, w_a, w_b)
    return few_token_projections(x, parts, w_z) or two_projections(x, torch.cat(parts), w_z)
