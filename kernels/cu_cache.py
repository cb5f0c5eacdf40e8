"""What the kernels derive from one ``cu_seqlens`` tensor, computed once per tensor instead of per call.

A model runs every GatedDeltaNet layer of a step on the same packed batch, so the same ``cu_seqlens``
reaches each layer's forward and backward. What the backends derive from it (its int64 copy on the
device, its values on the host, fla's chunk index, the compaction of empty segments for FlashQLA, the
conv's per-token sequence index) was recomputed at every call, and the host reads among them are
device syncs: 4 per GatedDeltaNet layer per training step, which kept the GPU waiting in a fine-tuning
step of a small model (docs/performance.md, "Fine-tuning"). One shared int64 copy also lets fla's and
FlashQLA's own identity-keyed caches hit across layers.

Everything here is kept by the project's one caching rule, ``gdn_layer.derived`` (identity, shape,
storage and version; CPU values compared; built outside inference mode; LRU): see that module.
"""
from __future__ import annotations

import torch

from ..derived import capturing, derived, known, remember


def host_copy(cu: torch.Tensor) -> torch.Tensor:
    """``cu`` on the CPU: one device-to-host copy (a sync on accelerators) per tensor, not per call."""
    if cu.device.type == "cpu":
        return cu            # (never stored: an entry must not hold its own tensor, or it never leaves)
    return derived(cu, "host", lambda: cu.detach().cpu())


def known_host(cu: torch.Tensor) -> torch.Tensor | None:
    """``cu``'s values on the CPU where they are known without a device read (a CPU tensor, a copy the layer
    made of a CPU ``cu_seqlens``, a tensor read before, ``pad_cu_seqlens`` of such a tensor), else None."""
    return cu if cu.device.type == "cpu" else known(cu, "host")


def as_int64(cu: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``cu`` as int64 on ``device``, one shared copy per tensor and version.

    On the CPU an int64 ``cu`` comes back as is, unless it is an inference tensor (made under
    ``torch.inference_mode``): autograd could not save it in a later training step, so a kept copy
    made outside inference mode comes back. On an accelerator the result is always a copy made
    for this version of ``cu``: fla's and FlashQLA's own caches of what they derive from cu_seqlens
    (chunk offsets, indices) are keyed by the tensor's identity alone, so a caller that refills one
    cu_seqlens buffer in place for every batch would get the previous batch's chunk layout from them.
    A new version gets a new copy, and their caches miss. A CPU ``cu`` also gives its values as the
    copy's ``host_copy``, so no call reads them back from the device.
    """
    device = torch.device(device)
    if (device.type == "cpu" and cu.dtype == torch.int64 and cu.device.type == "cpu"
            and (torch.compiler.is_compiling() or not cu.is_inference())):   # (a trace sees no inference tensor)
        return cu

    def convert():
        # from pageable host memory a non-blocking copy is staged before it returns (safe to reuse the
        # source), and it is no stream sync; from pinned memory it is asynchronous, so it blocks
        non_blocking = cu.device.type == "cpu" and device.type != "cpu" and not cu.is_pinned()
        out = cu.detach().to(device=device, dtype=torch.int64, copy=True, non_blocking=non_blocking)
        host = known_host(cu)
        if host is not None and out.device.type != "cpu":
            remember(out, "host", host.detach().to(torch.int64, copy=True))
        return out
    return derived(cu, ("int64", str(device)), convert)


__all__ = ["derived", "remember", "capturing", "host_copy", "known_host", "as_int64"]
