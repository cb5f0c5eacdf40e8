"""The one rule for every value the project derives from an input and keeps between calls.

A model runs every GatedDeltaNet layer of a step on the same tensors (``cu_seqlens``, the all-to-all's
``feature_index``, transformers' ``position_ids``), so what is derived from them (an int64 device copy,
host values, fla's chunk index, the conv's sequence index, the all-to-all's slice plan, the adapter's
pack boundaries) is built once and reused. Every such cache in the project goes through ``derived``
(values derived from a tensor) or ``derived_from_sizes`` (values derived from a module's sizes alone),
so a fix to the rule reaches all of them. The rule:

- **Keyed on everything the value depends on.** Automatically: the source tensor's identity (``id`` and
  a weak reference, so an entry leaves with its tensor), its shape, strides, dtype, device, storage
  address and version counter. The caller's ``key`` names the value and every other input it depends on
  (a length T, a batch size B, the identity of a second tensor).
- **Never served for a refilled buffer.** An in-place change bumps the version counter. Writes that miss
  it (a ``torch.distributed`` collective receiving into the buffer: broadcast, recv, scatter, all_reduce;
  a numpy view; ``.data``) are seen for CPU sources, whose values are compared at each lookup (O(numel)
  host work, no device read). On an accelerator only the version counter, storage and shape are seen: a
  buffer there written by a collective, through ``.data`` or outside PyTorch must be a new tensor, or be
  marked after the write with ``torch.autograd.graph.increment_version(t)``.
- **Built outside inference mode.** A value built under ``torch.inference_mode`` would be an inference
  tensor; kept for a later call that autograd records (a training step after an eval pass), it could not
  be saved for backward. Kept values are therefore built with inference mode off.
- **Inference tensors on an accelerator are never kept** (they have no version counter, so a refill
  could not be seen): ``build`` runs at each call, in the caller's mode. On the CPU they are kept and
  checked by value like any CPU tensor.
- **Nothing is kept, and nothing kept is served,** while ``torch.compile`` traces, during a CUDA graph
  capture, or while ``torch.compile(mode="reduce-overhead")``'s CUDA-graph trees warm up or record (what is
  built then lives in the graph's memory pool, which a replay may overwrite; and a value served from the
  cache would be baked into the graph and not follow a new packing copied into its inputs).
- **Bounded:** at most ``MAX_ENTRIES`` source tensors and ``MAX_VALUES_PER_ENTRY`` values per source, least
  recently used dropped first (a caller holding many packs alive does not also hold what was derived from
  each; a source reused with ever new other inputs does not pile up values).

Treat what is returned as read-only. docs/kernels.md ("What is cached between calls") states the rule for
users.
"""
from __future__ import annotations

import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable

import torch

MAX_ENTRIES = 64
# values kept per source tensor (least recently used dropped): a source reused with ever new other
# inputs (one token_order tensor with a new cu_seqlens each step) must not pile up values either
MAX_VALUES_PER_ENTRY = 16

# id(source) -> _Entry, least recently used first
_CACHE: OrderedDict[int, "_Entry"] = OrderedDict()
_LOCK = threading.RLock()


class _Entry:
    __slots__ = ("ref", "signature", "snapshot", "values")

    def __init__(self, ref, signature, snapshot):
        self.ref, self.signature, self.snapshot, self.values = ref, signature, snapshot, OrderedDict()


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:     # inference tensors keep no version counter
        return None


def _cudagraph_tree_busy(device: torch.device) -> bool:
    """``torch.compile(mode="reduce-overhead")``'s CUDA-graph trees are warming up or recording on ``device``:
    what is allocated now comes from the graph's private pool, which must hold no tensor the graph does not
    track (a kept value would be overwritten by a replay, and the trees refuse to record)."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    if trees is None:
        return False
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        manager = trees.get_manager(index, create_if_none_exists=False)
        # the trees end a warm-up lazily, at the next compiled call: their state alone would also cover the
        # eager code between compiled calls; while they run, the current stream is theirs
        return (manager is not None and (manager.in_warmup or manager.in_recording)
                and torch.cuda.current_stream(index) == manager.stream)
    except Exception:  # noqa: BLE001 - a torch without this private API: nothing to see
        return False


def capturing(t: torch.Tensor | torch.device) -> bool:
    """A CUDA graph capture (or a reduce-overhead CUDA-graph tree's warm-up) is underway on the device of
    ``t`` (a tensor, or a device): nothing built now may be kept."""
    device = t if isinstance(t, torch.device) else t.device
    return device.type == "cuda" and (torch.cuda.is_current_stream_capturing() or _cudagraph_tree_busy(device))


def _signature(t: torch.Tensor, version) -> tuple:
    return (tuple(t.shape), t.stride(), t.dtype, t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
            version)


def _snapshot(t: torch.Tensor) -> torch.Tensor | None:
    if t.device.type != "cpu":
        return None
    with torch.inference_mode(False):
        return t.detach().clone()


def _unchanged(t: torch.Tensor, entry: _Entry, signature: tuple) -> bool:
    if entry.ref() is not t or entry.signature != signature:
        return False
    return entry.snapshot is None or torch.equal(t.detach(), entry.snapshot)


def _keepable(source: torch.Tensor) -> bool:
    if torch.compiler.is_compiling() or capturing(source):
        return False
    try:
        source.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):   # fake / functional tensors outside a compile: no storage
        return False
    return source.device.type == "cpu" or _version(source) is not None


def _entry_for(source: torch.Tensor) -> _Entry:
    k = id(source)
    signature = _signature(source, _version(source))
    entry = _CACHE.get(k)
    if entry is not None and _unchanged(source, entry, signature):
        _CACHE.move_to_end(k)
        return entry

    def forget(ref, k=k):
        with _LOCK:
            hit = _CACHE.get(k)
            if hit is not None and hit.ref is ref:
                del _CACHE[k]

    entry = _Entry(weakref.ref(source, forget), signature, _snapshot(source))
    _CACHE.pop(k, None)
    _CACHE[k] = entry
    while len(_CACHE) > MAX_ENTRIES:
        _CACHE.popitem(last=False)
    return entry


def derived(source: torch.Tensor, key: Hashable, build: Callable[[], Any]) -> Any:
    """``build()``, computed once per ``(source, key)`` while ``source`` lives unchanged (rule above).

    Args:
        source: the tensor the value is derived from (any device, any dtype).
        key: hashable name of the value plus every other input it depends on (e.g. ``("conv_index", T)``).
        build: computes the value. It must not return ``source`` itself or hold it (the entry would keep
            its own tensor alive and never leave).
    """
    if not _keepable(source):
        return build()
    with _LOCK:
        values = _entry_for(source).values
        if key in values:
            values.move_to_end(key)
            return values[key]
    with torch.inference_mode(False):
        value = build()
    with _LOCK:
        value = values.setdefault(key, value)
        while len(values) > MAX_VALUES_PER_ENTRY:
            values.popitem(last=False)
        return value


def known(source: torch.Tensor, key: Hashable) -> Any:
    """The value kept for ``(source, key)`` under the rule above, or None; never builds one (for values
    whose build would cost what the caller avoids, e.g. host values: a device read)."""
    if not _keepable(source):
        return None
    with _LOCK:
        entry = _CACHE.get(id(source))
        if entry is None or not _unchanged(source, entry, _signature(source, _version(source))):
            return None
        return entry.values.get(key)


def remember(source: torch.Tensor, key: Hashable, value: Any) -> None:
    """Store a value of ``source`` known without computing it (e.g. host values a CPU caller handed in)."""
    derived(source, key, lambda: value)


def derived_from_sizes(store: dict, key: Hashable, build: Callable[[], Any], max_entries: int | None = None) -> Any:
    """``build()`` kept in ``store`` (the owner's own dict) under ``key``: for values derived from sizes
    alone (no input tensor), e.g. the all-to-all's feature index per device, a ``[0, T]`` boundary
    tensor per ``(T, device)``. Built outside inference mode, for the reason above; not kept while
    ``torch.compile`` traces or during a CUDA graph capture. ``key`` must name everything the value
    depends on (the device, at least). With ``max_entries``, the least recently used entries beyond it
    are dropped (rebuilt on their next use)."""
    value = store.get(key)
    if value is not None:
        if max_entries is not None:
            store[key] = store.pop(key)          # most recently used last
        return value
    if torch.compiler.is_compiling():            # a tensor made while tracing is a fake one: never kept
        return build()
    with torch.inference_mode(False):
        value = build()
    if not (torch.cuda.is_available() and capturing(torch.device("cuda"))):
        store[key] = value
        while max_entries is not None and len(store) > max_entries:
            store.pop(next(iter(store)))
    return value


def clear() -> None:
    """Drop every kept value (tests; or to free device memory held by derived indices)."""
    with _LOCK:
        _CACHE.clear()


__all__ = ["derived", "known", "remember", "derived_from_sizes", "capturing", "clear", "MAX_ENTRIES",
           "MAX_VALUES_PER_ENTRY"]
