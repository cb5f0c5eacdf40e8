"""What the kernels derive from one ``cu_seqlens`` tensor, computed once per tensor instead of per call.

A model runs every GatedDeltaNet layer of a step on the same packed batch, so the same ``cu_seqlens``
reaches each layer's forward and backward. What the backends derive from it (its int64 copy on the
device, its values on the host, fla's chunk index, the compaction of empty segments for FlashQLA, the
conv's per-token sequence index) was recomputed at every call, and the host reads among them are
device syncs: 4 per GatedDeltaNet layer per training step, which kept the GPU waiting in a fine-tuning
step of a small model (docs/performance.md, "Fine-tuning"). One shared int64 copy also lets fla's and
FlashQLA's own identity-keyed caches hit across layers. Here each is built once per tensor and reused while
that tensor lives and is not changed in place.

Cache key: the tensor's identity (``id`` plus a weak reference, so an entry leaves with its tensor)
and its version counter (an in-place change rebuilds); for a CPU tensor also its values (compared at
each lookup: O(N) host work, no device read), so writes the version counter misses are seen there too
(a ``torch.distributed`` collective receiving into the buffer: broadcast, recv, scatter, all_reduce do
not bump it; a numpy view; ``.data``). On an accelerator only the version counter is seen: a buffer
there written by a collective, through ``.data`` or outside PyTorch must be a new tensor, or be marked
after the write with ``torch.autograd.graph.increment_version(cu)``. Treat what ``derived`` returns as
read-only. At most the ``_MAX_ENTRIES`` most recently used tensors keep entries (a caller holding many
packs alive does not hold what was derived from each).

Nothing is cached (``build`` runs each time, as before this cache) for inference tensors (made under
``torch.inference_mode``: they have no version counter, so a refill could not be seen), while
``torch.compile`` traces, or during a CUDA graph capture.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any, Callable

import torch

# id(tensor) -> (weak reference to it, its version counter when cached, {key: value}, its values when
# cached if on the CPU else None), least recently used first
_CACHE: OrderedDict[int, tuple] = OrderedDict()
# Tensors kept at most. A step uses a few (the caller's cu_seqlens, its int64 copy, dense-pack
# boundaries); a caller that keeps many alive (stored packs reused every epoch) would otherwise keep
# what was derived from each (on the device: a [T] index per pack) for as long. A dropped one is rebuilt.
_MAX_ENTRIES = 64


def _version(t: torch.Tensor):
    try:
        return t._version
    except RuntimeError:     # inference tensors keep no version counter: never cached (a refill is unseen)
        return None


def _capturing(t: torch.Tensor) -> bool:
    """A CUDA graph capture is underway: what is built now lives in the graph's memory pool, which a
    replay may overwrite, so it is not kept."""
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _snapshot(cu: torch.Tensor) -> torch.Tensor | None:
    """A CPU ``cu``'s values when cached. Writes that bypass the version counter are common on the host
    (a ``torch.distributed`` collective receiving into a buffer, a numpy view, ``.data``); comparing the
    values there costs O(N) host work and no device read, so they are seen too."""
    if cu.device.type != "cpu":
        return None
    with torch.inference_mode(False):
        return cu.detach().clone()


def _same_values(cu: torch.Tensor, snapshot: torch.Tensor | None) -> bool:
    return snapshot is None or (cu.dtype == snapshot.dtype and torch.equal(cu, snapshot))


def derived(cu: torch.Tensor, key: Any, build: Callable[[], Any]) -> Any:
    """``build()``, computed once per ``(cu, key)`` while ``cu`` lives unchanged.

    Args:
        cu: the tensor the value is derived from (any device; typically ``cu_seqlens``).
        key: hashable name of the derived value (include every other input it depends on, e.g. T).
        build: computes the value from ``cu`` (and the inputs named in ``key``). The value must not
            hold ``cu`` itself (the entry would keep its own tensor alive and never leave).
    """
    version = _version(cu)
    if version is None or torch.compiler.is_compiling() or _capturing(cu):
        return build()
    k = id(cu)
    entry = _CACHE.get(k)
    if entry is None or entry[0]() is not cu or entry[1] != version or not _same_values(cu, entry[3]):
        def forget(ref, k=k):
            hit = _CACHE.get(k)
            if hit is not None and hit[0] is ref:
                _CACHE.pop(k, None)     # (evicted meanwhile by another thread: nothing to do)

        entry = (weakref.ref(cu, forget), version, {}, _snapshot(cu))
        _CACHE.pop(k, None)
        _CACHE[k] = entry
        while len(_CACHE) > _MAX_ENTRIES:
            try:
                _CACHE.popitem(last=False)
            except KeyError:     # emptied meanwhile (another thread, or a weakref callback)
                break
    else:
        try:
            _CACHE.move_to_end(k)
        except KeyError:
            pass
    values = entry[2]
    if key not in values:
        # a value built under inference_mode would be an inference tensor, kept for later calls that
        # autograd records (a training step after an eval pass on the same cu), which cannot save it
        with torch.inference_mode(False):
            values[key] = build()
    return values[key]


def remember(cu: torch.Tensor, key: Any, value: Any) -> None:
    """Store a value of ``cu`` known without computing it (e.g. the host copy a CPU caller handed in)."""
    derived(cu, key, lambda: value)


def host_copy(cu: torch.Tensor) -> torch.Tensor:
    """``cu`` on the CPU: one device-to-host copy (a sync on accelerators) per tensor, not per call."""
    if cu.device.type == "cpu":
        return cu            # (never stored: an entry must not hold its own tensor, or it never leaves)
    return derived(cu, "host", lambda: cu.detach().cpu())


def as_int64(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``cu`` as int64 on ``device``, one shared copy per tensor and version.

    On the CPU an int64 ``cu`` comes back as is. On an accelerator the result is always a copy made
    for this version of ``cu``: fla's and FlashQLA's own caches of what they derive from cu_seqlens
    (chunk offsets, indices) are keyed by the tensor's identity alone, so a caller that refills one
    cu_seqlens buffer in place for every batch would get the previous batch's chunk layout from them.
    A new version gets a new copy, and their caches miss. A CPU ``cu`` also gives its values as the
    copy's ``host_copy``, so no call reads them back from the device.
    """
    device = torch.device(device)
    if device.type == "cpu" and cu.dtype == torch.int64 and cu.device.type == "cpu":
        return cu

    def convert():
        out = cu.detach().to(device=device, dtype=torch.int64, copy=True)
        if cu.device.type == "cpu" and out.device.type != "cpu":
            remember(out, "host", cu.detach().to(torch.int64, copy=True))
        return out
    return derived(cu, ("int64", str(device)), convert)


__all__ = ["derived", "remember", "host_copy", "as_int64"]
