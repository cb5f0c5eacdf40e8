"""The Ulysses all-to-all pair: sequence-sharded <-> feature(head)-sharded, with autograd.

Layout conventions (P = group size, rank i):

- sequence-sharded: ``[B, T_local, F]``, rank i holds tokens ``[i*T_local, (i+1)*T_local)`` of the global
  ``T = P * T_local`` and all F features.
- feature-sharded: ``[B, T, F_out]``, every token in global order, only this rank's features.

Both sides think in ``[P, T_local, B, F_out]`` blocks (block d goes to / came from rank d; tokens before
batch). Of the P blocks a rank produces, the one it "sends to itself" never enters a collective: the
P - 1 peers' blocks are posted as one batch of point-to-point sends and receives
(``torch.distributed.batch_isend_irecv``: gloo, NCCL and other backends), and while they are in flight
the own block is copied (or, in ``project_seq_to_head``, computed) straight from the input into its
place in the output. Only then does the current stream wait for the exchange (``Work.wait``: on NCCL a
stream dependency, no host sync) and read what arrived. ``seq_to_head`` writes the peers' send blocks
with a few slice copies (``feature_plan``: no gather) and returns the receive buffer as a view,
``[P*T_local, B, F_out]`` transposed to ``[B, T, F_out]``, a view for every B. The backward is the
reverse exchange plus the same slice copies, adding only where a feature went to several ranks.
docs/ulysses.md says which bytes go where and why.
"""
from __future__ import annotations

from contextlib import nullcontext as _nullcontext

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .feature_plan import pack, pack_rows, plan_for, unpack, unpack_rows, unpack_start
from .groups import resolve_sp_group


def _peer_ranges(P: int, me: int) -> list[tuple[int, int, int]]:
    """``(lo, hi, j)``: rows ``[lo, hi)`` of a ``[P, ...]`` buffer are entries ``[j, j + hi - lo)`` of the
    ``[P - 1, ...]`` buffer of the peers' blocks (every row but ``me``, in rank order)."""
    return [(lo, hi, j) for lo, hi, j in ((0, me, 0), (me + 1, P, me)) if hi > lo]


def _peers(P: int, me: int) -> list[int]:
    return [d for d in range(P) if d != me]


def _peer_blocks(t: torch.Tensor, me: int) -> list[torch.Tensor]:
    """The peers' blocks ``t[d]`` (``d != me``) of a ``[P, ...]`` tensor, each contiguous as a
    point-to-point send needs: views of ``t`` when they already are, else one buffer holding copies."""
    peers = _peers(t.shape[0], me)
    if all(t[d].is_contiguous() for d in peers):
        return [t[d] for d in peers]
    buf = t.new_empty(len(peers), *t.shape[1:])
    for lo, hi, j in _peer_ranges(t.shape[0], me):
        buf[j:j + hi - lo].copy_(t[lo:hi])
    return list(buf.unbind(0))


def _post(sends, recvs, me: int, group) -> list:
    """Post ``sends[j]`` to and ``recvs[j]`` from the j-th peer (ranks of ``group`` but ``me``, in order)
    as one batch; returns the works to wait on. Empty blocks (no tokens or no features) are
    replaced by one-element placeholders: a rank that skipped the exchange would leave a peer whose
    shapes differ (it has tokens) waiting for the group's timeout; with a message posted, the mismatch
    fails at once, as any other (gloo: "Received data size doesn't match expected size")."""
    peers = _peers(len(sends) + 1, me)
    if not peers:
        return []
    if sends[0].numel() == 0:
        sends = [sends[0].new_zeros(1) for _ in peers]
        recvs = [sends[0].new_empty(1) for _ in peers]
    ops = []
    for d, s, r in zip(peers, sends, recvs):
        ops.append(dist.P2POp(dist.irecv, r, group=group, group_peer=d))
        ops.append(dist.P2POp(dist.isend, s, group=group, group_peer=d))
    return dist.batch_isend_irecv(ops)


@torch.compiler.disable
def _exchange(sends, recvs, me: int, group, meanwhile):
    """Post the exchange, run ``meanwhile()`` (the work that overlaps it), wait (NCCL: the current stream
    waits, no host sync; gloo: the host waits); returns what ``meanwhile`` returns.

    Never traced by ``torch.compile``: a compiled graph writing the own row of a receive buffer copies the
    whole buffer back (functionalized) over rows still arriving from the peers, a race losing them."""
    works = _post(sends, recvs, me, group)
    out = meanwhile()
    for w in works:
        w.wait()
    return out


class _SeqToHead(torch.autograd.Function):
    """``x [B, T_local, F]`` -> receive buffer ``[P, T_local, B, F_out]`` (``None`` group: P = 1, no collective).

    Forward: the peers' rows packed into ``[P - 1, T_local, B, F_out]`` and exchanged; meanwhile row
    ``me`` is packed from x straight into ``recv[me]``. Backward: the peers' blocks of the gradient sent
    back (no copy when they are contiguous); meanwhile block ``me`` is unpacked into dx, then the
    received blocks (``feature_plan.unpack_rows``: copies, adds where features repeat, zeros where none
    was sent).
    """

    @staticmethod
    def forward(ctx, x, feature_index, plan, group, me):
        ctx.plan, ctx.group, ctx.me, ctx.F = plan, group, me, x.shape[2]
        ctx.save_for_backward(feature_index)
        B, T_local, _ = x.shape
        P = plan.rows
        recv = x.new_empty(P, T_local, B, plan.width)
        if group is None:
            pack(x, plan, feature_index, recv)
            return recv
        send = x.new_empty(P - 1, T_local, B, plan.width)
        for lo, hi, j in _peer_ranges(P, me):
            pack_rows(x, plan, feature_index, send[j:j + hi - lo], lo, hi)
        _exchange(send.unbind(0), [recv[d] for d in _peers(P, me)], me, group,
                  lambda: pack_rows(x, plan, feature_index, recv[me:me + 1], me, me + 1))
        return recv

    @staticmethod
    @once_differentiable         # the exchange is invisible to autograd: a 2nd derivative would miss the peers'
    def backward(ctx, grad):
        (feature_index,) = ctx.saved_tensors
        plan, group, me = ctx.plan, ctx.group, ctx.me
        # grad is only read: sent as is, or copied; the incoming gradient is never modified
        if group is None:
            return unpack(grad, plan, feature_index, ctx.F), None, None, None, None
        P, T_local, B, _ = grad.shape
        out = unpack_start(grad, plan, B, T_local, ctx.F)
        back = grad.new_empty(P - 1, *grad.shape[1:])
        _exchange(_peer_blocks(grad, me), back.unbind(0), me, group,
                  lambda: unpack_rows(out, grad[me:me + 1], plan, feature_index, me, me + 1, first=me))
        for lo, hi, j in _peer_ranges(P, me):
            unpack_rows(out, back[j:j + hi - lo], plan, feature_index, lo, hi, first=me)
        return out, None, None, None, None


class _HeadToSeq(torch.autograd.Function):
    """``x [B, T, F_local]`` -> ``[B, T_local, P * F_local]`` (features by source rank); backward the reverse.

    Forward: x's blocks of the peers' tokens sent as they are when contiguous (B == 1 and x contiguous,
    or x in ``seq_to_head``'s layout), else copied once; meanwhile x's block of my own tokens is copied
    into its columns of the output, then the received blocks into theirs. Backward: the peers' column
    blocks of the gradient copied into a send buffer; meanwhile my own block into the gradient's
    receive buffer, which the peers' blocks then arrive in directly.
    """

    @staticmethod
    def forward(ctx, x, group, size, me):
        ctx.group, ctx.size, ctx.me = group, size, me
        B, T, F_local = x.shape
        T_local = T // size
        xt = x.transpose(0, 1).unflatten(0, (size, T_local))         # [P, T_local, B, F_local], a view
        recv = x.new_empty(size - 1, T_local, B, F_local)            # block j: peer j's features of my tokens
        out = x.new_empty(B, T_local, size * F_local)
        _exchange(_peer_blocks(xt, me), recv.unbind(0), me, group,
                  lambda: out.view(B, T_local, size, F_local)[:, :, me].copy_(xt[me].transpose(0, 1)))
        # the view is taken after the exchange (a graph break under torch.compile): a resumed graph given both
        # out and a view of it (then written) fails in AOT autograd's aliasing path with dynamic shapes
        by_rank = out.view(B, T_local, size, F_local)
        for lo, hi, j in _peer_ranges(size, me):
            by_rank[:, :, lo:hi].copy_(recv[j:j + hi - lo].permute(2, 1, 0, 3))
        return out

    @staticmethod
    @once_differentiable         # the exchange is invisible to autograd: a 2nd derivative would miss the peers'
    def backward(ctx, grad):
        P, me = ctx.size, ctx.me
        B, T_local, F = grad.shape
        F_local = F // P                 # explicit: a -1 is ambiguous when the gradient has no elements
        blocks = grad.unflatten(2, (P, F_local)).permute(2, 1, 0, 3)  # [P, T_local, B, F_local], a view
        back = grad.new_empty(P, T_local, B, F_local)                # block s: my features of rank s's tokens
        _exchange(_peer_blocks(blocks, me), [back[d] for d in _peers(P, me)], me, ctx.group,
                  lambda: back[me].copy_(blocks[me]))
        return back.view(P * T_local, B, F_local).transpose(0, 1), None, None, None


def _check_3d(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"{name} must be 3-D [B, T, F], got shape {tuple(x.shape)}")


def _checked_plan(feature_index, size: int, device, F: int, what: str):
    """``feature_plan.plan_for(feature_index)`` after checking it is int64 ``[size, F_out]`` on ``device``
    with indices in ``[0, F)``."""
    if not isinstance(feature_index, torch.Tensor):
        raise TypeError(f"feature_index must be a torch.Tensor, got {type(feature_index).__name__}")
    if feature_index.dtype != torch.int64:
        raise TypeError(f"feature_index must be int64 (torch.long), got {feature_index.dtype}")
    if feature_index.dim() != 2 or feature_index.shape[0] != size:
        raise ValueError(f"feature_index must be [P, F_out] with P = SP size = {size}, "
                         f"got shape {tuple(feature_index.shape)}")
    if feature_index.device != device:
        raise ValueError(f"feature_index is on {feature_index.device} but x is on {device}; "
                         "build it once on x.device")
    plan = plan_for(feature_index)
    if plan.lo < 0 or plan.hi >= F:
        raise ValueError(f"feature_index must hold indices in [0, {what} = {F}), got min {plan.lo}, max {plan.hi}")
    return plan


class _ProjectToHead(torch.autograd.Function):
    """``rows [N, H]`` (my tokens, ``N = T_local * B``, token-major) and ``w [P, F_out, H]`` (rank d's
    rows of the projection) -> ``recv [P, T_local, B, F_out]``, ``recv[s] = rows_of_rank_s @ w[me]^T``.

    Forward: one GEMM per peer d writes ``rows @ w[d]^T`` into the send buffer, the exchange is posted,
    and meanwhile ``rows @ w[me]^T`` is computed straight into ``recv[me]`` (never sent nor copied).
    Backward: the peers' gradient blocks go back (no copy when contiguous); meanwhile block ``me``'s
    GEMMs run, then each received block's: ``drows = sum_d g_d @ w[d]``, ``dw[d] = g_d^T @ rows``.
    The GEMMs run in ``dtype`` (``project_seq_to_head`` picks it as autocast would); the casts happen
    here so that the backward hands back gradients in the operands' own dtypes: ``drows`` summed over
    the P destinations in float32 for 16-bit GEMMs and rounded at most once, as autocast's ``F.linear``
    and the batched GEMM this replaced (a bf16 running sum rounds P times: 1.5x their error).
    """

    @staticmethod
    def forward(ctx, rows, w, group, me, T_local, B, dtype):
        ctx.group, ctx.me, ctx.dtypes = group, me, (rows.dtype, w.dtype)
        rows, w = rows.to(dtype), w.to(dtype)
        ctx.save_for_backward(rows, w)
        P, W, _ = w.shape
        N = rows.shape[0]
        peers = _peers(P, me)
        send = rows.new_empty(P - 1, N, W)
        for j, d in enumerate(peers):
            torch.mm(rows, w[d].t(), out=send[j])
        recv = rows.new_empty(P, N, W)
        _exchange(send.unbind(0), [recv[d] for d in peers], me, group,
                  lambda: torch.mm(rows, w[me].t(), out=recv[me]))
        return recv.view(P, T_local, B, W)

    @staticmethod
    @once_differentiable         # the exchange is invisible to autograd: a 2nd derivative would miss the peers'
    def backward(ctx, grad):
        rows, w = ctx.saved_tensors
        me = ctx.me
        P, W, H = w.shape
        N = rows.shape[0]
        peers = _peers(P, me)
        back = grad.new_empty(P - 1, N, W)
        want_rows, want_w = ctx.needs_input_grad[:2]
        low = rows.dtype in (torch.float16, torch.bfloat16)

        def own_block():
            g, drows, dw = grad[me].reshape(N, W), None, None
            if want_rows:
                drows = torch.mm(g, w[me])
                drows = drows.float() if low else drows
            if want_w:
                dw = w.new_empty(P, W, H)
                torch.mm(g.t(), rows, out=dw[me])
            return drows, dw
        drows, dw = _exchange([b.view(N, W) for b in _peer_blocks(grad, me)], back.unbind(0), me, ctx.group,
                              own_block)
        for j, d in enumerate(peers):
            if want_rows:
                if low:
                    drows.add_(torch.mm(back[j], w[d]))
                else:
                    drows.addmm_(back[j], w[d])
            if want_w:
                torch.mm(back[j].t(), rows, out=dw[d])
        rows_dtype, w_dtype = ctx.dtypes
        return (None if drows is None else drows.to(rows_dtype), None if dw is None else dw.to(w_dtype),
                None, None, None, None, None)


def project_seq_to_head(x: torch.Tensor, weight: torch.Tensor, feature_index: torch.Tensor, group) -> torch.Tensor:
    """``seq_to_head(F.linear(x, weight), feature_index, group)`` without materialising the projection:
    one GEMM per destination rank writes its features straight into the exchange's send buffer (for
    the other ranks) or the receive buffer (for this rank).

    Args:
        x: ``[B, T_local, H]`` (sequence-sharded, as for ``seq_to_head``).
        weight: ``[F, H]``, a bias-free linear projection to the F features that ``feature_index`` picks.
        feature_index, group: as for ``seq_to_head`` (indices into the F output features).

    Returns:
        ``[B, T_local * P, F_out]``, the same values, layout and strides as ``seq_to_head`` of the
        projection. Forward: the rows of ``weight`` gathered per rank (``[P, F_out, H]``, weight-sized);
        one GEMM per peer d writes ``x @ W_d^T`` into the send buffer ``[P - 1, T_local, B, F_out]``, and
        while those blocks are exchanged ``x @ W_me^T`` is computed straight into the receive buffer
        (the block this rank keeps is never sent or copied). Backward: the reverse exchange of the
        peers' blocks, overlapped with the own block's GEMMs, then the received blocks' (dx summed over
        destinations; dweight accumulated by ``index_select``'s backward, so rows sent to several ranks
        add up). No group (or size 1): one ``torch.bmm`` for the one block. Under ``torch.autocast`` the
        GEMMs run in its dtype, as ``F.linear`` would (float64 operands stay float64, as autocast leaves them).

    Raises:
        TypeError / ValueError: as ``seq_to_head``; weight not 2-D ``[F, H]`` matching x's last dim;
        (TypeError) weight's dtype differs from x's outside autocast, or under it one of them is float64
        and the other not.
    """
    group, size, rank = resolve_sp_group(group)
    _check_3d("x", x)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be [F, H] with H = x.shape[-1] = {x.shape[-1]}, got {tuple(weight.shape)}")
    plan = _checked_plan(feature_index, size, x.device, weight.shape[0], "F = weight.shape[0]")
    dev = x.device.type
    autocast = dev != "meta" and torch.is_autocast_enabled(dev)
    to = torch.get_autocast_dtype(dev) if autocast else None

    def gemm_dtype(t):
        # autocast casts F.linear's floating operands to its dtype, all but float64
        return t.dtype if to is None or t.dtype == torch.float64 or not t.is_floating_point() else to

    if gemm_dtype(weight) != gemm_dtype(x):
        raise TypeError(f"weight dtype {weight.dtype} differs from x's ({x.dtype}); cast one of them, or run "
                        + ("both in float64 (autocast leaves float64 alone)" if autocast else "under torch.autocast"))
    B, T_local, H = x.shape
    w = weight.index_select(0, feature_index.flatten()).view(size, plan.width, H)
    rows = x.transpose(0, 1).reshape(T_local * B, H)           # tokens before batch (a view when B == 1)
    if size == 1:
        send = torch.bmm(rows.expand(size, T_local * B, H), w.transpose(1, 2))
        return send.view(T_local, B, plan.width).transpose(0, 1)
    # the GEMMs write into buffers (out=), which autocast does not cast: the Function casts as it would
    with torch.autocast(dev, enabled=False) if autocast else _nullcontext():
        recv = _ProjectToHead.apply(rows, w, group, rank, T_local, B, gemm_dtype(x))
    return recv.view(size * T_local, B, plan.width).transpose(0, 1)


def seq_to_head(x: torch.Tensor, feature_index: torch.Tensor, group) -> torch.Tensor:
    """Sequence-sharded -> feature-sharded: gather the full sequence of this rank's features.

    Args:
        x: ``[B, T_local, F]``, any dtype the backend moves, any strides; rank i holds tokens
            ``[i*T_local, (i+1)*T_local)``. Every rank must pass the same shape and dtype: not checked
            here (the layer does, with ``agree_across_ranks``); a mismatch fails in the exchange (gloo
            aborts the process), docs/ulysses.md.
        feature_index: int64 ``[P, F_out]`` on ``x.device``; row d lists which of the F features rank d
            receives, in the order it receives them. Rows may overlap (replicated q/k heads); must be
            identical on every rank. Read on the host once per tensor (one device->host copy the first
            time, cached by tensor identity and version counter): keep the tensor, e.g. as a buffer.
        group: None, a ProcessGroup or a 1-D DeviceMesh (see ``resolve_sp_group``).

    Returns:
        ``[B, T_local * P, F_out]``: all tokens in global order, features ``x[..., feature_index[rank]]``.
        With no group (or size 1): ``x[..., feature_index[0]]``. A view of the receive buffer with
        strides ``(F_out, B * F_out, 1)`` (contiguous when B == 1): consumers must accept a batch
        stride smaller than the token stride when B > 1.

    How: rows made of at most ``feature_plan.MAX_RUNS_PER_ROW`` contiguous runs (the layer's rows are
    5) are written by slice copies, one per run shared by all rows whose runs advance by a constant
    step; other rows are gathered with ``index_select``. The P - 1 peers' rows go into a send buffer
    and are exchanged point-to-point (one batch); this rank's own row is written straight from x into
    the receive buffer while that exchange is in flight, and never sent.

    Backward: the peers' blocks of the gradient sent back (as they are when contiguous, e.g. B == 1 or
    a gradient in the output's layout), the own block unpacked into the F features while they travel,
    then the received ones; a feature sent to several ranks receives the sum of their gradients (an add
    per extra copy, or ``index_add_`` for gathered rows), a feature sent nowhere a zero gradient.

    Raises:
        TypeError: x or feature_index not a tensor, feature_index not int64.
        ValueError: x not 3-D; feature_index not ``[P, F_out]``, not on x.device, or holding an index
            outside ``[0, F)``.
    """
    group, size, rank = resolve_sp_group(group)
    _check_3d("x", x)
    plan = _checked_plan(feature_index, size, x.device, x.shape[-1], "F")
    B, T_local, _ = x.shape
    recv = _SeqToHead.apply(x, feature_index, plan, group if size > 1 else None, rank)
    # [P, T_local, B, F_out] is [T, B, F_out] in global token order: a view for every B
    return recv.view(size * T_local, B, plan.width).transpose(0, 1)


def head_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """Feature-sharded -> sequence-sharded: the inverse layout change of ``seq_to_head``.

    Args:
        x: ``[B, T, F_local]``: every token in global order, this rank's F_local features, any strides
            (no copy before the exchange when B == 1 and x is contiguous, or when x is in
            ``seq_to_head``'s layout). Every rank must pass the same shape.
        group: None, a ProcessGroup or a 1-D DeviceMesh.

    Returns:
        ``[B, T / P, P * F_local]``, contiguous: rank i's tokens ``[i*T/P, (i+1)*T/P)``, features ordered
        by source rank: ``[features of rank 0 | features of rank 1 | ... ]``. Each element is written
        once: this rank's own block straight from x while the peers' blocks are exchanged, then each
        received block. With no group (or size 1): x.

    Backward: the peers' column blocks of the gradient copied once into a send buffer and exchanged;
    the own block copied into the receive buffer meanwhile. The returned gradient is a view of that
    buffer (``[T, B, F_local]`` order).

    Raises:
        TypeError: x not a tensor.
        ValueError: x not 3-D, or T not divisible by P (pad the sequence with ``pad_for_sp`` first).
    """
    group, size, rank = resolve_sp_group(group)
    _check_3d("x", x)
    if size == 1:
        return x
    T = x.shape[1]
    if T % size != 0:
        raise ValueError(f"x.shape[1] = T = {T} must be divisible by the SP size {size}; "
                         "pad the sequence with gdn_layer.parallel.pad_for_sp")
    return _HeadToSeq.apply(x, group, size, rank)


__all__ = ["seq_to_head", "head_to_seq", "project_seq_to_head"]
