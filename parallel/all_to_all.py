"""The Ulysses all-to-all pair: sequence-sharded <-> feature(head)-sharded, with autograd.

Each direction moves ONE contiguous buffer with ``torch.distributed.all_to_all_single`` (equal splits
along dim 0), which gloo, NCCL and HCCL all implement; packing every tensor of a layer (q, k, v, a, b)
into the feature dim of one buffer keeps it to one collective per direction.

Layout conventions (P = group size, rank i):

- sequence-sharded: ``[B, T_local, F]``, rank i holds tokens ``[i*T_local, (i+1)*T_local)`` of the global
  ``T = P * T_local`` and all F features.
- feature-sharded: ``[B, T, F_out]``, every token in global order, only this rank's features.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import resolve_sp_group


class _AllToAll(torch.autograd.Function):
    """``out[s] = buf_of_rank_s[me]`` for a ``[P, ...]`` buffer: block d goes to rank d.

    The exchange is its own adjoint (block (s -> d) comes back as (d -> s)), so backward is the same
    all-to-all applied to the gradient.
    """

    @staticmethod
    def forward(ctx, buf: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = torch.empty_like(buf)
        dist.all_to_all_single(out, buf, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def _check_3d(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D [B, T, F], got shape {tuple(x.shape)}")


def seq_to_head(x: torch.Tensor, feature_index: torch.Tensor, group) -> torch.Tensor:
    """Sequence-sharded -> feature-sharded: gather the full sequence of this rank's features.

    Args:
        x: ``[B, T_local, F]``, any dtype the backend moves; rank i holds tokens
            ``[i*T_local, (i+1)*T_local)``. Every rank must pass the same shape.
        feature_index: int64 ``[P, F_out]`` on ``x.device``; row d lists which of the F features rank d
            receives, in the order it receives them. Rows may overlap (replicated q/k heads); must be
            identical on every rank.
        group: None, a ProcessGroup or a 1-D DeviceMesh (see ``resolve_sp_group``).

    Returns:
        ``[B, T_local * P, F_out]``: all tokens in global order, features ``x[..., feature_index[rank]]``.
        With no group (or size 1): ``x[..., feature_index[0]]``.

    Backward: the reverse all-to-all, then a scatter-add into the F features, so a feature sent to
    several ranks receives the sum of their gradients.

    Raises:
        TypeError: x or feature_index not a tensor, feature_index not int64.
        ValueError: x not 3-D; feature_index not ``[P, F_out]``, not on x.device, or (CPU only, no sync)
            holding an index outside ``[0, F)``.
    """
    group, size, _ = resolve_sp_group(group)
    _check_3d("x", x)
    if not isinstance(feature_index, torch.Tensor):
        raise TypeError(f"feature_index must be a torch.Tensor, got {type(feature_index).__name__}")
    if feature_index.dtype != torch.int64:
        raise TypeError(f"feature_index must be int64 (torch.long), got {feature_index.dtype}")
    if feature_index.dim() != 2 or feature_index.shape[0] != size:
        raise ValueError(f"feature_index must be [P, F_out] with P = SP size = {size}, "
                         f"got shape {tuple(feature_index.shape)}")
    if feature_index.device != x.device:
        raise ValueError(f"feature_index is on {feature_index.device} but x is on {x.device}; "
                         "build it once on x.device")
    F = x.shape[-1]
    # Reading the values of a device tensor would sync; the indexing kernel bounds-checks there.
    if feature_index.device.type == "cpu" and feature_index.numel() > 0:
        lo, hi = int(feature_index.min()), int(feature_index.max())
        if lo < 0 or hi >= F:
            raise ValueError(f"feature_index must hold indices in [0, F = {F}), got min {lo}, max {hi}")
    if size == 1:
        return x[..., feature_index[0]]
    B, T_local, _ = x.shape
    picked = x[..., feature_index]                      # [B, T_local, P, F_out]; autograd scatter-adds
    send = picked.permute(2, 0, 1, 3).contiguous()      # [P, B, T_local, F_out]: block d -> rank d
    recv = _AllToAll.apply(send, group)                 # [P, B, T_local, F_out]: block s from rank s
    return recv.permute(1, 0, 2, 3).reshape(B, size * T_local, feature_index.shape[1])


def head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Feature-sharded -> sequence-sharded: the inverse layout change of ``seq_to_head``.

    Args:
        x: ``[B, T, F_local]``: every token in global order, this rank's F_local features. Every rank
            must pass the same shape.
        group: None, a ProcessGroup or a 1-D DeviceMesh.

    Returns:
        ``[B, T / P, P * F_local]``: rank i's tokens ``[i*T/P, (i+1)*T/P)``, features ordered by source
        rank: ``[features of rank 0 | features of rank 1 | ... ]``. With no group (or size 1): x.

    Backward: the reverse all-to-all.

    Raises:
        TypeError: x not a tensor.
        ValueError: x not 3-D, or T not divisible by P (pad the sequence with ``pad_for_sp`` first).
    """
    group, size, _ = resolve_sp_group(group)
    _check_3d("x", x)
    if size == 1:
        return x
    B, T, F_local = x.shape
    if T % size != 0:
        raise ValueError(f"x.shape[1] = T = {T} must be divisible by the SP size {size}; "
                         "pad the sequence with gdn_layer.parallel.pad_for_sp")
    T_local = T // size
    send = x.reshape(B, size, T_local, F_local).transpose(0, 1).contiguous()   # [P, B, T_local, F_local]
    recv = _AllToAll.apply(send, group)                 # block s: rank s's features for my tokens
    return recv.permute(1, 2, 0, 3).reshape(B, T_local, size * F_local)


__all__ = ["seq_to_head", "head_to_seq"]
