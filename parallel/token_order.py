"""Token orders of load-balanced context parallelism: build them, check them.

A *token order* is a permutation ``order [T]`` of the positions of a (packed) sequence: ``order[j]`` is
the original position of the j-th token in the order the ranks hold them, and rank i of P holds
entries ``i*T/P .. (i+1)*T/P``. It is exactly the rearrange index of PyTorch's context-parallel load
balancers (``x_held = x[:, order]``), e.g. ``_HeadTailLoadBalancer(T, P, device)._generate_indices()[0]``
in ``torch.distributed.tensor.experimental._context_parallel._load_balancer``, which can be passed as is.

- ``head_tail_order(T, P)``: cut ``[0, T)`` into 2P equal chunks; rank r holds chunks r and 2P-1-r.
- ``per_document_head_tail_order(cu_seqlens, P)``: the same inside every packed document; rank r holds
  chunks r and 2P-1-r of every document, documents in order.
- ``check_token_order``: the shape / dtype / permutation rules (one place for them).

Knows nothing of GatedDeltaNet. See docs/context_parallel.md.
"""
from __future__ import annotations

import torch


def head_tail_order(seq_len: int, world_size: int, device=None) -> torch.Tensor:
    """Head-tail order of one sequence (PyTorch's ``_HeadTailLoadBalancer``).

    Args:
        seq_len: T, divisible by ``2 * world_size``. world_size: P, the number of ranks that shard it.
        device: of the result.

    Returns:
        int64 ``[T]``: with ``k = T / (2P)``, entries ``2rk .. 2(r+1)k`` (rank r's share) are
        ``[r*k, (r+1)*k)`` followed by ``[(2P-1-r)*k, (2P-r)*k)``.

    Raises:
        ValueError: ``seq_len`` not divisible by ``2 * world_size`` (pad first:
            ``gdn_layer.parallel.pad_for_sp(x, cu, 2 * world_size)``), or non-positive sizes.
    """
    return per_document_head_tail_order(torch.tensor([0, seq_len]), world_size, device=device,
                                        name="seq_len")


def per_document_head_tail_order(cu_seqlens: torch.Tensor, world_size: int, device=None,
                                 name: str = "cu_seqlens") -> torch.Tensor:
    """Per-document head-tail order of a pack (the layout of PyTorch's ``_PerDocumentHeadTailLoadBalancer``).

    Args:
        cu_seqlens: ``[N + 1]`` int boundaries of the packed documents, every length divisible by
            ``2 * world_size`` (zero-length documents are allowed). world_size: P. device: of the result.

    Returns:
        int64 ``[T]``: rank r's share (entries ``r*T/P .. (r+1)*T/P``) is, for each document n in turn,
        its chunk r then its chunk 2P-1-r (chunks of ``len_n / (2P)`` tokens).

    Raises:
        ValueError: a length not divisible by ``2 * world_size`` (names the document), non-positive
            ``world_size``, or malformed ``cu_seqlens``.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    cu = [int(v) for v in torch.as_tensor(cu_seqlens).reshape(-1).tolist()]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{name} must be non-decreasing boundaries starting at 0, got {cu}")
    P2 = 2 * world_size
    for n, (a, b) in enumerate(zip(cu, cu[1:])):
        if (b - a) % P2:
            what = f"seq_len = {b - a}" if name == "seq_len" else f"document {n} has length {b - a}, which"
            raise ValueError(f"{what} must be divisible by 2 * world_size = {P2} for a head-tail order; pad "
                             f"first (gdn_layer.parallel.pad_for_sp pads the pack's end; pad each document "
                             f"for a per-document order)")
    shares = []
    for r in range(world_size):
        for a, b in zip(cu, cu[1:]):
            k = (b - a) // P2
            shares += [torch.arange(a + r * k, a + (r + 1) * k), torch.arange(a + (P2 - 1 - r) * k, a + (P2 - r) * k)]
    return torch.cat(shares).to(device=device, dtype=torch.int64) if shares else torch.zeros(0, dtype=torch.int64)


def check_token_order(token_order, total_len: int, device: torch.device, check_values: bool) -> torch.Tensor:
    """Validate a token order and return it as int64 on ``device``.

    Args:
        token_order: 1-D integer tensor ``[T]``. total_len: T, the global (packed) length.
        device: where the result lives. check_values: read the values (a host copy on an accelerator)
            and check that they form a permutation of ``[0, T)``.

    Raises:
        TypeError: not a tensor.
        ValueError: not 1-D, not an integer dtype, length not T, or (values checked) not a permutation
            (names the first out-of-range or repeated position).
    """
    if not isinstance(token_order, torch.Tensor):
        raise TypeError(f"token_order must be a torch.Tensor of int64 (or int32), got {type(token_order).__name__}")
    if token_order.dim() != 1:
        raise ValueError(f"token_order must be 1-D [T], got shape {tuple(token_order.shape)}")
    if token_order.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise ValueError(f"token_order must have an integer dtype (int64), got {token_order.dtype}")
    if token_order.device.type == "meta":
        raise ValueError("token_order must hold real values (it is on the meta device)")
    if token_order.numel() != total_len:
        raise ValueError(f"token_order must have one entry per token of the global sequence, T = {total_len} "
                         f"(ranks x hidden_states.shape[1]), got {token_order.numel()}")
    if check_values:
        host = token_order.detach().cpu().to(torch.int64)
        bad = (host < 0) | (host >= total_len)
        if bool(bad.any()):
            j = int(torch.nonzero(bad)[0])
            raise ValueError(f"token_order must be a permutation of [0, {total_len}), but token_order[{j}] = "
                             f"{int(host[j])} is out of range")
        counts = torch.bincount(host, minlength=total_len)
        if bool((counts != 1).any()):  # a repeated position implies a missing one: name the repeated one
            p = int(torch.nonzero(counts > 1)[0])
            raise ValueError(f"token_order must be a permutation of [0, {total_len}), but position {p} appears "
                             f"{int(counts[p])} times")
    return token_order.to(device=device, dtype=torch.int64)


__all__ = ["head_tail_order", "per_document_head_tail_order", "check_token_order"]
