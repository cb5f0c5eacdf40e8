"""How the transformers adapter finds packed sequences: when it reads ``position_ids`` / ``seq_idx`` as
boundaries, and the ``cu_seqlens`` it derives from them.

The rule follows transformers 5.24 (``masking_utils._preprocess_mask_arguments``): its attention layers
treat restarting ``position_ids`` as a packed batch only when the model got no ``attention_mask`` (none
at all: a 2-D mask, even all ones, or a custom 4-D mask turns it off) and no cache. The adapter reads
``position_ids`` under exactly those conditions, so a swapped block separates samples exactly where the
model's attention layers do; otherwise it follows the mask as transformers' own block does.
``seq_idx`` (``DataCollatorWithFlattening(return_seq_idx=True)``) is an explicit statement of packing:
read whenever there is no cache (with a cache, several sequences in a row raise).

A linear-attention block only sees the mask transformers made for it (``create_recurrent_attention_mask``:
None for a 4-D or an all-ones mask), so whether the model got a mask is recorded by a forward pre-hook on
the module that runs the decoder layers (``watch_model_inputs``) and reaches the block as a keyword
argument through transformers' ``**kwargs`` (so gradient checkpointing's recomputation sees it too).
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from gdn_layer.kernels.cu_cache import derived

MASK_GIVEN_KEY = "gdn_attention_mask_given"   # kwarg: the model's forward got an attention_mask
POSITION_KEY = "gdn_position_ids"             # kwarg: the parent layer's position_ids (pass_position_ids)


def _row_starts(ids: torch.Tensor, is_seq_idx: bool) -> torch.Tensor | None:
    """Bool ``[B, T]`` on the host, True where a sequence starts (always at t = 0), or None if every row
    is one sequence. ``seq_idx``: a new sequence where the index changes; ``position_ids``: where a
    position is not the previous one + 1 (transformers' ``find_packed_sequence_indices``)."""
    ids = ids.detach().cpu().long()
    inside = ids[:, 1:] != (ids[:, :-1] if is_seq_idx else ids[:, :-1] + 1)
    if not bool(inside.any()):
        return None
    return torch.cat([torch.ones(ids.shape[0], 1, dtype=torch.bool), inside], 1)


def _starts_to_cu(starts: torch.Tensor | None) -> torch.Tensor | None:
    """Bool ``[B, T]`` sequence starts -> the ``cu_seqlens`` of the ``B * T`` tokens as one pack."""
    if starts is None:
        return None
    return torch.cat([torch.nonzero(starts.reshape(-1))[:, 0], torch.tensor([starts.numel()])])


def check_ids(ids, name: str, batch: int, length: int) -> torch.Tensor:
    """``ids`` as an integer ``[B, T]`` tensor (a ``[1, T]`` one is expanded to the batch, as
    transformers does), or ValueError naming ``name`` and the shape wanted."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"{name} must be an integer tensor [B, T], got "
                         + (f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor)
                            else type(ids).__name__))
    if ids.shape[0] == 1 and batch > 1:  # transformers sometimes passes [1, T] for a whole batch
        ids = ids.expand(batch, -1)
    if tuple(ids.shape) != (batch, length):
        raise ValueError(f"{name} must be [B, T] = {(batch, length)} like the hidden states, "
                         f"got {tuple(ids.shape)}")
    return ids


def packed_cu_seqlens(ids: torch.Tensor, is_seq_idx: bool, batch: int, length: int) -> torch.Tensor | None:
    """``cu_seqlens`` (CPU int64 ``[N + 1]``) of all ``B`` rows of ``ids`` (``position_ids`` or
    ``seq_idx``, ``[B, T]`` or ``[1, T]``) as one pack, or None when every row is one sequence.

    Derived once per tensor (``kernels.cu_cache.derived``: identity, version and, on the CPU, values;
    keyed by ``B``, ``T`` and the kind of ids), so every layer of a forward reads the ids on the host
    once and gets one ``cu_seqlens`` tensor (what the kernels derive from it is then built once too).
    Inference tensors on an accelerator are never kept (read once per layer); CPU ones are, by value.
    """
    name = "seq_idx" if is_seq_idx else "position_ids"
    rows = check_ids(ids, name, batch, length)
    return derived(ids, ("gdn_hf_packed_cu", name, batch, length),
                   lambda: _starts_to_cu(_row_starts(rows, is_seq_idx)))


# --------------------------------------------------------------------------------------------------
# the model's inputs, recorded for its blocks


def pass_position_ids(module, args, kwargs):
    """Forward pre-hook of a layer whose GatedDeltaNet block was swapped: transformers' decoder layers
    keep ``position_ids`` for their attention and do not forward them to the linear-attention block,
    so hand them on (under another name: ``position_ids`` is the layer's own argument)."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        return None
    return args, {**kwargs, POSITION_KEY: position_ids}


def takes(module: nn.Module, *names: str) -> bool:
    """Whether ``module.forward`` has each argument in ``names`` and passes ``**kwargs`` on."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return (any(p.kind is p.VAR_KEYWORD for p in params.values())
            and all(n in params for n in names))


class ModelInputs:
    """Forward pre-hook of the module that runs the decoder layers (e.g. ``Qwen3_5TextModel``): tells
    every block below whether the model got an ``attention_mask`` (``MASK_GIVEN_KEY``), and under
    sequence / context parallelism refuses a 2-D mask that is not this rank's slice."""

    def __init__(self, parallel_size: int):
        self.parallel_size = parallel_size

    def __call__(self, module, args, kwargs):
        try:
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        except TypeError:
            return None
        mask = bound.get("attention_mask")
        if self.parallel_size > 1 and isinstance(mask, torch.Tensor) and mask.dim() == 2:
            ids = bound.get("input_ids")
            if ids is None:
                ids = bound.get("inputs_embeds")
            if ids is not None and mask.shape[-1] != ids.shape[1] and bound.get("cache") is None \
                    and bound.get("past_key_values") is None:
                # Same on every rank (shapes only). transformers keeps the LAST T_local columns of a longer
                # 2-D mask, which is rank P-1's slice: the other ranks would zero the wrong tokens.
                raise ValueError(
                    f"attention_mask [B, {mask.shape[-1]}] is longer than this rank's {ids.shape[1]} tokens: under "
                    f"sequence / context parallelism pass a 2-D attention_mask as this rank's slice of the global "
                    f"mask (columns rank*T_local:(rank+1)*T_local, like the input ids), or describe packed "
                    f"sequences by cu_seq_lens_q")
        if mask is None:
            return None
        return args, {**kwargs, MASK_GIVEN_KEY: True}


def watch_model_inputs(model: nn.Module, layer_names, parallel_size: int) -> None:
    """Register ``ModelInputs`` once on the innermost ancestor of the given decoder layers whose forward
    takes ``attention_mask`` and ``position_ids`` and passes ``**kwargs`` on."""
    done = set()
    for name in layer_names:
        parts = name.split(".")
        for i in range(len(parts) - 1, -1, -1):
            owner_name = ".".join(parts[:i])
            owner = model.get_submodule(owner_name) if owner_name else model
            if takes(owner, "attention_mask", "position_ids"):
                if id(owner) not in done and not getattr(owner, "_gdn_watches_inputs", False):
                    owner.register_forward_pre_hook(ModelInputs(parallel_size), with_kwargs=True)
                    owner._gdn_watches_inputs = True
                done.add(id(owner))
                break
