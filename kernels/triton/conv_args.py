"""Argument preparation of the conv's launchers (``conv.py``): the math dtype, each packed token's sequence
index (cached per ``cu``), strides, 32-bit offsets and the whole-or-parts arguments of ``conv_tiles.py``'s
``_load_parts`` / ``_store_parts``.
"""
from __future__ import annotations

import torch

from .. import cu_cache
from ._layout import narrow_offsets


def _compute_dtype(*tensors):
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _seq_index(cu, T):
    """Per-token sequence index of a pack (the last n with cu[n] <= t: empty segments are skipped), on
    device; computed once per ``cu`` tensor and T (``cu_cache``), shared by the forward and backward
    of every conv that sees this pack."""
    if cu is None:
        return None
    return cu_cache.derived(cu, ("conv_seq_index", T), lambda: torch.searchsorted(
        cu, torch.arange(T, device=cu.device, dtype=cu.dtype), right=True, out_int32=True) - 1)


def _strides3(t):
    return (0, 0, 0) if t is None else t.stride()


def _narrow_params(weight, bias, initial_state):
    """``weight [C, W]``, ``bias [C]``, ``initial_state [N, C, W - 1]`` through ``narrow_offsets`` (the
    kernels' channel and tap offsets are 32-bit)."""
    return narrow_offsets(weight, (0, 1)), narrow_offsets(bias, (0,)), narrow_offsets(initial_state, (1, 2))


def _as_parts(whole_or_parts, C):
    """``(args, PARTS)``: the ``_load_parts`` / ``_store_parts`` arguments ``(p0, p1, p2, e0, e1, *strides of
    the three)`` for a ``[B, T, C]`` tensor given whole (``PARTS`` 1) or as a list of 1-3 ``[B, T, w]`` parts
    with widths summing to C (``PARTS`` 3). An empty part takes another's pointer (never read: its columns
    are empty)."""
    if isinstance(whole_or_parts, torch.Tensor):
        t = whole_or_parts
        return (t, t, t, C, C, *t.stride(), *t.stride(), *t.stride()), 1
    parts = list(whole_or_parts)
    widths = [p.shape[-1] for p in parts] + [0] * (3 - len(parts))
    held = next((p for p in parts if p.numel() > 0), parts[0])   # (all empty: T = 0, only the state's pass runs)
    parts = [p if p.numel() > 0 else held for p in parts] + [held] * (3 - len(parts))
    e0, e1 = widths[0], widths[0] + widths[1]
    return (*parts, e0, e1, *(st for p in parts for st in p.stride())), 3


def _heads(t, D):
    """``[B, T, C]`` as ``[B, T, C // D, D]`` (a view)."""
    return t.unflatten(-1, (-1, D))
