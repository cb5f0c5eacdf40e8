"""The swapped block's side of transformers' linear-attention cache, for transformers 5.24 and 5.25.

The one place that knows how transformers stores a GatedDeltaNet layer's state (``cache_utils``'s
``LinearAttentionLayer``), so a change there is met here and nowhere else:

- conv state: transformers keeps conv *inputs* ``[B, conv_dim, L]``, ``L >= W`` (``W`` while not
  recording; the whole history while recording for speculative decoding); the block reads the last ``W - 1``
  (the oldest of ``W`` is never read by a width-W causal conv, so the adapter stores it as zero).
- recurrent state: ``[B, Hv, Dk, Dv]`` (fp32, or fp64 for an fp64 model).
- 5.25 counts the tokens a linear layer has seen (``get_seq_length``, from which the model derives the
  positions of the next tokens) by the length of the conv inputs handed to ``update_conv_state``; the
  adapter hands it only the inputs the cache can ever read back, and adds the rest to the count.
- 5.25's speculative decoding (``activate_past_recording(recurrent_states_to_keep=n)``,
  ``get_recurrent_states_to_keep``): the block hands a *list* of the states after each of the last ``n``
  tokens to ``update_recurrent_state``, and ``crop(-j)`` rolls back to the state after token ``T - j``
  (the conv inputs by slicing the recorded history, the recurrent state from the list).

``TESTED`` is the range of transformers versions the adapter is tested under; ``warn_if_untested`` warns
once per process outside it (``hf_blocks.verify`` also checks a cached decode step against the block).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from gdn_layer.hf_blocks import TESTED, TESTED_TEXT
from gdn_layer.state import GDNState

_warned = False


def warn_if_untested() -> bool:
    """Warn once per process when the installed transformers is outside ``TESTED``; True if it is inside."""
    global _warned
    import transformers
    from packaging.version import Version     # a dependency of transformers
    inside = TESTED[0] <= Version(transformers.__version__).release[:2] < TESTED[1]
    if not inside and not _warned:
        _warned = True
        warnings.warn(f"gdn_layer.hf is tested with transformers {TESTED_TEXT}, but {transformers.__version__} is "
                      "installed: each swapped block is checked against the transformers block on a forward and a "
                      "cached decode step, and refused if they differ (a changed cache interface), but paths the "
                      "check does not run are untested", stacklevel=3)
    return inside


def states_to_keep(cache, layer_idx: int, length: int) -> int:
    """How many states after single tokens to hand the cache from a call of ``length`` tokens: 0 unless it
    records for speculative decoding (5.25), else one more than ``get_recurrent_states_to_keep`` (at most
    ``length``).

    One more than transformers' own block keeps: a verify call runs the ``k`` drafts plus the token before
    them, and when all ``k`` drafts are rejected, ``crop(-k)`` must restore the state after that first token;
    with only ``k`` states kept, transformers 5.25's block restores the state from before the call, and its
    assisted / prompt-lookup decoding then departs from plain greedy decoding (docs/layer.md)."""
    ask = getattr(cache, "get_recurrent_states_to_keep", None)
    keep = int(ask(layer_idx) or 0) if ask is not None else 0
    return min(keep + 1, length) if keep else 0


def read(cache, layer_idx: int, kernel_size: int, dtype: torch.dtype) -> GDNState | None:
    """The ``GDNState`` (in ``dtype``) the cache holds for layer ``layer_idx``, or None before its first call.
    A recorded conv history shorter than ``W - 1`` inputs (a short first call while recording) is
    left-padded with zeros, as transformers' conv pads it."""
    conv, rec = cache.get_conv_state(layer_idx), cache.get_recurrent_state(layer_idx)
    if conv is None or rec is None:
        return None
    keep = kernel_size - 1
    conv = conv[..., max(conv.shape[-1] - keep, 0):]
    if conv.shape[-1] < keep:
        conv = F.pad(conv, (keep - conv.shape[-1], 0))
    return GDNState(conv.to(dtype), rec.to(dtype))


def write(cache, layer_idx: int, states: list[GDNState], length: int, kernel_size: int,
          activation_dtype: torch.dtype) -> None:
    """Store the states of a call of ``length`` tokens as transformers' own block would.

    ``states``: ``[final]`` when ``states_to_keep`` was 0; else ``n + 1`` states: after token ``length - n``
    (the state before the call when ``n == length``), then after each of the last ``n`` tokens.
    """
    n = len(states) - 1
    recording = cache.is_recording_past(layer_idx) if hasattr(cache, "is_recording_past") else False
    # conv inputs of the last W - 1 + n tokens: the first state's W - 1, then the newest input of each later one
    columns = torch.cat([states[0].conv_state] + [s.conv_state[..., -1:] for s in states[1:]], -1)
    if recording:   # only the inputs of this call; the cache appends them to its history
        handed = columns[..., max(columns.shape[-1] - length, 0):]
    else:           # the W the cache keeps: the oldest is never read
        handed = F.pad(columns[..., columns.shape[-1] - (kernel_size - 1):], (1, 0))
    cache.update_conv_state(handed.to(activation_dtype), layer_idx, conv_kernel_size=kernel_size)
    _count(cache, layer_idx, length - handed.shape[-1])
    cache.update_recurrent_state(states[-1].recurrent_state if n == 0 else [s.recurrent_state for s in states[1:]],
                                 layer_idx)


def _count(cache, layer_idx: int, tokens: int) -> None:
    """Add ``tokens`` to the count of tokens a linear layer has seen (transformers >= 5.25 counts the conv
    inputs handed to ``update_conv_state``; 5.24 counts nothing there)."""
    counter = getattr(getattr(cache, "layers", [None] * (layer_idx + 1))[layer_idx], "cumulative_length_linear", None)
    if tokens and isinstance(counter, torch.Tensor):
        counter.add_(tokens)
