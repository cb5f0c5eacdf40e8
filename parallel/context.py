"""Context parallelism by state passing: the slice plan, the collectives and the affine scan.

Knows nothing of GatedDeltaNet. A packed sequence of global length T (boundaries ``cu_seqlens``) is cut
into ``size`` equal contiguous slices of ``L = T / size`` tokens; rank c holds ``[c*L, (c+1)*L)``. A
sequence may straddle several slices. A layer whose state after a slice is an affine function of the
state before it (``S_out = M @ S_in + H``; a linear recurrence, a causal conv's last inputs) runs each
slice locally, and only the per-slice summaries travel between ranks:

- ``plan_slice``: host-side bookkeeping from the global ``cu_seqlens``: this slice's local boundaries
  (every global sequence keeps its index, those outside the slice become empty segments), the sequence
  that comes in from the previous slice, the one that goes on into the next, and which rank holds each
  sequence's last token (its final state).
- ``gather_from_ranks``: all-gather with autograd whose backward sums the gradient over ranks.
- ``rows_before_slice``: the last rows before this slice, from every rank's gathered tail rows.
- ``affine_scan``: compose the gathered per-slice maps of the ranks a sequence passed through.
- ``select_owned``: the per-sequence tensor from the rank that owns each sequence, on every rank.
- ``agree_across_groups``: ``agree_across_ranks`` over the groups of a mesh, so that every rank of the
  mesh raises together.

See docs/context_parallel.md.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from .agree import agree_across_ranks
from .groups import resolve_sp_group
from .packing import gather_sequence


@dataclass(frozen=True)
class SlicePlan:
    """Where this rank's slice sits in the packed sequence (all ints on the host).

    Attributes:
        size, rank: number of slices and this rank's index. length: L, tokens per slice.
        start: global index of the slice's first token (``rank * L``).
        cu_local: ``[N + 1]`` boundaries restricted to the slice, ``clamp(cu - start, 0, L)``: local
            segment n is the part of global sequence n inside the slice (empty where it has none).
            Same dtype and device as the global ``cu_seqlens``.
        incoming: index of the sequence that started before the slice and has tokens in it, or -1.
        incoming_first_rank: the rank where ``incoming`` starts (-1 if none).
        incoming_seen: tokens of ``incoming`` before the slice, ``start - cu[incoming]`` (0 if none).
        outgoing: index of the sequence that holds the slice's last token and continues into the next
            slice, or -1.
        outgoing_from: local index where ``outgoing`` begins in the slice (0 if it came in).
        owner: int64 ``[N]`` (on ``cu_seqlens``'s device): the rank holding each sequence's last token,
            whose local run gives the sequence's final state; for an empty sequence the rank whose slice
            holds its position (the last rank for a position of T).
    """

    size: int
    rank: int
    length: int
    start: int
    cu_local: torch.Tensor
    incoming: int
    incoming_first_rank: int
    incoming_seen: int
    outgoing: int
    outgoing_from: int
    owner: torch.Tensor


def plan_slice(cu_seqlens: torch.Tensor, size: int, rank: int, host_cu: list[int] | None = None) -> SlicePlan:
    """Plan rank ``rank``'s slice of a pack with global boundaries ``cu_seqlens``.

    Args:
        cu_seqlens: ``[N + 1]`` int32/int64, already validated (``cu[0] == 0``, non-decreasing), with
            ``cu[-1] == T`` divisible by ``size``.
        size, rank: number of slices and this rank's slice.
        host_cu: ``cu_seqlens`` as a list of ints if the caller has it; otherwise read from the tensor
            (one device-to-host copy on an accelerator).

    Returns:
        a ``SlicePlan``.

    Raises:
        ValueError: ``cu[-1]`` not divisible by ``size`` (pad with ``gdn_layer.parallel.pad_for_sp``),
            or ``rank`` outside ``[0, size)``.
    """
    cu = [int(v) for v in cu_seqlens.tolist()] if host_cu is None else host_cu
    T = cu[-1]
    if T % size != 0:
        raise ValueError(f"the packed length T = {T} must be divisible by the number of slices {size}; "
                         f"pad with gdn_layer.parallel.pad_for_sp(hidden_states, cu_seqlens, {size})")
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    L = T // size
    start, end = rank * L, (rank + 1) * L
    cu_local = (cu_seqlens - start).clamp(0, L).to(cu_seqlens.dtype)
    incoming = incoming_first_rank = -1
    seen = 0
    if rank > 0 and L > 0:
        i = bisect.bisect_right(cu, start) - 1  # the last sequence that starts at or before `start`
        if cu[i] < start < cu[i + 1]:
            incoming, incoming_first_rank, seen = i, cu[i] // L, start - cu[i]
    outgoing, outgoing_from = -1, 0
    if rank < size - 1 and L > 0:
        j = bisect.bisect_right(cu, end - 1) - 1  # the sequence holding token end - 1
        if cu[j + 1] > end:
            outgoing, outgoing_from = j, max(cu[j] - start, 0)
    # on cu_seqlens's device, from the tensor: no host list turned back into a tensor
    t = cu_seqlens.to(torch.int64)
    last = torch.where(t[1:] > t[:-1], t[1:] - 1, t[:-1])
    owner = (last // max(L, 1)).clamp(max=size - 1)
    return SlicePlan(size, rank, L, start, cu_local, incoming, incoming_first_rank, seen, outgoing,
                     outgoing_from, owner)


def gather_from_ranks(x: torch.Tensor, group) -> torch.Tensor:
    """Stack every rank's ``x`` along a new dim 0, in rank order, with autograd.

    Args:
        x: same shape on every rank. group: ProcessGroup, 1-D DeviceMesh or None.

    Returns:
        ``[size, *x.shape]``. Backward sums the incoming gradient over the ranks and keeps this rank's
        row (each rank may use different rows in its part of the loss), which is a collective: every
        rank must run backward through it.
    """
    return gather_sequence(x[None], group, dim=0, grad="sum")


def rows_before_slice(tails: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """The ``n`` rows that precede slice ``rank``, from every rank's gathered tail rows.

    Args:
        tails: ``[size, m, ...]``: row block c is the last ``m`` rows of slice c, with ``m = min(L, w)``
            for some window ``w >= n`` (so the blocks of ranks ``< rank`` are contiguous near the end).
        rank: this slice. n: how many rows, ``0 <= n <= min(w, rank * L)``.

    Returns:
        ``[n, ...]``, oldest first.
    """
    before = tails[:rank].flatten(0, 1)
    return before[before.shape[0] - n:]


def affine_scan(M: torch.Tensor, H: torch.Tensor, first: int, stop: int) -> torch.Tensor:
    """Compose the maps ``S -> M[c] @ S + H[c]`` for ``c = first .. stop - 1`` applied to ``S = 0``.

    Args:
        M: ``[size, ..., D, D]`` and H: ``[size, ..., D, E]`` gathered per-slice maps.
        first, stop: the ranks a sequence passed through; the map of ``first`` must already contain the
            sequence's own initial state (its ``M`` is then ignored).

    Returns:
        ``[..., D, E]``: the state after slice ``stop - 1``, in H's dtype. Sequential in rank order;
        ``stop - first`` is at most the number of ranks.
    """
    S = H[first]
    for c in range(first + 1, stop):
        S = M[c] @ S + H[c]
    return S


def select_owned(x: torch.Tensor, owner: torch.Tensor, group) -> torch.Tensor:
    """Row n of the result is row n of ``x`` on rank ``owner[n]``; the same on every rank.

    Args:
        x: ``[N, ...]`` per-sequence results of this rank (only owned rows are meaningful).
        owner: int64 ``[N]`` on x's device, the rank holding each row. group: the group of the slices.

    Returns:
        ``[N, ...]``. The gradient of a loss on it reaches ``x`` on the owner only, summed over every
        rank's use (each rank adding its share of a loss term gives the single-process gradient).
    """
    gathered = gather_from_ranks(x, group)
    # a gather along the rank dim (no index tensor built on the host per call)
    index = owner.to(x.device).view(1, -1, *([1] * (x.dim() - 1))).expand(1, *x.shape)
    return gathered.gather(0, index)[0]


def agree_across_groups(groups, digest: torch.Tensor, local_error: BaseException | None, what: str,
                        names=None) -> None:
    """``agree_across_ranks`` over each group of a mesh in turn, so every rank of the mesh raises together.

    Args:
        groups: the groups whose product is the mesh (e.g. ``(sp_group, cp_group)``); None or size-1
            entries are skipped.
        digest, local_error, what: as for ``agree_across_ranks``.
        names: how the messages call each group (default ``"SP"``, ``"CP"``, ... in order).

    A rank's verdict from one group feeds the next as its local error: after the first group every rank
    of an sp group knows whether any of them failed, after the second every rank that shares a cp group
    with any of those, i.e. every rank of the 2-D mesh. Digests equal within each group are equal on
    the whole mesh. Costs one small all-reduce per group.

    Raises:
        as ``agree_across_ranks``, on every rank of the mesh.
    """
    error = local_error
    names = list(names) if names is not None else ["SP", "CP", "group 3", "group 4"][:len(groups)]
    for group, name in zip(groups, names):
        if resolve_sp_group(group)[1] == 1:
            continue
        try:
            agree_across_ranks(group, digest, error, what, name=name)
        except Exception as e:   # noqa: BLE001 - a rank's own error of any type goes on to the next group
            error = e
    if error is not None:
        raise error


__all__ = ["SlicePlan", "plan_slice", "gather_from_ranks", "rows_before_slice", "affine_scan", "select_owned",
           "agree_across_groups"]
