"""How ``seq_to_head`` moves features: a host-side plan of contiguous slices, built once per index.

``feature_index [P, F_out]`` says which of the F features rank d receives. In the layer each row is
the union of a few contiguous ranges (q rows of its k heads, k rows, v rows, a, b), so the send buffer
can be filled with a handful of strided slice copies instead of a gather, and the backward written
back with the same slices instead of an accumulating index-put (which, on CUDA, sorts the indices and
costs ~60x the collective at 64k tokens).

``plan_for(feature_index)`` reads the index on the host once (one device->host copy for a device
tensor) and keeps the plan by the project's caching rule (``gdn_layer.derived``), so later calls with
the same tensor cost no sync. ``pack`` / ``unpack`` run the plan: forward and backward of the send side.
``pack_rows`` / ``unpack_rows`` run it for a range of rows only, which is how ``all_to_all`` writes the
block a rank keeps for itself straight into its destination while the peers' blocks are in flight.

Buffer layout (see ``all_to_all.py`` for why): send / receive ``[P, T_local, B, F_out]``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..derived import derived

# Rows made of more runs than this are gathered with index_select (and the backward uses index_add_):
# past a few dozen copies per row, the launches cost more than a gather's index reads.
MAX_RUNS_PER_ROW = 32


@dataclass(frozen=True)
class Copy:
    """Rows ``first + i`` (``0 <= i < count``) of the send buffer take, at their features
    ``[dst, dst + n)``, the source features ``[src + i*step, src + i*step + n)``.

    One copy serves several rows when the ranges advance by a constant ``step`` from row to row
    (the usual disjoint head blocks: one copy per field for all P ranks)."""

    first: int
    count: int
    dst: int
    src: int
    step: int
    n: int


@dataclass(frozen=True)
class Piece:
    """Backward, where features repeat: row ``row``'s features ``[dst, dst + n)`` go to source
    features ``[src, src + n)``, added (``accumulate``) when an earlier piece already wrote there."""

    row: int
    dst: int
    src: int
    n: int
    accumulate: bool


@dataclass(frozen=True)
class FeaturePlan:
    """The slices that realise ``x[..., feature_index[d]]`` for every row d.

    ``copies`` is None when some row has more than ``MAX_RUNS_PER_ROW`` runs (then: index_select /
    index_add_). ``disjoint``: no feature appears twice, so the backward is plain copies.
    ``pieces``: the backward's pieces when rows are written back in ascending order (``pieces_from``
    gives them for another first row). ``covered``: sorted, merged ``[start, stop)`` ranges of the
    features that appear at all. ``runs``: each row's ``(dst, src, n)`` runs (empty when ``copies`` is None).
    """

    rows: int
    width: int
    lo: int
    hi: int
    copies: tuple[Copy, ...] | None
    disjoint: bool
    pieces: tuple[Piece, ...]
    covered: tuple[tuple[int, int], ...]
    runs: tuple[tuple[tuple[int, int, int], ...], ...] = ()
    _pieces_from: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def pieces_from(self, first: int) -> tuple[Piece, ...]:
        """The backward's pieces when row ``first`` is written back before the others (then the rest in
        ascending order): a rank unpacks the block it kept while the peers' blocks are still in flight,
        so that block's features must be the ones copied, and a later row's repeat of them added."""
        if first == 0 or self.disjoint or self.copies is None:
            return self.pieces
        hit = self._pieces_from.get(first)
        if hit is None:
            order = [first] + [d for d in range(self.rows) if d != first]
            hit = self._pieces_from[first] = tuple(_pieces(self.runs, self.hi, order))
        return hit

    def uncovered(self, F: int) -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges of ``[0, F)`` that no row reads (their gradient is zero)."""
        gaps, at = [], 0
        for start, stop in self.covered:
            if start > at:
                gaps.append((at, start))
            at = stop
        if at < F:
            gaps.append((at, F))
        return gaps


def _runs(row: list[int]) -> list[tuple[int, int, int]]:
    """``(dst, src, n)`` for each maximal run of consecutive increasing indices in ``row``."""
    runs = []
    for dst, src in enumerate(row):
        if runs and src == runs[-1][1] + runs[-1][2]:
            d, s, n = runs[-1]
            runs[-1] = (d, s, n + 1)
        else:
            runs.append((dst, src, 1))
    return runs


def _group(runs_per_row: list[list[tuple[int, int, int]]]) -> list[Copy]:
    """Merge run j of consecutive rows into one Copy while ``dst``, ``n`` agree and ``src`` advances by
    a constant step >= 0 (strides of a view cannot be negative)."""
    done, open_ = [], {}
    for d, runs in enumerate(runs_per_row):
        for j, (dst, src, n) in enumerate(runs):
            b = open_.get(j)
            if b is not None and b["first"] + b["count"] == d and b["dst"] == dst and b["n"] == n:
                step = src - b["src"] if b["count"] == 1 else b["step"]
                if step >= 0 and src == b["src"] + b["count"] * step:
                    b["step"], b["count"] = step, b["count"] + 1
                    continue
            if b is not None:
                done.append(Copy(**b))
            open_[j] = dict(first=d, count=1, dst=dst, src=src, step=0, n=n)
    done.extend(Copy(**b) for b in open_.values())
    return done


def _pieces(runs_per_row, hi: int, order=None) -> list[Piece]:
    """Backward pieces with rows taken in ``order`` (default ascending): the first write to a feature
    copies, later ones add."""
    seen = [False] * (hi + 1)
    out = []
    for d in (range(len(runs_per_row)) if order is None else order):
        for dst, src, n in runs_per_row[d]:
            i = 0
            while i < n:
                acc = seen[src + i]
                j = i
                while j < n and seen[src + j] == acc:
                    j += 1
                out.append(Piece(d, dst + i, src + i, j - i, acc))
                for k in range(i, j):
                    seen[src + k] = True
                i = j
    return out


def build_plan(feature_index: torch.Tensor) -> FeaturePlan:
    """The plan of a ``[P, F_out]`` int64 index (values read on the host)."""
    rows = feature_index.detach().cpu().tolist()
    P, width = len(rows), (len(rows[0]) if rows else 0)
    flat = [i for row in rows for i in row]
    if not flat:
        return FeaturePlan(P, width, 0, -1, (), True, (), ())
    lo, hi = min(flat), max(flat)
    distinct = sorted(set(flat))
    covered = []
    for i in distinct:
        if covered and covered[-1][1] == i:
            covered[-1][1] = i + 1
        else:
            covered.append([i, i + 1])
    covered = tuple((a, b) for a, b in covered)
    if lo < 0:       # caller raises with the F it knows; nothing else is valid to build
        return FeaturePlan(P, width, lo, hi, None, False, (), covered)
    runs_per_row = [_runs(row) for row in rows]
    disjoint = len(distinct) == len(flat)
    if max(len(r) for r in runs_per_row) > MAX_RUNS_PER_ROW:
        return FeaturePlan(P, width, lo, hi, None, disjoint, (), covered)
    pieces = () if disjoint else tuple(_pieces(runs_per_row, hi))
    return FeaturePlan(P, width, lo, hi, tuple(_group(runs_per_row)), disjoint, pieces, covered,
                       tuple(tuple(r) for r in runs_per_row))


@torch.compiler.disable
def plan_for(feature_index: torch.Tensor) -> FeaturePlan:
    """The plan of ``feature_index``, kept by the project's one caching rule (``gdn_layer.derived``:
    identity, shape, storage, version; CPU values compared; an accelerator inference tensor is planned
    at each call): rebuilt (one host read) after any change to the index.

    Never traced by torch.compile (a graph break): traced, the cache keeps nothing and the index was read
    back to the host at every call (a device-to-host copy and sync per layer call on a GPU)."""
    return derived(feature_index, "feature_plan", lambda: build_plan(feature_index))


def _rows_view(x: torch.Tensor, c: Copy) -> torch.Tensor:
    """``[count, B, T_local, n]`` view of ``x [B, T_local, F]``: entry i is ``x[..., src+i*step :][:n]``."""
    B, T, _ = x.shape
    sB, sT, sF = x.stride()
    return x.as_strided((c.count, B, T, c.n), (c.step * sF, sB, sT, sF), x.storage_offset() + c.src * sF)


def _restrict(c: Copy, lo: int, hi: int) -> Copy | None:
    """The part of ``c`` that serves rows ``[lo, hi)``, or None when it serves none of them."""
    first, stop = max(c.first, lo), min(c.first + c.count, hi)
    if first >= stop:
        return None
    return Copy(first, stop - first, c.dst, c.src + (first - c.first) * c.step, c.step, c.n)


def pack_rows(x: torch.Tensor, plan: FeaturePlan, feature_index: torch.Tensor, dest: torch.Tensor,
              lo: int, hi: int) -> None:
    """Rows ``[lo, hi)`` of the send buffer only: ``dest[d - lo, t, b, :] = x[b, t, feature_index[d]]``
    for ``lo <= d < hi``; ``dest`` is ``[hi - lo, T_local, B, F_out]`` (any strides)."""
    if plan.copies is None:
        xt = x.transpose(0, 1)
        for d in range(lo, hi):
            torch.index_select(xt, 2, feature_index[d], out=dest[d - lo])
        return
    for c in plan.copies:
        r = _restrict(c, lo, hi)
        if r is not None:
            a = r.first - lo
            dest[a:a + r.count, :, :, r.dst:r.dst + r.n].transpose(1, 2).copy_(_rows_view(x, r))


def pack(x: torch.Tensor, plan: FeaturePlan, feature_index: torch.Tensor, send: torch.Tensor) -> None:
    """Fill ``send [P, T_local, B, F_out]`` with ``send[d, t, b, :] = x[b, t, feature_index[d]]``."""
    pack_rows(x, plan, feature_index, send, 0, plan.rows)


def unpack_start(like: torch.Tensor, plan: FeaturePlan, B: int, T: int, F: int) -> torch.Tensor:
    """The ``[B, T, F]`` gradient buffer that ``unpack_rows`` fills: zero where no row reads a feature
    (everywhere for a gathered plan, whose ``index_add_`` needs zeros), the rest left to the rows."""
    if plan.copies is None:
        return like.new_zeros(B, T, F)
    out = like.new_empty(B, T, F)
    for start, stop in plan.uncovered(F):
        out[..., start:stop].zero_()
    return out


def unpack_rows(out: torch.Tensor, grad: torch.Tensor, plan: FeaturePlan, feature_index: torch.Tensor,
                lo: int, hi: int, first: int = 0) -> None:
    """The adjoint of ``pack_rows`` for rows ``[lo, hi)``: ``grad [hi - lo, T_local, B, F_out]`` (only
    read, any strides) into ``out [B, T_local, F]`` from ``unpack_start``.

    Rows may be written back in any grouping, but in the order row ``first``, then the others
    ascending: where rows share a feature (``plan.disjoint`` False) the first of them in that order
    copies and the later ones add (``plan.pieces_from(first)``)."""
    if plan.copies is None:
        for d in range(lo, hi):
            out.index_add_(2, feature_index[d], grad[d - lo].transpose(0, 1))
        return
    if plan.disjoint:
        # no feature is read twice: the copies write disjoint slices of out
        for c in plan.copies:
            r = _restrict(c, lo, hi)
            if r is not None:
                a = r.first - lo
                _rows_view(out, r).copy_(grad[a:a + r.count, :, :, r.dst:r.dst + r.n].transpose(1, 2))
        return
    for p in plan.pieces_from(first):
        if lo <= p.row < hi:
            dst = out[..., p.src:p.src + p.n]
            src = grad[p.row - lo, :, :, p.dst:p.dst + p.n].transpose(0, 1)
            if p.accumulate:
                dst.add_(src)
            else:
                dst.copy_(src)


def unpack(grad: torch.Tensor, plan: FeaturePlan, feature_index: torch.Tensor, F: int) -> torch.Tensor:
    """The adjoint of ``pack``: ``[B, T_local, F]`` from ``grad [P, T_local, B, F_out]``, summing over
    every (row, position) that read a feature; zero where no row did. ``grad`` is only read."""
    P, T, B, _ = grad.shape
    out = unpack_start(grad, plan, B, T, F)
    unpack_rows(out, grad, plan, feature_index, 0, P)
    return out


__all__ = ["FeaturePlan", "build_plan", "plan_for", "pack", "pack_rows", "unpack", "unpack_start", "unpack_rows",
           "MAX_RUNS_PER_ROW"]
