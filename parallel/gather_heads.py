"""Collect a head-sharded tensor (e.g. a recurrent state) from every SP rank, with autograd."""
from __future__ import annotations

import torch

from .groups import resolve_sp_group
from .packing import gather_sequence


def gather_heads(x: torch.Tensor, index_per_rank: list[torch.Tensor], total: int, dim: int, group) -> torch.Tensor:
    """Assemble the full tensor from every rank's shard along ``dim``.

    Args:
        x: this rank's shard; ``x.shape[dim] == len(index_per_rank[rank])``. Same shape on every rank.
        index_per_rank: for each rank, the LongTensor of positions along ``dim`` its shard fills
            (positions may repeat across ranks for replicated heads; replicas hold equal values).
        total: the full size along ``dim``.
        group: the SP group (ProcessGroup, 1-D DeviceMesh, or None: single process, x is returned as is).

    Returns:
        The full tensor, ``x.shape`` with ``total`` at ``dim``; differentiable (all-gather with autograd).
    """
    group, size, _ = resolve_sp_group(group)
    if size == 1:
        return x
    # every rank may compute a different loss from the full tensor: gradients are summed over ranks
    parts = gather_sequence(x[None], group, dim=0, grad="sum")
    shape = list(x.shape)
    shape[dim] = total
    full = x.new_zeros(shape)
    for part, idx in zip(parts, index_per_rank):
        full = full.index_copy(dim, idx.to(x.device), part)
    return full
