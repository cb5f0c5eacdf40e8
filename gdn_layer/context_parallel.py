"""State-passing context parallelism (``cp_group``) inside GatedDeltaNet: the token mixing of one cp slice.

Rank c of the cp group holds tokens ``[c*L, (c+1)*L)`` of the packed sequence (after the Ulysses
all-to-all of its sp group: all of them, for this sp rank's heads). Everything is local except for the
one sequence that comes in from the previous slice, which needs

- its W-1 pre-conv inputs before the slice (the conv halo), from the tails of earlier slices, and
- its recurrent state at the slice start: per value head the slice maps ``S_in -> M S_in + H`` with
  ``M = prod_t exp(g_t) (I - beta_t k_t k_t^T)`` (latest on the left) and ``H`` the state reached from
  zero; every rank sends the map of the sequence that leaves its slice, and the receiving rank
  composes the maps of the ranks the sequence passed through (``parallel.context.affine_scan``).

``M`` is the final state of the kernel run from ``initial_state = I`` with ``v = 0`` (width Dk), ``H``
the final state from zero with the real ``v``: both through the public kernel API with the layer's
backend. Then the slice is run once more with the true initial states. Gradients flow back through the
collectives (all-gathers whose backward sums over ranks). See docs/context_parallel.md.

Collective order: every rank runs the same collectives in the same order, forward and backward. The
backward order is fixed by data dependencies (final states -> maps -> conv tails); where a rank does
not use a gathered tensor (no sequence comes in) or has no map to send, ``_tie`` adds an exact zero
that depends on it, so its backward still joins every collective, in the same order. Each rank's map
is tied to both its ``q`` and the given state, so it needs a gradient on every rank alike when only
the activations, or only the initial state (a frozen layer), do.
"""
from __future__ import annotations

import torch

from gdn_layer.derived import derived_from_sizes
from gdn_layer.kernels import chunk_gated_delta_rule, cu_cache
from gdn_layer.parallel.context import (affine_scan, gather_from_ranks, plan_slice, rows_before_slice,
                                        select_owned)
from gdn_layer.state import state_dtype


def _tie(t: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
    """``t`` plus an exact zero that depends on each of ``others`` (an empty slice's sum: never NaN)."""
    for o in others:
        t = t + o.reshape(-1)[:0].sum().to(t.dtype)
    return t


def cp_token_mix(layer, mixed: torch.Tensor, cu: torch.Tensor, state, output_state: bool):
    """Conv, gate and delta rule of this cp rank's slice, with the hand-offs between slices.

    Args:
        layer: the GatedDeltaNet (its cp group, sizes, weights, backend and local-head helpers).
        mixed: ``[1, L, C_local + 2 hv]`` pre-conv ``[q | k | v | a | b]`` of every token of the slice,
            this sp rank's channels (``C_local = layer.local_conv_dim``).
        cu: int64 ``[N + 1]`` GLOBAL boundaries (``cu[-1] = cp * L``); read on the host once per tensor
            (``slice_plan``).
        state: the full ``GDNState`` or None. output_state: whether final states are needed.

    Returns:
        ``(o [1, L, hv, Dv], conv_state, recurrent_state)``; the states (``[N, C_local, W-1]``,
        ``[N, hv, Dk, Dv]``, the final state of every sequence, taken from the rank holding its last
        token, the same on every cp rank) or None without ``output_state``.
    """
    plan = slice_plan(cu, layer.cp_size, layer.cp_rank)
    return mix_planned(layer, mixed, plan, state, output_state, _conv_initial_state, _recurrent_initial_state)


def mix_planned(layer, mixed, plan, state, output_state: bool, conv_initial_state, recurrent_initial_state,
                rows=None):
    """Conv, gate and delta rule of this cp rank's local pack ``plan.cu_local``, from the initial states
    the two callbacks build (``(layer, mixed, plan, state)`` -> conv state; ``(layer, (q, k, v, g, beta),
    plan, state)`` -> recurrent state), then, with ``output_state``, each sequence's final state from the
    rank that owns it (``plan.owner``; ``rows`` picks the local rows that stand for the sequences first).
    Shared by contiguous slices (``cp_token_mix``) and fragments of a load-balanced order
    (``gdn_layer.token_order.fragment_token_mix``). Same collectives, in the same order, on every rank."""
    conv0 = conv_initial_state(layer, mixed, plan, state)
    q, k, v, g, beta, conv_state = layer._conv_gate(mixed, plan.cu_local, conv0, output_state)
    S0 = recurrent_initial_state(layer, (q, k, v, g, beta), plan, state)
    o, recurrent_state = layer._delta_rule(q, k, v, g, beta, plan.cu_local, S0, output_state)
    if not output_state:
        return o, None, None
    # one collective for both states: the owner's rows, on every rank
    dt = torch.promote_types(conv_state.dtype, recurrent_state.dtype)
    both = torch.cat([conv_state.to(dt).flatten(1), recurrent_state.to(dt).flatten(1)], 1)
    both = select_owned(both if rows is None else both.index_select(0, rows), plan.owner, layer.cp_group)
    n_conv, N = conv_state[0].numel(), plan.owner.numel()
    return (o, both[:, :n_conv].reshape(N, *conv_state.shape[1:]).to(conv_state.dtype),
            both[:, n_conv:].reshape(N, *recurrent_state.shape[1:]).to(recurrent_state.dtype))


@torch.compiler.disable
def slice_plan(cu: torch.Tensor, size: int, rank: int):
    """``plan_slice`` of ``cu``, built once per ``cu`` tensor (``kernels.cu_cache``): every layer of a step
    and its backward share one plan, and its one host read of ``cu`` is the cached ``host_copy`` that
    the kernels' own index plans read too (one device-to-host copy per pack, not per layer call).

    Never traced by torch.compile (a graph break): traced, the plan's Python guarded on the host values
    of ``cu`` and recompiled for every new layout until dynamo's recompile limit, and its cache (which
    keeps nothing while tracing) was bypassed."""
    return cu_cache.derived(cu, ("cp_slice_plan", size, rank), lambda: plan_slice(
        cu, size, rank, host_cu=[int(v) for v in cu_cache.host_copy(cu).tolist()]))


@torch.compiler.disable
def whole_sequence_cu(T: int, device: torch.device) -> torch.Tensor:
    """int64 ``[0, T]`` on ``device`` (one sequence, under CP without ``cu_seqlens``), one tensor per
    ``(T, device)`` (``gdn_layer.derived``, 16 kept): no host-built tensor per call, and the slice plan
    derived from it is cached too (never traced by torch.compile, which would make a new one per call)."""
    return derived_from_sizes(_WHOLE, (T, str(device)),
                              lambda: torch.tensor([0, T], dtype=torch.int64, device=device), max_entries=16)


_WHOLE: dict = {}


def _conv_initial_state(layer, mixed, plan, state) -> torch.Tensor | None:
    """``[N, C_local, W-1]``: the state's rows (zeros without a state), with the incoming sequence's row
    replaced by the last W-1 inputs before the slice: the sequence's own earlier tokens, gathered from
    the tails of earlier slices (possibly several ranks back when ``L < W-1``), preceded by its row of
    the given state where the sequence began fewer than W-1 tokens before the slice."""
    C, W = layer.local_conv_dim, layer.conv_kernel_size
    own = layer._local_conv_state(state)
    if W == 1:  # no conv state at all
        return own
    N = plan.cu_local.numel() - 1
    if own is None:
        own = mixed.new_zeros(N, C, W - 1, dtype=state_dtype(mixed.dtype))
    m = min(W - 1, plan.length)
    tails = gather_from_ranks(mixed[0, plan.length - m:, :C], layer.cp_group)  # [cp, m, C]
    if plan.incoming < 0:
        return _tie(own, tails)
    i = plan.incoming
    before = rows_before_slice(tails, plan.rank, min(plan.incoming_seen, W - 1))
    halo = torch.cat([own[i], before.transpose(0, 1).to(own.dtype)], -1)[:, -(W - 1):]
    return torch.cat([own[:i], halo[None], own[i + 1:]])


def _recurrent_initial_state(layer, qkvgb, plan, state) -> torch.Tensor:
    """``[N, hv, Dk, Dv]``: the state's rows (zeros without one), with the incoming sequence's row
    replaced by its state at the slice start, composed from the maps every cp rank sends."""
    q, k, v, g, beta = qkvgb
    own = layer._local_recurrent_state(state)
    N = plan.cu_local.numel() - 1
    hv, Dk, Dv = v.shape[2], k.shape[3], v.shape[3]
    if own is None:
        own = v.new_zeros(N, hv, Dk, Dv, dtype=state_dtype(v.dtype))
    maps = gather_from_ranks(_outgoing_map(layer, qkvgb, plan, own), layer.cp_group)  # [cp, hv, Dk, Dk+Dv]
    if plan.incoming < 0:
        return _tie(own, maps)
    M, H = maps.split([Dk, Dv], -1)
    S = affine_scan(M, H, plan.incoming_first_rank, plan.rank).to(own.dtype)
    i = plan.incoming
    return torch.cat([own[:i], S[None], own[i + 1:]])


def _outgoing_map(layer, qkvgb, plan, own) -> torch.Tensor:
    """``[hv, Dk, Dk + Dv]`` = ``[M | H]`` of the sequence that leaves this slice: over its tokens here,
    ``S_out = M S_in + H``. A sequence that began in this slice has ``M = 0`` and its own initial state
    folded into ``H``; a slice with no leaving sequence sends zeros."""
    q, k, v, g, beta = qkvgb
    hv, Dk, Dv = v.shape[2], k.shape[3], v.shape[3]
    dt = own.dtype
    zeros_M = own.new_zeros(1, hv, Dk, Dk)
    if plan.outgoing < 0:  # tied to what the other ranks' maps depend on, so every rank's needs a gradient
        return _tie(own.new_zeros(hv, Dk, Dk + Dv), q, own)
    lo = plan.outgoing_from
    part = [t[:, lo:] for t in (q, k, v, g, beta)]
    run = lambda vv, init: chunk_gated_delta_rule(  # noqa: E731
        part[0], part[1], vv, part[3], part[4], initial_state=init, output_final_state=True,
        use_qk_l2norm=not layer._qk_l2norm_in_conv(q, plan.cu_local), backend=layer._backend)[1]
    if plan.outgoing == plan.incoming:  # the sequence passes through the whole slice
        eye = torch.eye(Dk, dtype=dt, device=v.device).expand(1, hv, Dk, Dk)
        M = run(part[2].new_zeros(*part[2].shape[:3], Dk), eye)
        H = run(part[2], None)
    else:
        j = plan.outgoing
        M, H = zeros_M, run(part[2], own[j:j + 1])
    return _tie(torch.cat([M, H.to(dt)], -1)[0], q, own)
