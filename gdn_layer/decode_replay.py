"""Eager decode steps over a state pool replayed from CUDA graphs, one per layer, pool and capacity.

``layer(x, state=pool, state_slots=slots)`` with one token per sequence (``x [N, 1, hidden]``, no
``cu_seqlens``, no checkpoints) on CUDA costs the host several times the step's GPU work (the checks, the
projections, the fused decode kernels, the gated norm, ``out_proj``: about a dozen launches through Python).
From the third such call of a (layer, pool, capacity) on, the step replays a ``DecodeGraph`` captured for it
(gdn_layer/decode_graph.py): ``x`` and ``slots`` are copied into the graph's buffers, rows past N padded with
``-1``, the pool rows are read and written in place as eagerly, and ``y`` is a copy. The *capacity* is N rounded
up to a power of two, so every N up to it replays one graph.

The graph holds the pool's tensors and the layer's parameters by address: the key holds their addresses and
layouts (with the layer's configuration: a changed norm eps or backend takes a new graph), and a weak reference to
each pool tensor's base tells that the pool still exists (a new pool, or parameters replaced, take a new graph;
views of one pool made afresh each step share theirs; a graph is dropped with its pool). Only calls on one pool
count towards its capture: a caller that copies its states into a new pool at every step (the transformers
adapter, whose states live in transformers' cache) never captures one. The registry holds neither the layer nor the pool. At
most ``MAX_PER_LAYER`` graphs are kept per layer (least recently used dropped).

Every call runs eagerly, with the same results, where a graph would not see what the eager call does: graphs
switched off (``mix_graphs.set_enabled(False)`` or ``GDN_MIX_GRAPHS=0``, shared with the training calls'
graphs, or inside ``mix_graphs.paused()``); not CUDA; autocast; inside ``torch.compile`` or another capture (a
``DecodeGraph``, a whole model's step); validation on; hooks on the layer's submodules or global module hooks, a
``forward`` replaced on one of them or an accelerate hook; subclass (DTensor) parameters.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from gdn_layer import mix_graphs
from gdn_layer.submodules import unhooked

CAPTURE_AFTER = 2        # eager calls of a key before its capture
MAX_PER_LAYER = 4        # graphs kept per layer

_lock = threading.RLock()
_kept: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # layer -> OrderedDict(key -> entry or None)
_stats = {"captures": 0, "replays": 0}


def _make(layer, pool, capacity):
    """A captured step (``DecodeGraph``; the CPU tests put a stand-in here)."""
    from gdn_layer.decode_graph import DecodeGraph
    return DecodeGraph(layer, pool, capacity)


def stats() -> dict:
    """``{"captures": n, "replays": n}`` since the last ``clear()``."""
    return dict(_stats)


def clear() -> None:
    """Drop every graph and count."""
    with _lock:
        _kept.clear()
        _stats.update(captures=0, replays=0)


def _plain_params(layer, device):
    """The layer's parameters (one walk over its submodules), or None where a replay would not run what the eager
    call runs: a hook (a submodule's or a global one), a ``forward`` replaced on a submodule, an accelerate hook, a
    parameter of a tensor subclass (DTensor) or on another device (``mix_graphs.plain_tensors_on``)."""
    params = []
    for m in layer.modules():
        if not unhooked(m) or (m is not layer and "forward" in m.__dict__) or m.__dict__.get("_hf_hook") is not None:
            return None
        params.extend(p for p in m._parameters.values() if p is not None)
    return params if mix_graphs.plain_tensors_on(device, params) else None


def _base(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose memory ``t`` views (``t`` itself if none): what stays the same when a caller slices its
    pool afresh each step."""
    return t if t._base is None else t._base


def _key(layer, x, pool, capacity, params) -> tuple:
    """What the graph holds fixed: the configuration (a changed eps or backend is another graph), x's dtype, the
    capacity, and the addresses and layouts of the pool's tensors and of the parameters."""
    def where(t):
        return (t.data_ptr(), tuple(t.shape), t.stride())
    norm = layer.norm
    return (type(layer), layer.extra_repr(), norm.eps, norm.backend, getattr(norm, "gate", None), capacity, x.dtype,
            where(pool.conv_state), where(pool.recurrent_state), tuple(where(p) for p in params))


def try_decode(layer, x, cu, pool, slots, checkpoint_slots):
    """``y [N, 1, hidden]`` of a checked pool call from a replay, or None (then the call runs eagerly)."""
    if torch.compiler.is_compiling() or cu is not None or checkpoint_slots is not None or x.shape[1] != 1:
        return None
    if not mix_graphs.may_replay(x) or (params := _plain_params(layer, x.device)) is None:
        return None
    capacity = 1 << max(x.shape[0] - 1, 0).bit_length()
    key = _key(layer, x, pool, capacity, params)
    bases = (_base(pool.conv_state), _base(pool.recurrent_state))
    with _lock:
        graphs = _kept.setdefault(layer, OrderedDict())
        entry = graphs.get(key)
        if entry is not None and not (entry[1]() is bases[0] and entry[2]() is bases[1]):
            del graphs[key]                          # another pool now at the old one's addresses
            entry = None
        if entry is None:
            entry = _seen_or_capture(layer, graphs, key, pool, capacity, bases)
            if entry is None:
                return None
        graphs.move_to_end(key)
        _stats["replays"] += 1
        return entry[0](x, slots)


def _seen_or_capture(layer, graphs, key, pool, capacity, bases):
    """Count a call of ``key``; at the call after ``CAPTURE_AFTER``, capture, keep and return its entry
    ``(step, weakref(conv base), weakref(recurrent base))``, each weak reference dropping the entry with its pool."""
    count, *seen = graphs.pop(("seen", key), (0, None, None))
    if not (seen[0] is not None and seen[0]() is bases[0] and seen[1]() is bases[1]):
        count = 0                                    # counted calls were of another pool (a copy made per step)
    count += 1
    if count <= CAPTURE_AFTER:
        graphs[("seen", key)] = (count, weakref.ref(bases[0]), weakref.ref(bases[1]))
        _trim(graphs)
        return None
    with mix_graphs.paused():                        # (the capture's own eager calls run eagerly)
        step = _make(layer, pool, capacity)
    step.layer = step.pool = None                    # held by the caller, not by the registry

    def drop(_ref, graphs=graphs, key=key):          # the pool is gone: so is its graph
        with _lock:
            graphs.pop(key, None)
    entry = (step, weakref.ref(bases[0], drop), weakref.ref(bases[1], drop))
    graphs[key] = entry
    _stats["captures"] += 1
    _trim(graphs)
    return entry


def _trim(graphs) -> None:
    """At most ``MAX_PER_LAYER`` graphs and ``4 MAX_PER_LAYER`` counts, least recently used dropped."""
    kept = [k for k in graphs if k[0] != "seen"]
    seen = [k for k in graphs if k[0] == "seen"]
    for k in kept[:max(0, len(kept) - MAX_PER_LAYER)] + seen[:max(0, len(seen) - 4 * MAX_PER_LAYER)]:
        del graphs[k]


__all__ = ["try_decode", "stats", "clear", "CAPTURE_AFTER", "MAX_PER_LAYER"]
