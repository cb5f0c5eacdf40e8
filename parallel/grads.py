"""Sum parameter gradients over the SP group after backward.

Under Ulysses every rank holds a full replica of the layer's parameters but sees only its slice of the
tokens (and, inside the layer, only its heads), so each rank's ``.grad`` is a partial sum over tokens.
Composed with FSDP2 on a 2-D ``(dp, sp)`` mesh the gradients are DTensors sharded over dp; the SP ranks
of one dp coordinate hold the same shard positions, so summing the local shards over sp is the same sum.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

try:  # public from torch 2.5; private before
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # pragma: no cover
    try:
        from torch.distributed._tensor import DTensor as _DTensor
    except ImportError:
        _DTensor = None

from .agree import _buffer_device, agree_across_ranks, digest_of
from .groups import resolve_sp_group


_FLOAT_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}


def _trainable_params(module) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The parameters to reduce and a digest of what every rank must agree on; raises what this rank
    cannot reduce."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    everything = list(module.parameters())
    params = [p for p in everything if p.requires_grad]
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(f"reduce_sp_grads does not support sparse gradients; got one of shape {tuple(p.shape)}")
    trainable = torch.tensor([i for i, p in enumerate(everything) if p.requires_grad], dtype=torch.int64)
    sizes = torch.tensor([_local(p).numel() for p in params], dtype=torch.int64)
    dtypes = torch.tensor([_FLOAT_CODE.get((p if p.grad is None else p.grad).dtype, 99) for p in params],
                          dtype=torch.int64)
    return params, digest_of(len(everything), trainable, sizes, dtypes)


def reduce_sp_grads(module: torch.nn.Module, sp_group) -> None:
    """All-reduce (SUM) every trainable parameter's ``.grad`` of ``module`` over the SP group, in place.

    The rule: summing over the group gives the single-process gradient of the same global batch when
    each rank's loss is its share of the global loss, i.e. the sum of a per-token loss over THIS rank's
    tokens, or that sum divided by the GLOBAL token count (a global mean). A per-rank mean over local
    tokens must first be rescaled by ``local_count / global_count`` (equal shards: divide by P).

    Args:
        module: the replica whose parameters (``requires_grad=True``) to reduce; the same module
            structure on every rank, since gradients are matched by parameter order.
        sp_group: None, a ProcessGroup or a 1-D DeviceMesh. None or size 1: no-op.

    A parameter whose ``.grad`` is None on every rank (unused by the whole batch) keeps ``.grad = None``,
    as in one process, so an optimizer skips it (AdamW's weight decay and moments do not move it); one
    whose ``.grad`` is None on some ranks only (unused by their tokens) gets a zero gradient there first,
    then the sum. Which parameters have a gradient anywhere costs one small all-reduce (MAX) of a flag
    per parameter.
    Gradients are coalesced into one flat buffer per (device, dtype): one all-reduce each. DTensor
    gradients (FSDP2's ``fully_shard(model, mesh=mesh["dp"])`` with ``sp_group=mesh["sp"]``) are reduced
    through their local shards (``grad.to_local()``), in place: the dp shard of rank (d, s) covers the
    same parameter positions for every s, so the sum over sp of the local shards is the sharded sum.

    Raises:
        TypeError: module not an nn.Module. ValueError: a sparse gradient (not supported), or ranks
            that disagree on which parameters train, on their sizes or on their gradients' dtypes. Under
            SP every check feeds one agreement all-reduce first, so all ranks raise together (the rank
            at fault with its own error), before any gradient moves.
    """
    group, size, _ = resolve_sp_group(sp_group)
    if size == 1:
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        return
    # Gradients are matched by position in one flat buffer per dtype: ranks that disagree on which
    # parameters train (or on their sizes or dtypes) would sum unrelated numbers or wait in a
    # collective the others never join, and so would a rank that cannot reduce (a sparse gradient).
    error, digest = None, digest_of(-1)
    try:
        params, digest = _trainable_params(module)
    except (TypeError, ValueError) as e:
        error = e
    agree_across_ranks(group, digest, error,
                       "the trainable parameters of the module (which ones, their sizes, their gradients' dtypes)")
    # which parameters have a gradient on some rank: those with none anywhere stay None (one process
    # leaves an unused parameter's grad None; a zero there would let weight decay move it)
    has_grad = torch.tensor([p.grad is not None for p in params], dtype=torch.int64,
                            device=_buffer_device(group, torch.device("cpu")))
    dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p, used in zip(params, has_grad.tolist()):  # module.parameters() has the same order on every rank
        if not used:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = _local(p.grad)  # a view of a DTensor's shard: reduced in place
        buckets.setdefault((grad.device, grad.dtype), []).append(grad)
    for grads in buckets.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view that writes through), or ``t`` itself."""
    return t.to_local() if _DTensor is not None and isinstance(t, _DTensor) else t


__all__ = ["reduce_sp_grads"]
