"""Host-side index plans that run a packed (``cu_seqlens``) batch in the torch reference in O(T).

Nothing here pads a sequence to the longest one: each plan is a set of index tensors into the packed
tokens (plus a few rows the kernel appends), built from the sequence lengths after one host read of
``cu_seqlens`` (a sync on accelerators). Building a plan costs O(T + N) host time and memory.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from . import cu_cache


def sequence_lengths(cu: torch.Tensor | None, batch: int, seqlen: int) -> list[int]:
    """The N sequence lengths: from ``cu_seqlens`` (B == 1), or B rows of ``seqlen`` when ``cu`` is None."""
    return [seqlen] * batch if cu is None else [int(x) for x in (cu[1:] - cu[:-1]).tolist()]


def _longer_than(lengths: torch.Tensor) -> list[int]:
    """``[#(lengths > t) for t in range(max(lengths))]``, in O(N + max) (no N x max table)."""
    if lengths.numel() == 0 or int(lengths.max()) == 0:
        return []
    return (lengths.numel() - torch.bincount(lengths).cumsum(0)[:-1]).tolist()


def _token_rows(lengths: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """For each packed token (sequence by sequence), ``starts[its sequence] + its offset in it``."""
    seq = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    first_token = torch.cumsum(lengths, 0) - lengths
    return starts[seq] + torch.arange(int(lengths.sum())) - first_token[seq]


class StepPlan:
    """Token-by-token order: step t holds the t-th token of every sequence longer than t.

    Sequences are sorted longest first (``order``), so the ones still running at step t are the first
    ``active[t]`` of that order, and their t-th tokens are the next ``active[t]`` rows of the step-major
    token list ``index`` (packed token ids). ``unsort`` maps a packed token id to its row in ``index``.
    """

    def __init__(self, lengths: list[int], device: torch.device):
        lens = torch.tensor(lengths, dtype=torch.int64)
        order = torch.sort(lens, descending=True, stable=True).indices
        self.active = _longer_than(lens)
        starts = (torch.cumsum(lens, 0) - lens)[order]
        index = torch.cat([starts[:a] + t for t, a in enumerate(self.active)] + [starts[:0]])
        self.index = index.to(device)
        self.unsort = torch.empty_like(index).scatter_(0, index, torch.arange(index.numel())).to(device)
        self.order = order.to(device)
        self.inverse_order = torch.argsort(order).to(device)


class ConvPlan:
    """Each sequence preceded by its ``W - 1`` conv-state rows, in one stream of ``T + N (W - 1)`` rows.

    ``index`` gives each stream row's row in ``[x (T rows) | initial state (N (W - 1) rows) | one zero
    row]``, or with ``zero_state`` in ``[x | one zero row]`` (every state row is then the zero row).
    A convolution without padding over the stream puts stream row p's output at ``p - (W - 1)``: token
    t's output is row ``out_index[t]``, and sequence n's last ``W - 1`` stream rows (its final conv
    state) are ``final_index[n]``.
    """

    def __init__(self, lengths: list[int], width: int, zero_state: bool, device: torch.device):
        n, h = len(lengths), width - 1
        lens = torch.tensor(lengths, dtype=torch.int64)
        T = int(lens.sum())
        starts = torch.cumsum(lens + h, 0) - lens - h                       # first stream row of each
        token_row = _token_rows(lens, starts + h)
        index = torch.empty(T + n * h, dtype=torch.int64)
        index[token_row] = torch.arange(T)
        index[(starts[:, None] + torch.arange(h)).reshape(-1)] = T if zero_state else T + torch.arange(n * h)
        self.index = index.to(device)
        self.out_index = (token_row - h).to(device)
        self.final_index = ((starts + lens)[:, None] + torch.arange(h)).to(device)


class Piece(NamedTuple):
    """Chains ``[lo, hi)`` of one level, all in one window; ``ends``: None or int64 tensors ``(chunk in
    the piece, row in the chunk)`` of each sequence whose last row lies in the piece."""
    level: int
    lo: int
    hi: int
    ends: tuple[torch.Tensor, torch.Tensor] | None


class ChunkPlan:
    """Chunk layout of the chunked kernel: no padding but the tail of the last chunk.

    The stream: the sequences one after another, each preceded by ``prefix`` virtual rows (where the
    kernel writes its initial state), cut into chunks of ``chunk`` rows at fixed positions, so a chunk
    may hold the end of one sequence and the start of the next, or many short sequences. The first row
    of every sequence is a reset (``reset``; the kernel sets its g to -inf), so no state crosses a
    sequence boundary inside a chunk.

    Hand-off order: a chunk that begins with a reset needs no state from the chunk before it, every
    other chunk needs the state its predecessor leaves. The chunks form chains (each starting at a
    reset) that run side by side: level l is the l-th chunk of every chain that has one; with chains
    sorted longest first, those are the first ``active[l]`` chains. Chunks are stored level-major
    (level 0 of every chain, then level 1, ...). ``index`` maps each stored row to its row in
    ``[packed tokens (T) | virtual rows (N * prefix) | one zero row]`` (the zero row fills the tail of
    the last chunk), ``out_index`` each packed token to its stored row.

    The kernel builds the per-chunk matrices for ``window`` stored chunks at a time. The level-major
    order is cut into ``Piece``s wherever a level or a window ends: ``windows`` lists, per window, its
    number of chunks and its pieces; ``level_pieces[l]`` the sizes (in chains) of level l's pieces.
    Final states: the kernel reads one at each piece's ``ends``, in piece order, then appends one zero
    state per sequence without any row (length 0 and no prefix): ``final_order`` puts them in sequence
    order.
    """

    def __init__(self, lengths: list[int], prefix: int, chunk: int, window: int, device: torch.device):
        n = len(lengths)
        lens = torch.tensor(lengths, dtype=torch.int64)
        T = int(lens.sum())
        rows = lens + prefix
        starts = torch.cumsum(rows, 0) - rows                               # first stream row of each
        n_chunks = -(-int(rows.sum()) // chunk)
        token_row = _token_rows(lens, starts + prefix)
        src = torch.full((n_chunks * chunk,), T + n * prefix, dtype=torch.int64)
        src[token_row] = torch.arange(T)
        src[(starts[:, None] + torch.arange(prefix)).reshape(-1)] = T + torch.arange(n * prefix)
        reset = torch.zeros(n_chunks * chunk, dtype=torch.bool)
        reset[starts[rows > 0]] = True

        heads = torch.nonzero(reset[::chunk]).reshape(-1)                   # first chunk of each chain
        chain_len, by_len = torch.sort(torch.diff(heads, append=torch.tensor([n_chunks])), descending=True,
                                       stable=True)
        heads = heads[by_len]
        self.active = _longer_than(chain_len)
        stored = torch.cat([heads[:a] + lvl for lvl, a in enumerate(self.active)] + [heads[:0]])
        slot = torch.empty(n_chunks, dtype=torch.int64)
        slot[stored] = torch.arange(n_chunks)
        order = (stored[:, None] * chunk + torch.arange(chunk)).reshape(-1)
        self.index, self.reset = src[order].to(device), reset[order].to(device)
        self.out_index = (slot[token_row // chunk] * chunk + token_row % chunk).to(device)

        pieces, window_of, done = [], [], 0                                 # (level, first chain, end chain)
        for lvl, a in enumerate(self.active):
            lo = 0
            while lo < a:
                hi = min(a, lo + window - done % window)
                pieces.append((lvl, lo, hi))
                window_of.append(done // window)
                done, lo = done + hi - lo, hi
        first = torch.tensor([0] + [hi - lo for _, lo, hi in pieces], dtype=torch.int64).cumsum(0)
        seqs = torch.nonzero(rows > 0).reshape(-1)
        last = (starts + rows - 1)[seqs]                                    # last stream row of each
        stored_chunk = slot[last // chunk]
        piece = torch.searchsorted(first, stored_chunk, right=True) - 1
        by_piece = torch.sort(piece, stable=True).indices                  # final states come in piece order
        ends = [[] for _ in pieces]
        for i, c, r in zip(piece[by_piece].tolist(), (stored_chunk - first[piece])[by_piece].tolist(),
                           (last % chunk)[by_piece].tolist()):
            ends[i].append((c, r))
        self.final_order = torch.argsort(torch.cat([seqs[by_piece], torch.nonzero(rows == 0).reshape(-1)])).to(device)
        self.windows = [[0, []] for _ in range(-(-done // window))]
        for (lvl, lo, hi), w, e in zip(pieces, window_of, ends):
            e = tuple(torch.tensor(col, dtype=torch.int64, device=device) for col in zip(*e)) or None
            self.windows[w][0] += hi - lo
            self.windows[w][1].append(Piece(lvl, lo, hi, e))
        self.level_pieces = [[] for _ in self.active]
        for lvl, lo, hi in pieces:
            self.level_pieces[lvl].append(hi - lo)


class Compaction(NamedTuple):
    """A pack with its zero-length segments dropped (``without_empty_segments``).

    ``cu`` has the N' non-empty sequences' boundaries (the same tokens); ``keep`` [N'] int64 are their
    indices among the original N (on cu's device).
    """
    cu: torch.Tensor
    keep: torch.Tensor
    num_seqs: int


def without_empty_segments(cu: torch.Tensor) -> Compaction | None:
    """None when every sequence of ``cu_seqlens`` holds a token, else the pack without its empty ones.
    Tokens are untouched: only the state rows of the dropped sequences change, and for those the
    recurrence is the identity (``final = initial``; ``d initial = d final``). Reads cu's host values
    (``cu_cache.host_copy``: free where they are known, else one read); the compacted ``cu``'s host
    values are recorded, so nothing after reads it back."""
    host = cu_cache.host_copy(cu).to(torch.int64)
    lens = host[1:] - host[:-1]
    if bool((lens > 0).all()):
        return None
    keep_host = torch.nonzero(lens > 0).flatten()
    # (a non-blocking copy from pageable memory is staged at once: no stream sync, the source reusable)
    keep = keep_host.to(cu.device, non_blocking=True)
    out = torch.cat([cu[:1], cu[1:].index_select(0, keep)])
    if out.device.type != "cpu":
        cu_cache.remember(out, "host", torch.cat([host[:1], host[1:].index_select(0, keep_host)]))
    return Compaction(out, keep, lens.numel())


def expand_states(c: Compaction, kept: torch.Tensor | None, full: torch.Tensor | None):
    """The N-row state tensor whose kept rows are ``kept`` [N', ...] and whose dropped rows are ``full``'s
    rows (their identity map: the initial state forward, the final state's gradient backward), or zeros
    when ``full`` is None; None when both are None."""
    if kept is None and full is None:
        return None
    base = kept if kept is not None else full
    out = (full.to(base.dtype).clone() if full is not None
           else base.new_zeros((c.num_seqs, *base.shape[1:])))
    if kept is not None:
        out.index_copy_(0, c.keep, kept)
    return out
