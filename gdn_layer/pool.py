"""A state pool for serving: the rows of one ``GDNState`` read and written in place, one row per sequence.

``layer(x, cu_seqlens=cu, state=pool, state_slots=slots, checkpoint_slots=ck, checkpoint_every=E)``:
sequence ``i`` starts from row ``slots[i]`` and its state after its last token is written back to that row;
``slots[i] == -1`` marks a padding sequence (nothing read or written, its outputs zero). With ``ck [N, M]``
the state after token ``(j + 1) * E`` of sequence ``i`` (counted from its first token in this call) is also
written to row ``ck[i, j]`` (``-1`` and positions past the sequence's end write nothing).

Nothing here reads a value of ``slots``, ``ck`` or ``cu_seqlens`` on the host (but the value checks: on CPU, or
with validation switched on, ``kernels.validation.values_checkable``): every index is computed on the
device with shapes fixed by N, M, E and the number of tokens, so a decode step of fixed N is captured by a
CUDA graph and replayed with new values. Rows are written by ``index_copy_`` of whole rows; the entries of a
padding sequence (or an unwritten checkpoint) are sent to the row of a written entry with that entry's value
(or, when none is written, to row 0 with its own value), so every duplicate index carries the same bytes and
no other row changes.

A decode step (one token per sequence: ``x [N, 1, hidden]`` without ``cu_seqlens``, no checkpoints) on a CUDA
device runs its conv update, gate, q / k norm and delta-rule step as two fused kernels that read and write the
pool rows through ``slots`` themselves (``kernels/triton/decode.py``); every other call gathers the rows, runs
the layer's own dataflow and writes them back.

Checkpoints run the call in rounds: round ``j < M`` takes tokens ``[j E, (j + 1) E)`` of every sequence as one
packed batch (static capacity ``N E``, a trailing filler segment), a last round the rest; each round starts
from the states of the one before, so the results equal one call per sequence (the conv and the delta rule
restart at each segment boundary and continue from the given states).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_layer.checks import check_inputs, positive_int
from gdn_layer.decode_replay import try_decode
from gdn_layer.kernels.api import pool_decode_step
from gdn_layer.kernels.validation import values_checkable
from gdn_layer.state import GDNState, autograd_records, check_state, state_dtype
from gdn_layer.submodules import conv_weight

# the fused decode step on CPU tensors too (tests, under TRITON_INTERPRET=1); on CUDA it is always on
FUSED_DECODE_ON_CPU = False


@dataclass
class PoolCall:
    """One call's view of the pool: ``slots`` int64 ``[N]``, ``ck`` int64 ``[N, M]`` or None, ``every`` = E,
    ``cu`` int64 ``[N + 1]`` over the flattened tokens."""
    pool: GDNState
    slots: torch.Tensor
    ck: torch.Tensor | None
    every: int
    cu: torch.Tensor

    @property
    def valid(self) -> torch.Tensor:
        return self.slots >= 0


def check_pool_flags(layer, x, output_state, token_order) -> None:
    """What a pool call refuses whatever its inputs, checked first (before ``check_inputs``, whose agreement
    step under SP is never reached: the layer has no SP / CP group here)."""
    if layer.sp_size * layer.cp_size > 1:
        raise ValueError("state_slots (a state pool) is not supported under sequence or context parallelism: "
                         "decode runs on one rank (a layer built without sp_group / cp_group, the same weights)")
    if output_state is not False:
        raise ValueError("output_state=True with state_slots: the states are written into the pool's rows "
                         "in place; read them there (pool.recurrent_state[slots])")
    if token_order is not None:
        raise ValueError("token_order with state_slots: a state pool serves one rank; pass tokens in order")
    if autograd_records(x, layer.parameters()):
        raise ValueError("state_slots (a state pool) is for inference: autograd is recording (grad mode on and "
                         "hidden_states or a parameter requires grad); call under torch.no_grad() or "
                         "torch.inference_mode(), or use state= / output_state=True for training")


def check_pool_call(layer, x, cu, pool, state_slots, checkpoint_slots, checkpoint_every) -> None:
    """Raise TypeError / ValueError naming the argument unless the pool call is well formed, before anything
    is read or written (``x`` and ``cu`` checked already; values only where ``values_checkable``)."""
    if not isinstance(pool, GDNState):
        raise TypeError(f"state must be a GDNState pool (layer.new_state(num_slots)) with state_slots, "
                        f"got {type(pool).__name__}")
    rows = pool.recurrent_state.shape[0] if isinstance(pool.recurrent_state, torch.Tensor) else -1
    want = {"conv_state": (rows, layer.conv_dim, layer.conv_kernel_size - 1),
            "recurrent_state": (rows, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)}
    for name, shape in want.items():
        t = getattr(pool, name)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"state (a pool) .{name} must be [num_slots, ...] = {shape} for this layer, got {got}")
    check_state(pool, rows, layer.conv_dim, layer.conv_kernel_size, layer.num_v_heads,
                layer.head_k_dim, layer.head_v_dim, x.device, x.dtype)
    for name in want:
        t = getattr(pool, name)
        if t.requires_grad:
            raise ValueError(f"state.{name} (a pool) requires grad: a pool is written in place, for inference only")
        if t.is_inference() and not torch.is_inference_mode_enabled():
            raise ValueError(f"state.{name} (a pool) was made under torch.inference_mode, which allows its in-place "
                             "updates only under inference_mode: call under torch.inference_mode() too, or make the "
                             "pool outside it (layer.new_state under torch.no_grad())")
    n = x.shape[0] if cu is None else cu.numel() - 1
    _check_index("state_slots", state_slots, (n,), x.device,
                 "N = B without cu_seqlens, len(cu_seqlens) - 1 with it", rows)
    if isinstance(checkpoint_every, bool) or not isinstance(checkpoint_every, int):
        raise TypeError(f"checkpoint_every must be an int, got {type(checkpoint_every).__name__}")
    if not (checkpoint_every == 1 or (checkpoint_every > 0 and checkpoint_every % 64 == 0)):
        raise ValueError(f"checkpoint_every must be 1 (speculative decoding) or a positive multiple of 64 "
                         f"(prefix caching: chunk boundaries), got {checkpoint_every}")
    if checkpoint_slots is None:
        return
    if not isinstance(checkpoint_slots, torch.Tensor) or checkpoint_slots.dim() != 2:
        raise ValueError("checkpoint_slots must be an int32/int64 [N, M] tensor, got "
                         + (f"shape {tuple(checkpoint_slots.shape)}" if isinstance(checkpoint_slots, torch.Tensor)
                            else type(checkpoint_slots).__name__))
    _check_index("checkpoint_slots", checkpoint_slots, (n, checkpoint_slots.shape[1]), x.device, "N as state_slots",
                 rows)


def _check_index(name, t, shape, device, what, rows):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be an int32/int64 tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name} must be int32 or int64 (row indices into the pool, -1 = none), got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} ({what}), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but hidden_states is on {device}")
    if t.numel() and values_checkable(t):   # on CPU, or on an accelerator with validation on (a sync)
        if (t < -1).any():
            raise ValueError(f"{name} holds {int(t.min())}: entries are row indices >= 0, or -1 for none")
        if int(t.max()) >= rows:
            raise ValueError(f"{name} holds row {int(t.max())}, but the pool has {rows} rows (0 .. {rows - 1})")
        used = t[t >= 0]
        if used.unique().numel() != used.numel():
            raise ValueError(f"{name} names a row twice: each "
                             + ("sequence" if name == "state_slots" else "checkpoint") + " needs its own row")


def pool_call(x, cu, pool, state_slots, checkpoint_slots, checkpoint_every) -> PoolCall:
    """The call's indices as int64 on the device; ``cu`` over the tokens flattened to ``[1, B * T]``."""
    B, T = x.shape[:2]
    if cu is None:
        cu = torch.arange(B + 1, device=x.device) * T
    ck = None if checkpoint_slots is None else checkpoint_slots.long()
    return PoolCall(pool, state_slots.long(), ck, checkpoint_every, cu.long())


def gather(call: PoolCall) -> GDNState:
    """The call's rows, zero for -1 (selected, not multiplied: a NaN in the row the index is clamped to stays
    out)."""
    rows = call.slots.clamp_min(0)
    keep = call.valid
    conv = call.pool.conv_state.index_select(0, rows)
    rec = call.pool.recurrent_state.index_select(0, rows)
    return GDNState(torch.where(keep[:, None, None], conv, torch.zeros((), dtype=conv.dtype, device=conv.device)),
                    torch.where(keep[:, None, None, None], rec, torch.zeros((), dtype=rec.dtype, device=rec.device)))


def write_rows(call: PoolCall, rows: torch.Tensor, write: torch.Tensor, state: GDNState) -> None:
    """``pool[rows[i]] = state[i]`` where ``write[i]``; nothing else changes (module docstring). Every index is
    a 1-element tensor, never a 0-dim one (indexing with a 0-dim tensor reads it on the host)."""
    first = write.long().argmax().view(1)               # a written entry, or entry 0 when none is
    any_write = write.index_select(0, first)            # [1]
    target = torch.where(write, rows, rows.index_select(0, first)).clamp_min(0)
    values = []
    for pool_t, new in ((call.pool.conv_state, state.conv_state), (call.pool.recurrent_state, state.recurrent_state)):
        shape = (-1,) + (1,) * (new.dim() - 1)
        new = new.to(pool_t.dtype)
        keep = pool_t.index_select(0, target)           # each target row as it is now
        fill = torch.where(any_write.view(shape), new.index_select(0, first), keep)
        values.append(torch.where(write.view(shape), new, fill))
    call.pool.conv_state.index_copy_(0, target, values[0])
    call.pool.recurrent_state.index_copy_(0, target, values[1])


def round_index(cu: torch.Tensor, start: torch.Tensor | int, width: int | None, capacity: int):
    """Tokens ``[start, start + width)`` (``width`` None: to the end) of every sequence, packed: returns
    ``(src [capacity], taken [capacity] bool, cu_round [N + 2], lengths [N])``. ``src`` indexes the flattened
    tokens (0 where not ``taken``); segment ``N`` of ``cu_round`` is the filler up to ``capacity``."""
    lengths_all = cu[1:] - cu[:-1]
    lengths = (lengths_all - start).clamp_min(0)
    if width is not None:
        lengths = lengths.clamp_max(width)
    ends = lengths.cumsum(0)
    pos = torch.arange(capacity, device=cu.device)
    seg = torch.searchsorted(ends, pos, right=True)            # N for the filler
    taken = seg < lengths.numel()
    seg_c = seg.clamp_max(lengths.numel() - 1)
    offset = pos - (ends[seg_c] - lengths[seg_c])
    src = torch.where(taken, cu[:-1][seg_c] + start + offset, torch.zeros_like(pos))
    cu_round = torch.cat([cu.new_zeros(1), ends, cu.new_full((1,), capacity)])
    return src, taken, cu_round, lengths


def new_pool(layer, num_slots: int) -> GDNState:
    """``layer.new_state(num_slots)``: zero rows, float32 (float64 for a float64 layer), on the layer's device."""
    num_slots = positive_int("num_slots", num_slots)
    kw = {"device": layer.A_log.device, "dtype": state_dtype(layer.out_proj.weight.dtype)}
    return GDNState(torch.zeros(num_slots, layer.conv_dim, layer.conv_kernel_size - 1, **kw),
                    torch.zeros(num_slots, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, **kw))


def forward_pool(layer, x, cu_seqlens, pool, output_state, token_order, state_slots, checkpoint_slots,
                 checkpoint_every):
    """``layer.forward`` from and into a state pool: the layer's dataflow, each sequence's state gathered from
    its row and written back in place; with checkpoints, in rounds (module docstring)."""
    if state_slots is None:
        raise ValueError("checkpoint_slots needs state_slots (and state=pool): checkpoints are pool rows")
    check_pool_flags(layer, x, output_state, token_order)
    cu, _ = check_inputs(layer, x, cu_seqlens, None, False)
    check_pool_call(layer, x, cu, pool, state_slots, checkpoint_slots, checkpoint_every)
    B, T = x.shape[:2]
    if B * T == 0:                             # no token: every row stays as it is
        return x.new_zeros(B, T, layer.hidden_size)
    if (y := try_decode(layer, x, cu, pool, state_slots, checkpoint_slots)) is not None:
        return y                               # a decode step from a replay (gdn_layer/decode_replay.py)
    mixed, z = layer._project(x)
    if _fused_decode(layer, x, cu, pool, checkpoint_slots):
        o = _decode_step(layer, mixed.reshape(B, -1), pool, state_slots)
        return layer.out_proj(layer.norm(o[:, None], z).flatten(2))
    call = pool_call(x, cu, pool, state_slots, checkpoint_slots, checkpoint_every)
    mixed = mixed.reshape(1, B * T, -1)        # B rows are B sequences of call.cu
    state = gather(call)
    if call.ck is None:
        o, state = _mix_from(layer, mixed, call.cu, state)
    else:
        o, state = _mix_in_rounds(layer, mixed, call, state)
    write_rows(call, call.slots, call.valid, state)
    if cu is None:     # B rows of T tokens
        token_valid = call.valid[:, None].expand(B, T).reshape(-1)
    else:
        token_valid = call.valid[torch.searchsorted(call.cu[1:], torch.arange(B * T, device=x.device), right=True)]
    o = torch.where(token_valid[None, :, None, None], o, torch.zeros((), dtype=o.dtype, device=o.device))
    o = layer.norm(o.reshape(B, T, layer.num_v_heads, layer.head_v_dim), z)
    return layer.out_proj(o.flatten(2))


def _fused_decode(layer, x, cu, pool: GDNState, checkpoint_slots) -> bool:
    """Whether the call is a decode step the fused kernels take (from the layer's methods, shapes and the device)."""
    return (_kernels_match(layer) and checkpoint_slots is None and cu is None and x.shape[1] == 1
            and pool.conv_state.stride(-1) == 1 and pool.recurrent_state.stride(-1) == 1
            and pool.conv_state.stride(0) != 0 and pool.recurrent_state.stride(0) != 0   # (rows of their own)
            and not torch.compiler.is_compiling()          # (a trace takes the op-by-op step: aten ops only)
            and (x.is_cuda or (FUSED_DECODE_ON_CPU and x.device.type == "cpu")))


def _kernels_match(layer) -> bool:
    """Whether the fused kernels compute what the layer's ``_conv_gate`` and ``_delta_rule`` do: they are
    ``GatedDeltaNet``'s own (a subclass or an instance replacing either decodes op by op), unless the class
    says otherwise (``_fuses_decode``: OLMo-Hybrid's block, whose gate differs only with ``allow_neg_eigval``)."""
    from gdn_layer.layer import GatedDeltaNet
    if layer._fuses_decode is not None:
        return layer._fuses_decode
    return all(name not in layer.__dict__ and getattr(type(layer), name) is getattr(GatedDeltaNet, name)
               for name in ("_conv_gate", "_delta_rule"))


def _decode_step(layer, mixed, pool: GDNState, slots):
    """``o [N, Hv, Dv]`` of one token per sequence, the pool rows updated in place (kernels/triton/decode.py, which
    indexes ``slots`` by position: an int64 column of a wider table is made contiguous)."""
    weight = conv_weight(layer.conv1d).squeeze(1)
    return pool_decode_step(mixed if mixed.stride(-1) == 1 else mixed.contiguous(),
                            weight if weight.stride(-1) == 1 else weight.contiguous(),
                            layer.A_log.contiguous(), layer.dt_bias.contiguous(), pool.conv_state,
                            pool.recurrent_state, slots.long().contiguous(), layer.num_k_heads, layer.num_v_heads,
                            layer.head_k_dim, layer.head_v_dim)


def _mix_from(layer, mixed, cu, state: GDNState):
    """Conv, gate and delta rule of packed ``mixed [1, T, ...]`` from ``state`` (one row per segment):
    ``(o [1, T, Hv, Dv], final GDNState)``."""
    q, k, v, g, beta, conv_state = layer._conv_gate(mixed, cu, state.conv_state, True)
    o, recurrent_state = layer._delta_rule(q, k, v, g, beta, cu, state.recurrent_state, True)
    return o, GDNState(conv_state.to(state.conv_state.dtype), recurrent_state)


def _mix_in_rounds(layer, mixed, call: PoolCall, state: GDNState):
    """Round j < M: tokens ``[j E, (j + 1) E)`` of every sequence, then the rest, each round from the states
    of the one before; after round j the states of sequences that reached ``(j + 1) E`` tokens go to their
    checkpoint rows."""
    N, M, E = call.slots.numel(), call.ck.shape[1], call.every
    total = mixed.shape[1]
    o_all = mixed.new_zeros(total + 1, layer.num_v_heads, layer.head_v_dim)    # + a row for filler tokens
    for j in range(M + 1):
        last = j == M
        src, taken, cu_round, lengths = round_index(call.cu, j * E, None if last else E, total if last else N * E)
        with_filler = GDNState(torch.cat([state.conv_state, torch.zeros_like(state.conv_state[:1])]),
                               torch.cat([state.recurrent_state, torch.zeros_like(state.recurrent_state[:1])]))
        o, new = _mix_from(layer, mixed[:, src], cu_round, with_filler)
        o_all.index_copy_(0, torch.where(taken, src, total), o[0].to(o_all.dtype))
        state = GDNState(new.conv_state[:N], new.recurrent_state[:N])
        if not last:
            ck = call.ck[:, j]
            write_rows(call, ck, (ck >= 0) & call.valid & (lengths == E), state)
    return o_all[:total][None], state
