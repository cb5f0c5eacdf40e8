"""``token_order`` inside GatedDeltaNet: tokens held in a load balancer's order, not contiguous slices.

``token_order [T]`` (the same on every rank) lists the original position of each token in the order the
ranks hold them; rank i of the cp x sp mesh holds entries ``i*T/P .. (i+1)*T/P``. ``cu_seqlens`` stays in
the original order. No extra communication moves activations:

- Ulysses (``sp_group``) alone, or one process: after the all-to-all the rank holds every token of its
  heads, in held order; one ``index_select`` puts them in original order before the conv, another puts
  the kernel's output back in held order before the all-to-all back. Any permutation.
- State passing (``cp_group``, alone or on a cp x sp mesh): the cp rank's tokens (its sp group's, after
  the all-to-all) are sorted into original order, which makes them a few fragments of the pack; the
  conv halos and the affine state maps travel per fragment piece (``parallel.fragments``). Orders with
  more than ``parallel.fragments.max_fragments_per_rank(N)`` fragments on a rank raise ValueError.

See docs/context_parallel.md.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_layer.context_parallel import _tie, mix_planned
from gdn_layer.kernels import chunk_gated_delta_rule
from gdn_layer.kernels.cu_cache import derived, host_copy
from gdn_layer.kernels.validation import values_checkable
from gdn_layer.parallel.context import gather_from_ranks
from gdn_layer.parallel.fragments import (FragmentPlan, compose_chains, count_fragments, max_fragments_per_rank,
                                          plan_fragments)
from gdn_layer.parallel.token_order import check_token_order
from gdn_layer.state import state_dtype


@dataclass(frozen=True)
class HeldOrder:
    """How this rank's gathered tokens map to the original order.

    Attributes:
        order: the validated int64 ``token_order [T]``.
        sort: int64 index along T: ``held.index_select(1, sort)`` is in original order (all of T without
            cp; this cp rank's tokens, sorted, with cp). unsort: undoes ``sort``.
        fragments: the ``FragmentPlan`` under cp, else None.
    """

    order: torch.Tensor
    sort: torch.Tensor
    unsort: torch.Tensor
    fragments: FragmentPlan | None


def prepare_token_order(layer, token_order, x: torch.Tensor, cu: torch.Tensor | None) -> HeldOrder | None:
    """Validate ``token_order`` for this layer and input, and plan its use (no collective).

    Args:
        layer: the GatedDeltaNet. token_order: None or the ``[T]`` order. x: this rank's hidden states
            (validated). cu: the validated int64 global boundaries (always set under cp) or None.

    Returns:
        None for None, else a ``HeldOrder``. Built once per ``token_order`` tensor (and boundaries, mesh
        position, device) while it lives unchanged, like what the kernels derive from ``cu_seqlens``
        (``kernels.cu_cache.derived``): every layer of a step shares one plan and one host read.

    Raises:
        TypeError / ValueError (``parallel.token_order.check_token_order``); ValueError when a cp rank
        would hold more fragments than ``max_fragments_per_rank`` allows. Under cp the values are always
        read on the host (the plan needs them); otherwise only when value checks run.
    """
    if token_order is None:
        return None
    C = layer.cp_size
    T = x.shape[1] * layer.sp_size * C
    check_token_order(token_order, T, x.device, check_values=False)  # shape and dtype: every call
    if T == 0 and C > 1:
        raise ValueError("token_order was given for an empty pack (T = 0) under cp_group: there is nothing to "
                         "order; pass token_order=None")
    if C == 1:
        return _held(layer, token_order, T, None, x.device, values_checkable(token_order))
    return _cp_held(layer, token_order, T, cu, x.device)


def _held(layer, token_order, T, cu_host, device, check) -> HeldOrder:
    """``_plan``, cached per ``token_order`` tensor and arguments (``derived``)."""
    window = layer.conv_kernel_size - 1
    key = ("gdn_layer.token_order", T, cu_host, layer.cp_size, layer.cp_rank, window, device, check)
    return derived(token_order, key, lambda: _plan(token_order, T, cu_host, layer.cp_size, layer.cp_rank,
                                                   window, device, check))


@torch.compiler.disable
def _cp_held(layer, token_order, T, cu, device) -> HeldOrder:
    """``_held`` under cp: ``cu`` and the order's values read on the host (once per tensors) and checked.
    Never traced by torch.compile (a graph break): traced, it guarded on the host values and read them at
    every call."""
    return _held(layer, token_order, T, tuple(int(v) for v in host_copy(cu).tolist()), device, True)


def _plan(token_order, T, cu_host, C, rank, window, device, check) -> HeldOrder:
    order = check_token_order(token_order, T, device, check_values=check)
    if order is token_order:  # a cached value must not hold its own key tensor (it would never leave)
        order = order.clone()
    if C == 1:
        return HeldOrder(order, torch.argsort(order), order, None)
    host = order.cpu()
    most, cap = int(count_fragments(host, C).max()), max_fragments_per_rank(len(cu_host) - 1)
    if most > cap:
        raise ValueError(f"token_order puts {most} fragments (runs of consecutive original positions) on one cp "
                         f"rank; with cp_group at most 2 * N + 2 = {cap} for N = {len(cu_host) - 1} sequences "
                         "(contiguous slices, head-tail, per-document head-tail): each fragment edge hands a state "
                         "map between ranks. Any permutation is served under sp_group alone")
    plan = plan_fragments(host, list(cu_host), C, rank, window, device)
    return HeldOrder(order, plan.sort, plan.unsort, plan)


def to_original_order(t: torch.Tensor, held: HeldOrder | None) -> torch.Tensor:
    """``t [B, T', ...]`` in held order -> original order (sorted, under cp); differentiable."""
    return t if held is None else t.index_select(1, held.sort)


def to_held_order(t: torch.Tensor, held: HeldOrder | None) -> torch.Tensor:
    """Inverse of ``to_original_order``."""
    return t if held is None else t.index_select(1, held.unsort)


def fragment_token_mix(layer, mixed: torch.Tensor, state, output_state: bool, plan: FragmentPlan):
    """Conv, gate and delta rule of this cp rank's pieces, with the hand-offs between pieces.

    Args:
        layer: the GatedDeltaNet. mixed: ``[1, L, C_local + 2 hv]`` pre-conv inputs of this cp rank's
            tokens in original order (``to_original_order``). state: the full ``GDNState`` or None.
        output_state: whether final states are needed. plan: this rank's ``FragmentPlan``.

    Returns:
        ``(o [1, L, hv, Dv], conv_state [N, C_local, W-1], recurrent_state [N, hv, Dk, Dv])``, the states
        taken from the rank holding each sequence's last token (the same on every cp rank), or None
        without ``output_state``. Same collectives, in the same order, on every rank.
    """
    return mix_planned(layer, mixed, plan, state, output_state, _conv_initial_state, _recurrent_initial_state,
                       rows=plan.owned_piece)


def _conv_initial_state(layer, mixed, plan, state):
    """``[K, C_local, W-1]`` per piece: the document's given conv state (zeros without one) for a piece
    that starts its document, else the W-1 inputs before the piece (earlier pieces' tails, preceded by
    the given state where the document began fewer than W-1 tokens before)."""
    C, window = layer.local_conv_dim, layer.conv_kernel_size - 1
    own = layer._local_conv_state(state)
    if window == 0:
        return None if own is None else own.index_select(0, plan.piece_seq)
    N = plan.owner.numel()
    if own is None:
        own = mixed.new_zeros(N, C, window, dtype=state_dtype(mixed.dtype))
    base = own.index_select(0, plan.piece_seq)
    if not plan.passing:
        return base
    tails = mixed[0].index_select(0, plan.tail_rows)[:, :C]                      # [slots * window, C]
    gathered = gather_from_ranks(tails, layer.cp_group).reshape(-1, C).to(own.dtype)
    source = torch.cat([own.transpose(1, 2).reshape(N * window, C), gathered])
    halo = source.index_select(0, plan.halo.reshape(-1)).reshape(-1, window, C).transpose(1, 2)
    return _tie(base.index_copy(0, plan.later, halo), gathered)


def _recurrent_initial_state(layer, qkvgb, plan, state):
    """``[K, hv, Dk, Dv]`` per piece: the document's given state (zeros without one) for a piece that
    starts its document, else the state composed from the maps of the document's earlier pieces."""
    q, k, v, g, beta = qkvgb
    own = layer._local_recurrent_state(state)
    N, K = plan.owner.numel(), plan.cu_local.numel() - 1
    hv, Dk, Dv = v.shape[2], k.shape[3], v.shape[3]
    if own is None:
        own = v.new_zeros(N, hv, Dk, Dv, dtype=state_dtype(v.dtype))
    base = own.index_select(0, plan.piece_seq)
    if not plan.passing:
        return base
    dt = own.dtype
    run = lambda vv, init: chunk_gated_delta_rule(  # noqa: E731
        q, k, vv, g, beta, initial_state=init, output_final_state=True, cu_seqlens=plan.cu_local,
        use_qk_l2norm=not layer._qk_l2norm_in_conv(q, plan.cu_local), backend=layer._backend)[1]
    # per piece S_out = M S_in + H: M from I with v = 0, H from the document's own state (first piece)
    # or from zero (later pieces)
    eye = torch.eye(Dk, dtype=dt, device=v.device).expand(K, hv, Dk, Dk)
    M = run(v.new_zeros(*v.shape[:3], Dk), eye)
    H = run(v, torch.where(plan.first[:, None, None, None], base, torch.zeros_like(base)))
    maps = torch.cat([M.to(dt), H.to(dt)], -1).index_select(0, plan.sent)  # the pieces whose document goes on
    maps = torch.cat([maps, maps.new_zeros(plan.slots - maps.shape[0], *maps.shape[1:])])
    table = gather_from_ranks(_tie(maps, q, own), layer.cp_group).flatten(0, 1)
    table = torch.cat([table, table.new_zeros(1, *table.shape[1:])])           # the chains' pad row
    S = compose_chains(table, plan.chain, Dk)
    return _tie(base.index_copy(0, plan.later, S.to(base.dtype)), table)


__all__ = ["HeldOrder", "prepare_token_order", "to_original_order", "to_held_order", "fragment_token_mix"]
