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


def recording(cache, layer_idx: int) -> bool:
    """Whether the cache records this layer's states for a later ``crop`` (speculative decoding, 5.25: a
    list of recurrent states is taken only where ``get_recurrent_states_to_keep`` exists)."""
    return (hasattr(cache, "get_recurrent_states_to_keep") and hasattr(cache, "is_recording_past")
            and bool(cache.is_recording_past(layer_idx)))


def states_to_keep(cache, layer_idx: int, length: int) -> int:
    """How many of a call's last tokens to run one at a time, so that the state after each is known: 0 unless
    the cache records (``recording``), else one more than ``get_recurrent_states_to_keep`` (at most ``length``).

    One more than transformers' own block keeps: a verify call runs the ``k`` drafts plus the token before
    them, and when all ``k`` drafts are rejected, ``crop(-k)`` must restore the state after that first token;
    with only ``k`` states kept, transformers 5.25's block restores the state from before the call, and its
    assisted / prompt-lookup decoding then departs from plain greedy decoding (docs/layer.md)."""
    if not recording(cache, layer_idx):
        return 0
    return min(int(cache.get_recurrent_states_to_keep(layer_idx) or 0) + 1, length)


def read(cache, layer_idx: int, kernel_size: int, dtype: torch.dtype, copy: bool = False) -> GDNState | None:
    """The ``GDNState`` (in ``dtype``) the cache holds for layer ``layer_idx``, or None before its first call.
    A recorded conv history shorter than ``W - 1`` inputs (a short first call while recording) is
    left-padded with zeros, as transformers' conv pads it. ``copy``: tensors of their own, never views of the
    cache's (for a caller that updates them in place).

    Raises:
        ValueError: the cache was rolled back to a token whose state was not recorded (``write``).
    """
    conv, rec = cache.get_conv_state(layer_idx), cache.get_recurrent_state(layer_idx)
    if conv is None or rec is None:
        return None
    if getattr(rec, _UNRECORDED, False):
        raise ValueError(
            f"the cache of layer {layer_idx} was rolled back (crop) further than the states recorded for speculative "
            f"decoding reach: transformers asked each call to keep {cache.get_recurrent_states_to_keep(layer_idx)} "
            f"states (activate_past_recording(recurrent_states_to_keep=k)), and the swapped block keeps k + 1; the "
            f"state at the token rolled back to was never computed (transformers' own block raises IndexError "
            f"here). Record at least as many states as tokens are rolled back")
    keep = kernel_size - 1
    conv = conv[..., max(conv.shape[-1] - keep, 0):]
    if conv.shape[-1] < keep:
        conv = F.pad(conv, (keep - conv.shape[-1], 0))
    return GDNState(conv.to(dtype, copy=copy), rec.to(dtype, copy=copy))


# attribute of the stand-in recurrent state for a token whose state a recorded call did not compute
_UNRECORDED = "_gdn_layer_unrecorded"


def write(cache, layer_idx: int, states: list[GDNState], length: int, kernel_size: int,
          activation_dtype: torch.dtype) -> None:
    """Store the states of a call of ``length`` tokens as transformers' own block would.

    ``states``: ``[final]`` when ``states_to_keep`` was 0; else ``n + 1`` states: after token ``length - n``
    (the state before the call when ``n == length``), then after each of the last ``n`` tokens. A recording
    cache gets one recurrent state per token of the call, as ``crop(-j)`` indexes them: the states of tokens
    before ``length - n`` are one shared stand-in (NaN, marked) that ``read`` refuses if a rollback restores it;
    and all ``length`` conv inputs (those never read again as zeros), so ``crop`` slices the history right.
    """
    n = len(states) - 1
    recording_ = n > 0 or recording(cache, layer_idx)
    # conv inputs of the last W - 1 + n tokens: the first state's W - 1, then the newest input of each later one
    columns = torch.cat([states[0].conv_state] + [s.conv_state[..., -1:] for s in states[1:]], -1)
    if recording_:   # this call's inputs, one per token; the cache appends them to its history
        known = columns[..., max(columns.shape[-1] - length, 0):]
        handed = F.pad(known, (length - known.shape[-1], 0))
    else:            # the W the cache keeps: the oldest is never read
        handed = F.pad(columns[..., columns.shape[-1] - (kernel_size - 1):], (1, 0))
    cache.update_conv_state(handed.to(activation_dtype), layer_idx, conv_kernel_size=kernel_size)
    _count(cache, layer_idx, length - handed.shape[-1])
    if n == 0:
        cache.update_recurrent_state(states[-1].recurrent_state, layer_idx)
        return
    recorded = [s.recurrent_state for s in (states[1:] if n == length else states)]
    if len(recorded) < length:
        stand_in = torch.full_like(recorded[0], float("nan"))
        setattr(stand_in, _UNRECORDED, True)
        recorded = [stand_in] * (length - len(recorded)) + recorded
    cache.update_recurrent_state(recorded, layer_idx)


def _count(cache, layer_idx: int, tokens: int) -> None:
    """Add ``tokens`` to the count of tokens a linear layer has seen (transformers >= 5.25 counts the conv
    inputs handed to ``update_conv_state``; 5.24 counts nothing there)."""
    counter = getattr(cache.layers[layer_idx], "cumulative_length_linear", None)    # (5.24's layers have none)
    if tokens and isinstance(counter, torch.Tensor):
        counter.add_(tokens)
