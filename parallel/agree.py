"""Make every SP rank raise together when inputs are bad on some rank or differ across ranks.

A rank that raises before a collective leaves the other ranks waiting in it until the collective times
out (30 minutes by default). ``agree_across_ranks`` is the one collective that runs before the real
ones: each rank contributes "did my local validation fail?" and a digest of what must be identical on
all ranks (``cu_seqlens``, shapes); afterwards every rank knows the verdict and raises the same way.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import resolve_sp_group

#: Length of every digest from ``digest_of``; the all-reduce buffer has a fixed size on every rank.
DIGEST_LEN = 4

_MASK = (1 << 62) - 1  # keeps digest entries non-negative and far from int64 overflow when negated
_PRIME = 2147483647


def _flatten_item(item, device: torch.device) -> torch.Tensor:
    """One item -> int64 [tag, length, values...] so that e.g. (1, 2) and ((1,), 2) digest differently."""
    if item is None:
        return torch.tensor([1, 0], dtype=torch.int64, device=device)
    if isinstance(item, bool) or isinstance(item, int):
        return torch.tensor([2, 1, int(item)], dtype=torch.int64, device=device)
    if isinstance(item, (tuple, list, torch.Size)):
        if not all(isinstance(v, int) for v in item):
            raise TypeError(f"digest_of items that are sequences must hold ints (e.g. shapes), got {item!r}")
        return torch.tensor([3, len(item), *item], dtype=torch.int64, device=device)
    if isinstance(item, torch.Tensor):
        if item.is_floating_point() or item.is_complex():
            raise TypeError(f"digest_of takes integer or bool tensors, got dtype {item.dtype}")
        head = torch.tensor([4, item.numel()], dtype=torch.int64, device=device)
        return torch.cat([head, item.detach().reshape(-1).to(device=device, dtype=torch.int64)])
    raise TypeError(f"digest_of items must be None, ints, sequences of ints or integer tensors, "
                    f"got {type(item).__name__}")


def digest_of(*items) -> torch.Tensor:
    """A cheap deterministic fingerprint of ints, int sequences (shapes) and integer tensors.

    Args:
        *items: None, ints (bools), tuples/lists/``torch.Size`` of ints, integer or bool tensors (e.g.
            ``cu_seqlens``, int32 or int64 give the same digest for the same values).

    Returns:
        int64 ``[DIGEST_LEN]`` on the device of the first tensor item (CPU if none): the element count,
        the sum, and two position-weighted sums of all items flattened with type/length tags, each
        masked to ``[0, 2**62)``. Equal inputs give equal digests; different inputs give different ones
        except by rare collision. Computing it on a device tensor does not sync.

    Raises:
        TypeError: an item of another type, or a floating-point tensor.
    """
    device = next((it.device for it in items if isinstance(it, torch.Tensor)), torch.device("cpu"))
    flat = torch.cat([torch.zeros(0, dtype=torch.int64, device=device)]
                     + [_flatten_item(it, device) for it in items])
    pos = torch.arange(1, flat.numel() + 1, dtype=torch.int64, device=device)
    # int64 products may wrap around; wrapping is deterministic, which is all a digest needs.
    w2 = (pos * 2654435761 + 12345) % _PRIME
    sums = torch.stack([flat.sum(), (flat * pos).sum(), (flat * w2).sum()])
    n = torch.tensor([flat.numel()], dtype=torch.int64, device=device)
    return torch.cat([n, sums]) & _MASK


def _buffer_device(group, preferred: torch.device) -> torch.device:
    """``preferred`` if the group's backend handles that device type, else its accelerator's current device."""
    types = getattr(group, "_device_types", None)  # e.g. [cuda, cpu] for gloo, [cuda] for NCCL
    if not types or any(t.type == preferred.type for t in types):
        return preferred
    kind = types[0].type
    return torch.device(kind, torch.get_device_module(kind).current_device())


def agree_across_ranks(group, digest: torch.Tensor, local_error: BaseException | None, what: str,
                       *, device: torch.device | str | None = None, name: str = "SP") -> None:
    """One small all-reduce so that every rank of ``group`` raises if any rank failed or inputs differ.

    Args:
        group: None, a ProcessGroup or a 1-D DeviceMesh (the SP group).
        digest: int64 ``[DIGEST_LEN]`` from ``digest_of`` of what must be identical on every rank. A
            malformed digest is reported as this rank's local error (never a mismatched collective).
        local_error: the exception this rank's own validation raised (caught by the caller), or None.
        what: names the compared inputs for the message, e.g. ``"cu_seqlens and shapes"``.
        name: how the messages call the group (``"SP"``, ``"CP"``); ranks are named by their global rank.
        device: where the reduction buffer lives; must suit the group's backend. Default:
            ``digest.device`` if the group's backend handles that device type (gloo: CPU), else the
            current device of the backend's accelerator (NCCL: the current CUDA device).

    Raises:
        the rank's own ``local_error`` (re-raised unchanged) on a rank that had one;
        ValueError on every other rank when some rank had a local error ("rank(s) X of the SP group
        failed input validation ..."), and on every rank when the digests differ
        ("{what} differ across the SP ranks ...").

    Costs one all-reduce (MAX) of ``P + 2 * DIGEST_LEN`` int64 values and one device-to-host copy of it.
    With no group (or size 1) it only re-raises ``local_error``.
    """
    group, size, rank = resolve_sp_group(group)
    if not isinstance(what, str):
        raise TypeError(f"what must be a str, got {type(what).__name__}")
    if local_error is not None and not isinstance(local_error, BaseException):
        raise TypeError(f"local_error must be an exception or None, got {type(local_error).__name__}")
    if size == 1:
        if local_error is not None:
            raise local_error
        return
    # A bad digest must not change the buffer length (that would mismatch the collective): report it.
    if not (isinstance(digest, torch.Tensor) and digest.dtype == torch.int64 and digest.dim() == 1
            and digest.numel() == DIGEST_LEN):
        desc = (f"{digest.dtype} tensor of shape {tuple(digest.shape)}" if isinstance(digest, torch.Tensor)
                else type(digest).__name__)
        if local_error is None:
            local_error = ValueError(f"digest must be int64 [{DIGEST_LEN}] from digest_of, got {desc}")
        digest = torch.zeros(DIGEST_LEN, dtype=torch.int64)
    if device is None:
        device = _buffer_device(group, digest.device)
    flags = torch.zeros(size, dtype=torch.int64, device=device)
    if local_error is not None:
        flags[rank] = 1
    d = digest.to(device=device) & _MASK
    buf = torch.cat([flags, d, -d])
    # MAX over [flags, d, -d] gives which ranks failed, and the max and (negated) min of each digest entry.
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)
    buf = buf.cpu()
    failed = [r for r in range(size) if int(buf[r]) != 0]
    if local_error is not None:
        raise local_error
    members = dist.get_process_group_ranks(group)     # global ranks, as a user's launcher numbers them
    if failed:
        raise ValueError(f"global rank(s) {[members[r] for r in failed]} of the {name} group failed input "
                         f"validation (see the error on those ranks); global rank {members[rank]} raises too so "
                         "no rank waits in a collective")
    hi, neg_lo = buf[size:size + DIGEST_LEN], buf[size + DIGEST_LEN:]
    if not torch.equal(hi, -neg_lo):
        raise ValueError(f"{what} differ across the {name} ranks (seen from global rank {members[rank]}): at least "
                         f"one of them does (one digest covers them all, so which one is not known here); every "
                         f"rank of the {name} group must pass identical values")


__all__ = ["DIGEST_LEN", "agree_across_ranks", "digest_of"]
