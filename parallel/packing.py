"""Pad, shard and gather packed batches along the sequence dim for Ulysses SP.

Padding rule (``pad_for_sp``): the sequence is padded with zeros at its END up to a multiple of the SP
size. The layer is causal, so tokens after the last real token never change a real token's output:
``y[:, :T]`` of the padded run equals the unpadded output. With ``cu_seqlens`` the pad also becomes its
own trailing segment, so even the recurrent/conv state of every real sequence is untouched by it.
"""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from gdn_layer.kernels import cu_cache
from gdn_layer.kernels.validation import check_cu_seqlens

from .groups import resolve_sp_group


def _check_sp_size(sp_size) -> None:
    if not isinstance(sp_size, int) or isinstance(sp_size, bool) or sp_size < 1:
        raise ValueError(f"sp_size must be a positive int, got {sp_size!r}")


def pad_for_sp(hidden_states: torch.Tensor, cu_seqlens: torch.Tensor | None, sp_size: int
               ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """Pad the sequence dim up to a multiple of ``sp_size`` so it can be sharded evenly.

    Args:
        hidden_states: ``[B, T, ...]`` (any dtype/device); dim 1 is the (global) sequence.
        cu_seqlens: None, or 1-D int32/int64 ``[N + 1]`` packed-sequence boundaries with ``cu[-1] == T``
            (then ``B == 1``), validated with ``gdn_layer.kernels.validation.check_cu_seqlens``.
        sp_size: the SP group size P (positive int).

    Returns:
        ``(padded, padded_cu_seqlens, pad_len)`` with ``pad_len = (-T) % P`` and ``padded``
        ``[B, T + pad_len, ...]`` (zeros appended; ``hidden_states`` itself when ``pad_len == 0``;
        autograd flows to the real tokens). ``padded_cu_seqlens``:

        - cu_seqlens given: ``pad_len == 0`` -> ``cu_seqlens`` unchanged (same object); otherwise
          ``cu_seqlens`` with ``T + pad_len`` appended, same dtype and device: the pad is its own
          segment, so N grows by one and the last entry of any per-sequence output (e.g. final state)
          belongs to the pad.
        - cu_seqlens None, ``pad_len == 0``: None.
        - cu_seqlens None, ``pad_len > 0``, ``B == 1``: int64 ``[0, T, T + pad_len]`` on
          ``hidden_states.device``, so the real sequence's final state stays separate (N = 2).
        - cu_seqlens None, ``pad_len > 0``, ``B > 1``: None. Every row is padded at its end; real outputs
          are unchanged (causality), but a final state taken from this run would include the pad tokens
          — pack into ``B == 1`` with cu_seqlens when the states matter.

        Drop the pad from an output with ``y[:, :T]``.

    Raises:
        TypeError: hidden_states not a tensor; cu_seqlens not a tensor.
        ValueError: hidden_states with fewer than 2 dims; sp_size not a positive int; cu_seqlens with
            ``B != 1`` or malformed (see ``check_cu_seqlens``).
    """
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
    if hidden_states.dim() < 2:
        raise ValueError(f"hidden_states must be [B, T, ...], got shape {tuple(hidden_states.shape)}")
    _check_sp_size(sp_size)
    B, T = hidden_states.shape[:2]
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {B}")
        check_cu_seqlens(cu_seqlens, T)
    pad_len = (-T) % sp_size
    if pad_len == 0:
        return hidden_states, cu_seqlens, 0
    zeros = hidden_states.new_zeros((B, pad_len, *hidden_states.shape[2:]))
    padded = torch.cat([hidden_states, zeros], dim=1)
    if cu_seqlens is not None:
        tail = torch.tensor([T + pad_len], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
        return padded, torch.cat([cu_seqlens, tail]), pad_len
    if B == 1:
        cu = torch.tensor([0, T, T + pad_len], dtype=torch.int64, device=hidden_states.device)
        return padded, cu, pad_len
    return padded, None, pad_len


def positive_int(name: str, value) -> int:
    """``value`` as an int; TypeError unless it is an integer (not a bool), ValueError below 1 (naming ``name``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return int(value)


def pad_cu_seqlens(cu_seqlens: torch.Tensor, max_num_seqs: int) -> torch.Tensor:
    """Pad packed boundaries to a fixed capacity of ``max_num_seqs`` sequences with empty segments.

    A pack of exactly T tokens whose ``cu_seqlens`` always holds ``max_num_seqs + 1`` entries has fixed
    shapes whatever its number of documents: the form a CUDA graph captured once can replay over every
    packing (``static_cu.copy_(pad_cu_seqlens(cu, n_max))``), and ``torch.compile`` sees one size. The
    padding repeats ``cu[-1]`` (zero-length segments, legal everywhere in this project): every real
    sequence keeps its index, and per-sequence outputs (final states) gain rows ``N .. max_num_seqs - 1``
    for the empty segments (their final state is their initial state, zeros by default).

    Runs on ``cu_seqlens``'s device with no host read (no sync on accelerators): the length check uses
    only the shape; the values are checked (``check_cu_seqlens``) only where value checks run
    (always on CPU, on accelerators when validation is switched on). Where ``cu_seqlens``'s values are
    known on the host without a read (it was copied from the CPU by the layer, or padded from such a
    tensor), the padded tensor's are recorded too, so FlashQLA's chunk layout needs no read either.

    Args:
        cu_seqlens: 1-D int32/int64 ``[N + 1]`` boundaries, ``cu[0] == 0``, non-decreasing.
        max_num_seqs: the capacity ``N_max`` (positive int), ``N <= N_max``.

    Returns:
        ``[max_num_seqs + 1]``, same dtype and device: ``cu_seqlens`` followed by ``max_num_seqs - N``
        copies of ``cu[-1]``; ``cu_seqlens`` itself (same object) when ``N == max_num_seqs``.

    Raises:
        TypeError: cu_seqlens not a tensor; max_num_seqs not an int.
        ValueError: cu_seqlens malformed (see ``check_cu_seqlens``); max_num_seqs < 1, or fewer than
            the N sequences cu_seqlens already holds.
    """
    max_num_seqs = positive_int("max_num_seqs", max_num_seqs)
    check_cu_seqlens(cu_seqlens, None)
    n = cu_seqlens.numel() - 1
    if n > max_num_seqs:
        raise ValueError(f"cu_seqlens holds N = {n} sequences, more than the capacity max_num_seqs = "
                         f"{max_num_seqs}; raise max_num_seqs or split the pack")
    if n == max_num_seqs:
        return cu_seqlens
    out = torch.cat([cu_seqlens, cu_seqlens[-1:].expand(max_num_seqs - n)])
    host = cu_cache.known_host(cu_seqlens)
    if host is not None and out.device.type != "cpu":      # the values stay known without a device read
        cu_cache.remember(out, "host", torch.cat([host, host[-1:].expand(max_num_seqs - n)]).to(torch.int64))
    return out


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [{-x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, "
                         f"got {dim!r}")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, sp_group, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous ``1/P`` slice of ``x`` along ``dim``.

    Args:
        x: any tensor whose ``dim`` (default 1, the T of ``[B, T, ...]``) is the global sequence; the same
            on every rank.
        sp_group: None, a ProcessGroup or a 1-D DeviceMesh.
        dim: the sequence dim.

    Returns:
        ``x.narrow(dim, rank * L, L)`` with ``L = x.shape[dim] / P`` (a view; x itself without a group).
        Its gradient flows only into that slice of x.

    Raises:
        TypeError: x not a tensor. ValueError: bad ``dim``, or ``x.shape[dim]`` not divisible by P
        (pad with ``pad_for_sp`` first).
    """
    group, size, rank = resolve_sp_group(sp_group)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    dim = _check_dim(x, dim)
    if size == 1:
        return x
    n = x.shape[dim]
    if n % size != 0:
        raise ValueError(f"x.shape[{dim}] = {n} must be divisible by the SP size {size}; "
                         "pad the sequence with gdn_layer.parallel.pad_for_sp first")
    L = n // size
    return x.narrow(dim, rank * L, L)


def _all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    """``out[r*n:(r+1)*n] = inp of rank r`` for 1-D ``inp`` of n elements."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); torch >= 2.4
    # has at least the old one.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


class _GatherSequence(torch.autograd.Function):
    """all_gather along ``dim``; backward keeps this rank's slice of the gradient, of this rank's own
    gradient (``grad="slice"``) or of the sum over ranks (``grad="sum"``); see gather_sequence."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, size: int, rank: int, dim: int, sum_grads: bool) -> torch.Tensor:
        ctx.dim, ctx.rank, ctx.L, ctx.group, ctx.sum_grads = dim, rank, x.shape[dim], group, sum_grads
        # One flat contiguous buffer, rank-major: the flat form is accepted by gloo, NCCL and HCCL alike.
        out = x.new_empty(size * x.numel())
        _all_gather_flat(out, x.contiguous().view(-1), group)
        # [P, ..., L, ...] -> [..., P, L, ...] -> [..., P*L, ...]: rank order is sequence order.
        out = out.view(size, *x.shape).movedim(0, dim)
        return out.reshape(*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1:])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.sum_grads:
            # all_reduce writes its buffer in place, and the incoming gradient may be shared (another
            # branch's gradient, or the tensor the caller passed to .backward): reduce a copy
            grad = grad.clone(memory_format=torch.contiguous_format)
            dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad.narrow(ctx.dim, ctx.rank * ctx.L, ctx.L), None, None, None, None, None


def gather_sequence(x: torch.Tensor, sp_group, dim: int = 1, grad: str = "slice") -> torch.Tensor:
    """All-gather the sequence shards of every rank along ``dim`` (inverse of ``shard_sequence``).

    Args:
        x: this rank's shard, e.g. ``[B, T_local, ...]``; same shape on every rank.
        sp_group: None, a ProcessGroup or a 1-D DeviceMesh.
        dim: the sequence dim.
        grad: what backward does, ``"slice"`` (default) or ``"sum"``, see below.

    Returns:
        ``[..., P * x.shape[dim], ...]``: shards concatenated in rank order (x itself without a group).

    Backward, ``grad="slice"``: keeps this rank's slice of the incoming gradient, with no collective.
    Right when the loss computed from the gathered tensor is the SAME on every rank (every rank holds
    the same full tensor and computes the same loss): then rank i's slice is exactly dLoss/d(shard i),
    and after ``reduce_sp_grads`` (a sum over ranks) parameter gradients equal the single-process ones.

    Backward, ``grad="sum"``: all-reduces (a copy of) the incoming gradient over the group, then keeps
    this rank's slice; the incoming gradient itself is never written. Right when each rank computes a
    DIFFERENT part of the loss from the gathered tensor, e.g. a softmax-attention layer in an SP model:
    every rank attends over the full sequence but keeps (and is scored on) only its own slice of the
    output, so every rank's loss depends on every shard.

    Raises:
        TypeError: x not a tensor. ValueError: bad ``dim`` or ``grad``.
    """
    group, size, rank = resolve_sp_group(sp_group)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if grad not in ("slice", "sum"):
        raise ValueError(f"grad must be 'slice' or 'sum', got {grad!r}")
    dim = _check_dim(x, dim)
    if size == 1:
        return x
    return _GatherSequence.apply(x, group, size, rank, dim, grad == "sum")


__all__ = ["pad_for_sp", "pad_cu_seqlens", "shard_sequence", "gather_sequence"]
