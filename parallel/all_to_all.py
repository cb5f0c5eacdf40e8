"""The Ulysses all-to-all pair: sequence-sharded <-> feature(head)-sharded, with autograd.

Each direction moves ONE contiguous buffer with ``torch.distributed.all_to_all_single`` (equal splits
along dim 0), which gloo, NCCL and HCCL all implement; packing every tensor of a layer (q, k, v, a, b)
into the feature dim of one buffer keeps it to one collective per direction.

Layout conventions (P = group size, rank i):

- sequence-sharded: ``[B, T_local, F]``, rank i holds tokens ``[i*T_local, (i+1)*T_local)`` of the global
  ``T = P * T_local`` and all F features.
- feature-sharded: ``[B, T, F_out]``, every token in global order, only this rank's features.

Each byte is moved once on each side of the collective. Both buffers are ``[P, T_local, B, F_out]``
(block d goes to / came from rank d; tokens before batch): ``seq_to_head`` writes its send buffer with
a few slice copies (``feature_plan``: no gather) and returns the receive buffer as a view,
``[P*T_local, B, F_out]`` transposed to ``[B, T, F_out]``, a view for every B. The backward is the
reverse collective plus the same slice copies, adding only where a feature went to several ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .feature_plan import pack, plan_for, unpack
from .groups import resolve_sp_group


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    """``out[s] = send_of_rank_s[me]`` for a contiguous ``[P, ...]`` buffer; no group: ``send`` itself."""
    if group is None:
        return send
    out = torch.empty_like(send)
    dist.all_to_all_single(out, send, group=group)
    return out


class _SeqToHead(torch.autograd.Function):
    """``x [B, T_local, F]`` -> receive buffer ``[P, T_local, B, F_out]`` (``None`` group: P = 1, no collective).

    Backward: the reverse all-to-all of the gradient, then ``feature_plan.unpack`` (copies, adds where
    features repeat, zeros where none was sent).
    """

    @staticmethod
    def forward(ctx, x, feature_index, plan, group):
        ctx.plan, ctx.group, ctx.F = plan, group, x.shape[2]
        ctx.save_for_backward(feature_index)
        B, T_local, _ = x.shape
        send = x.new_empty(plan.rows, T_local, B, plan.width)
        pack(x, plan, feature_index, send)
        return _exchange(send, group)

    @staticmethod
    def backward(ctx, grad):
        (feature_index,) = ctx.saved_tensors
        # the exchange reads grad and writes a new buffer: the incoming gradient is never modified
        back = _exchange(grad.contiguous(), ctx.group)
        return unpack(back, ctx.plan, feature_index, ctx.F), None, None, None


class _HeadToSeq(torch.autograd.Function):
    """``x [B, T, F_local]`` -> ``[B, T_local, P * F_local]`` (features by source rank); backward the reverse."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        B, T, F_local = x.shape
        T_local = T // size
        # [T, B, F_local] order: no copy when x is already laid out so (B == 1, or seq_to_head's output)
        send = x.transpose(0, 1).reshape(size, T_local, B, F_local).contiguous()
        recv = _exchange(send, group)                   # block s: rank s's features of my tokens
        out = x.new_empty(B, T_local, size * F_local)
        out.view(B, T_local, size, F_local).copy_(recv.permute(2, 1, 0, 3))
        return out

    @staticmethod
    def backward(ctx, grad):
        B, T_local, _ = grad.shape
        P = ctx.size
        send = grad.new_empty(P, T_local, B, grad.shape[2] // P)
        send.copy_(grad.unflatten(2, (P, -1)).permute(2, 1, 0, 3))
        back = _exchange(send, ctx.group)               # block s: my features of rank s's tokens
        return back.view(P * T_local, B, -1).transpose(0, 1), None, None


def _check_3d(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D [B, T, F], got shape {tuple(x.shape)}")


def _checked_plan(feature_index, size: int, device, F: int, what: str):
    """``feature_plan.plan_for(feature_index)`` after checking it is int64 ``[size, F_out]`` on ``device``
    with indices in ``[0, F)``."""
    if not isinstance(feature_index, torch.Tensor):
        raise TypeError(f"feature_index must be a torch.Tensor, got {type(feature_index).__name__}")
    if feature_index.dtype != torch.int64:
        raise TypeError(f"feature_index must be int64 (torch.long), got {feature_index.dtype}")
    if feature_index.dim() != 2 or feature_index.shape[0] != size:
        raise ValueError(f"feature_index must be [P, F_out] with P = SP size = {size}, "
                         f"got shape {tuple(feature_index.shape)}")
    if feature_index.device != device:
        raise ValueError(f"feature_index is on {feature_index.device} but x is on {device}; "
                         "build it once on x.device")
    plan = plan_for(feature_index)
    if plan.lo < 0 or plan.hi >= F:
        raise ValueError(f"feature_index must hold indices in [0, {what} = {F}), got min {plan.lo}, max {plan.hi}")
    return plan


class _Exchange(torch.autograd.Function):
    """``_exchange`` with autograd: an all-to-all of equal blocks is its own adjoint (the gradient of the
    block received from rank s goes back to rank s)."""

    @staticmethod
    def forward(ctx, send, group):
        ctx.group = group
        return _exchange(send, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.group), None


def project_seq_to_head(x: torch.Tensor, weight: torch.Tensor, feature_index: torch.Tensor, group) -> torch.Tensor:
    """``seq_to_head(F.linear(x, weight), feature_index, group)`` without materialising the projection:
    one batched GEMM writes each destination rank's features straight into the all-to-all's send buffer.

    Args:
        x: ``[B, T_local, H]`` (sequence-sharded, as for ``seq_to_head``).
        weight: ``[F, H]``, a bias-free linear projection to the F features that ``feature_index`` picks.
        feature_index, group: as for ``seq_to_head`` (indices into the F output features).

    Returns:
        ``[B, T_local * P, F_out]``, the same values, layout and strides as ``seq_to_head`` of the
        projection. Forward: the rows of ``weight`` gathered per rank (``[P, F_out, H]``, weight-sized),
        ``send[d] = x @ W_d^T`` by ``torch.bmm`` into ``[P, T_local, B, F_out]``, one all-to-all.
        Backward: the reverse all-to-all, then the GEMM's backward (dx summed over destinations;
        dweight accumulated by ``index_select``'s backward, so rows sent to several ranks add up).

    Raises:
        TypeError / ValueError: as ``seq_to_head``; weight not 2-D ``[F, H]`` matching x's last dim.
    """
    group, size, _ = resolve_sp_group(group)
    _check_3d("x", x)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [F, H] with H = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}")
    plan = _checked_plan(feature_index, size, x.device, weight.shape[0], "F = weight.shape[0]")
    B, T_local, H = x.shape
    w = weight.index_select(0, feature_index.flatten()).view(size, plan.width, H)
    rows = x.transpose(0, 1).reshape(T_local * B, H)           # tokens before batch (a view when B == 1)
    send = torch.bmm(rows.expand(size, T_local * B, H), w.transpose(1, 2))
    recv = _Exchange.apply(send, group) if size > 1 else send
    return recv.view(size * T_local, B, plan.width).transpose(0, 1)


def seq_to_head(x: torch.Tensor, feature_index: torch.Tensor, group) -> torch.Tensor:
    """Sequence-sharded -> feature-sharded: gather the full sequence of this rank's features.

    Args:
        x: ``[B, T_local, F]``, any dtype the backend moves, any strides; rank i holds tokens
            ``[i*T_local, (i+1)*T_local)``. Every rank must pass the same shape.
        feature_index: int64 ``[P, F_out]`` on ``x.device``; row d lists which of the F features rank d
            receives, in the order it receives them. Rows may overlap (replicated q/k heads); must be
            identical on every rank. Read on the host once per tensor (one device->host copy the first
            time, cached by tensor identity and version counter): keep the tensor, e.g. as a buffer.
        group: None, a ProcessGroup or a 1-D DeviceMesh (see ``resolve_sp_group``).

    Returns:
        ``[B, T_local * P, F_out]``: all tokens in global order, features ``x[..., feature_index[rank]]``.
        With no group (or size 1): ``x[..., feature_index[0]]``. A view of the receive buffer with
        strides ``(F_out, B * F_out, 1)`` (contiguous when B == 1): consumers must accept a batch
        stride smaller than the token stride when B > 1.

    How: rows made of at most ``feature_plan.MAX_RUNS_PER_ROW`` contiguous runs (the layer's rows are
    5) are written into the send buffer by slice copies, one per run shared by all rows whose runs
    advance by a constant step; other rows are gathered with ``index_select``.

    Backward: the reverse all-to-all, then the same slices copied back into the F features; a feature
    sent to several ranks receives the sum of their gradients (an add per extra copy, or ``index_add_``
    for gathered rows), a feature sent nowhere a zero gradient.

    Raises:
        TypeError: x or feature_index not a tensor, feature_index not int64.
        ValueError: x not 3-D; feature_index not ``[P, F_out]``, not on x.device, or holding an index
            outside ``[0, F)``.
    """
    group, size, _ = resolve_sp_group(group)
    _check_3d("x", x)
    plan = _checked_plan(feature_index, size, x.device, x.shape[-1], "F")
    B, T_local, _ = x.shape
    recv = _SeqToHead.apply(x, feature_index, plan, group if size > 1 else None)
    # [P, T_local, B, F_out] is [T, B, F_out] in global token order: a view for every B
    return recv.view(size * T_local, B, plan.width).transpose(0, 1)


def head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Feature-sharded -> sequence-sharded: the inverse layout change of ``seq_to_head``.

    Args:
        x: ``[B, T, F_local]``: every token in global order, this rank's F_local features, any strides
            (no copy before the collective when B == 1 and x is contiguous, or when x is
            ``seq_to_head``'s layout). Every rank must pass the same shape.
        group: None, a ProcessGroup or a 1-D DeviceMesh.

    Returns:
        ``[B, T / P, P * F_local]``, contiguous: rank i's tokens ``[i*T/P, (i+1)*T/P)``, features ordered
        by source rank: ``[features of rank 0 | features of rank 1 | ... ]`` (one copy out of the
        receive buffer, which holds them by source rank first). With no group (or size 1): x.

    Backward: the gradient copied once into the send layout, then the reverse all-to-all; the
    returned gradient is a view of the receive buffer (``[T, B, F_local]`` order).

    Raises:
        TypeError: x not a tensor.
        ValueError: x not 3-D, or T not divisible by P (pad the sequence with ``pad_for_sp`` first).
    """
    group, size, _ = resolve_sp_group(group)
    _check_3d("x", x)
    if size == 1:
        return x
    T = x.shape[1]
    if T % size != 0:
        raise ValueError(f"x.shape[1] = T = {T} must be divisible by the SP size {size}; "
                         "pad the sequence with gdn_layer.parallel.pad_for_sp")
    return _HeadToSeq.apply(x, group, size)


__all__ = ["seq_to_head", "head_to_seq", "project_seq_to_head"]
