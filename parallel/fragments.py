"""State passing over fragments: context parallelism when ranks hold a token order, not contiguous slices.

Knows nothing of GatedDeltaNet. With a token order (``parallel.token_order``) rank c of ``size`` holds
the positions ``order[c*L : (c+1)*L]`` (``L = T / size``). Sorted, they form a few *fragments*: maximal
runs of consecutive original positions held by one rank (head-tail: two per rank; per-document
head-tail: two per document). Cut further at the document boundaries of ``cu_seqlens``, they give
*pieces*: each is part of one document and lies in one fragment. A rank runs its pieces as one local
pack (its tokens sorted); a piece that does not start its document needs

- the W-1 pre-conv inputs before it (its document's earlier tokens, from the tails of earlier pieces,
  or the document's given conv state), and
- its recurrent state at its start: every piece maps ``S_in -> M S_in + H``; the state entering a piece
  is the composition, in original order, of the maps of its document's earlier pieces
  (``compose_chains``), the first of which has the document's initial state folded into ``H``.

``plan_fragments`` is the host-side bookkeeping for one rank; with one fragment per rank it describes
the same hand-offs as ``parallel.context.plan_slice``. See docs/context_parallel.md.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch


def max_fragments_per_rank(num_seqs: int) -> int:
    """The most fragments a rank may hold for a pack of ``num_seqs`` documents: ``2 * num_seqs + 2``.

    Covers contiguous slices (1), head-tail over the whole pack (2) and per-document head-tail (at most
    2 per document). Every fragment edge costs one state map (``[Hv, Dk, Dk + Dv]``) on the wire, so a
    finer order (a random permutation: one fragment per token) is refused rather than served slowly;
    under Ulysses alone any permutation is served (no state passing)."""
    return 2 * num_seqs + 2


@dataclass(frozen=True)
class FragmentPlan:
    """This rank's pieces and where their hand-offs come from (index tensors on the activations' device).

    Attributes:
        size, rank, length: number of cp ranks, this rank, L tokens per rank.
        sort: int64 ``[L]``: the held tokens in original order are ``held[sort]``; ``unsort`` undoes it.
        cu_local: int64 ``[K + 1]`` boundaries of this rank's K pieces in the sorted local tokens (the
            zero-length documents assigned to this rank come last, as empty pieces).
        piece_seq: int64 ``[K]``: the document of each piece. first: bool ``[K]``: the piece starts its
            document (it takes the document's given state; the others take a handed-over one).
        sent: int64 ``[m]`` local indices of this rank's pieces whose document goes on past them: only
            they hand over a map and a tail (send slot j is ``sent[j]``).
        slots: the most such pieces on any rank (the gathered maps and tails are padded to it).
        passing: whether any piece on any rank hands over (``slots > 0``; the same on every rank).
        later: int64 ``[n]`` local indices of the pieces that do not start their document.
        chain: int64 ``[n, c]``: for each of ``later``, its document's earlier pieces in original order,
            as rows ``rank * slots + send slot`` of the gathered maps; front-padded with ``size * slots`` (a
            zero map row appended by the caller).
        tail_rows: int64 ``[slots * window]``: sorted local rows of each sent piece's last ``window`` tokens
            (clamped into the rank; rows outside the piece are never read through ``halo``).
        halo: int64 ``[n, window]``: for each of ``later``, the rows of its ``window`` inputs before it,
            oldest first, in ``cat([given_conv_state rows [N * window], gathered tails [size * slots *
            window]])``.
        owner: int64 ``[N]`` (CPU): the rank holding each document's last piece (its final state).
        owned_piece: int64 ``[N]``: on this rank, the local piece giving each document's final state
            (0 for documents owned elsewhere).
    """

    size: int
    rank: int
    length: int
    sort: torch.Tensor
    unsort: torch.Tensor
    cu_local: torch.Tensor
    piece_seq: torch.Tensor
    first: torch.Tensor
    sent: torch.Tensor
    slots: int
    passing: bool
    later: torch.Tensor
    chain: torch.Tensor
    tail_rows: torch.Tensor
    halo: torch.Tensor
    owner: torch.Tensor
    owned_piece: torch.Tensor


def count_fragments(order: torch.Tensor, size: int) -> torch.Tensor:
    """int64 ``[size]`` (CPU): how many fragments each rank holds under ``order`` (host copy of it)."""
    holder = _holders(order.detach().cpu().to(torch.int64), size)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(holder[1:] != holder[:-1])[:, 0] + 1])
    return torch.bincount(holder[starts], minlength=size)


def _holders(order: torch.Tensor, size: int) -> torch.Tensor:
    """int64 ``[T]``: the rank holding each original position."""
    T = order.numel()
    holder = torch.empty(T, dtype=torch.int64)
    holder[order] = torch.arange(T) // max(T // size, 1)
    return holder


def plan_fragments(order: torch.Tensor, cu: list[int], size: int, rank: int, window: int,
                   device: torch.device) -> FragmentPlan:
    """Plan rank ``rank``'s pieces under ``order``.

    Args:
        order: int64 ``[T]`` permutation (validated), read on the host. cu: the global boundaries as
            ints (validated, ``cu[-1] == T``, T divisible by ``size``). size, rank: cp ranks and this one.
        window: W - 1, the conv inputs a piece needs from before it. device: of the index tensors.

    Returns:
        a ``FragmentPlan``. Costs host work linear in T (vectorised) plus a loop over the pieces.
    """
    host = order.detach().cpu().to(torch.int64)
    T, N = host.numel(), len(cu) - 1
    L = T // size
    holder = _holders(host, size)
    edges = (torch.nonzero(holder[1:] != holder[:-1])[:, 0] + 1).tolist()
    bounds = sorted(set([0, T] + edges + cu))
    pieces = [[] for _ in range(size)]   # per rank: (a, b, doc), original order
    sent = [[] for _ in range(size)]     # per rank: local indices of the pieces whose document goes on
    by_doc = [[] for _ in range(N)]      # per doc: (a, b, rank, local index, send slot), original order
    for a, b in zip(bounds, bounds[1:]):
        if a == b:
            continue
        r, n = int(holder[a]), bisect.bisect_right(cu, a) - 1
        slot = -1
        if b < cu[n + 1]:  # the document goes on: this piece's map and tail are handed over
            slot = len(sent[r])
            sent[r].append(len(pieces[r]))
        by_doc[n].append((a, b, r, len(pieces[r]), slot))
        pieces[r].append((a, b, n))
    for n in range(N):  # zero-length documents: an empty piece on rank 0 (state in = state out)
        if cu[n] == cu[n + 1]:
            by_doc[n].append((cu[n], cu[n], 0, len(pieces[0]), -1))
            pieces[0].append((cu[n], cu[n], n))
    slots = max(len(p) for p in sent)
    mine = pieces[rank]
    cu_local = [0]
    for a, b, _ in mine:
        cu_local.append(cu_local[-1] + b - a)
    first = [a == cu[n] for a, _, n in mine]
    passing = slots > 0

    handed = sorted((a, b, r, s) for doc in by_doc for (a, b, r, _, s) in doc if s >= 0)
    handed_start = [h[0] for h in handed]
    later = [k for k, f in enumerate(first) if not f]
    pad = size * slots
    chains, halos = [], []
    for k in later:
        a, _, n = mine[k]
        chains.append([r * slots + s for (a2, _, r, _, s) in by_doc[n] if a2 < a])
        rows = []
        for q in range(a - window, a):
            if q < cu[n]:
                rows.append(n * window + window - (cu[n] - q))
            else:  # in an earlier piece of the same document, which hands its tail over
                _, b2, r2, s2 = handed[bisect.bisect_right(handed_start, q) - 1]
                rows.append(N * window + (r2 * slots + s2) * window + window - (b2 - q))
        halos.append(rows)
    width = max((len(c) for c in chains), default=0)
    chain = [[pad] * (width - len(c)) + c for c in chains]
    tail_rows = []
    for j in range(slots):
        end = cu_local[sent[rank][j] + 1] if j < len(sent[rank]) else 0
        tail_rows += [min(max(end - window + i, 0), L - 1) for i in range(window)]
    owner, owned = [0] * N, [0] * N
    for n in range(N):
        _, _, r, k, _ = by_doc[n][-1]
        owner[n] = r
        owned[n] = k if r == rank else 0
    local = order[rank * L:(rank + 1) * L].to(device)
    sort = torch.argsort(local)
    i64 = dict(dtype=torch.int64, device=device)
    return FragmentPlan(
        size, rank, L, sort, torch.argsort(sort), torch.tensor(cu_local, **i64),
        torch.tensor([n for _, _, n in mine], **i64), torch.tensor(first, dtype=torch.bool, device=device),
        torch.tensor(sent[rank], **i64), slots, passing, torch.tensor(later, **i64),
        torch.tensor(chain, **i64).reshape(len(later), width),
        torch.tensor(tail_rows, **i64), torch.tensor(halos, **i64).reshape(len(later), window),
        torch.tensor(owner, dtype=torch.int64), torch.tensor(owned, **i64))


def compose_chains(table: torch.Tensor, chain: torch.Tensor, d: int) -> torch.Tensor:
    """Fold ``S -> M S + H`` over each chain of maps, starting from ``S = 0``.

    Args:
        table: ``[R, ..., D, D + E]`` gathered maps ``[M | H]``; ``chain``'s pad index points at an
            all-zero row (``S`` stays 0 through it). chain: int64 ``[n, c]`` rows of ``table``, oldest
            first. d: D.

    Returns:
        ``[n, ..., D, E]``, the state after each chain (the first real map's ``M`` meets ``S = 0``, so
        its ``H`` carries the sequence's own initial state). Sequential over ``c`` (at most the number
        of pieces of one document), batched over ``n``.
    """
    S = table.new_zeros(chain.shape[0], *table.shape[1:-1], table.shape[-1] - d)
    for j in range(chain.shape[1]):
        m, h = table.index_select(0, chain[:, j]).split([d, table.shape[-1] - d], -1)
        S = m @ S + h
    return S


__all__ = ["FragmentPlan", "plan_fragments", "compose_chains", "count_fragments", "max_fragments_per_rank"]
