"""The recurrent cache of a GatedDeltaNet layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def autograd_records(x, params) -> bool:
    """Whether autograd records a call on ``x`` with ``params``: grad mode on and ``x`` or a parameter requires
    grad (a state pool, updated in place, refuses such calls; inference-only shortcuts skip them)."""
    return torch.is_grad_enabled() and (getattr(x, "requires_grad", False) or any(p.requires_grad for p in params))


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """The states' dtype for activations (or weights) of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class GDNState:
    """State of a GatedDeltaNet layer after a sequence (or a pack of N sequences).

    Attributes:
        conv_state: ``[N, conv_dim, W - 1]`` float32: the last W-1 pre-conv inputs of each sequence,
            channels in ``[q_all | k_all | v_all]`` order (``conv_dim = 2*Hk*Dk + Hv*Dv``), oldest first.
        recurrent_state: ``[N, Hv, Dk, Dv]`` float32: the delta-rule state ``S`` of each sequence.

    Both are always the FULL state (all heads), also under sequence parallelism. ``torch.save(state, f)``
    and ``torch.load(f)`` (weights-only, torch's default) round-trip it: importing ``gdn_layer`` registers
    the class with ``torch.serialization.add_safe_globals``.
    """
    conv_state: torch.Tensor
    recurrent_state: torch.Tensor

    @property
    def num_sequences(self) -> int:
        return self.recurrent_state.shape[0]

    def detach(self) -> "GDNState":
        """A copy cut from the autograd graph (for carrying a cache across training steps)."""
        return GDNState(self.conv_state.detach(), self.recurrent_state.detach())


# torch.load's default (weights_only=True) refuses classes it does not know; a GDNState holds only two
# tensors, so allow it: a saved cache loads back without weights_only=False.
torch.serialization.add_safe_globals([GDNState])


def check_state(state, num_sequences: int, conv_dim: int, kernel_size: int, num_v_heads: int,
                head_k_dim: int, head_v_dim: int, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """Raise TypeError / ValueError naming ``state`` unless it fits the layer and the batch.

    ``dtype`` (the activations' dtype): the state must be float64 with float64 activations, else
    float32 (whatever the activation dtype: the recurrence accumulates in fp32). None accepts either."""
    if not isinstance(state, GDNState):
        raise TypeError(f"state must be a GDNState, got {type(state).__name__}")
    for name in ("conv_state", "recurrent_state"):
        if not isinstance(getattr(state, name), torch.Tensor):
            raise TypeError(f"state.{name} must be a torch.Tensor, got {type(getattr(state, name)).__name__}")
    n_is = "N = number of sequences in this batch: B without cu_seqlens, len(cu_seqlens) - 1 with it"
    want_conv = (num_sequences, conv_dim, kernel_size - 1)
    want_rec = (num_sequences, num_v_heads, head_k_dim, head_v_dim)
    if tuple(state.conv_state.shape) != want_conv:
        raise ValueError(f"state.conv_state must be [N, conv_dim, W-1] = {want_conv} ({n_is}), "
                         f"got {tuple(state.conv_state.shape)}")
    if tuple(state.recurrent_state.shape) != want_rec:
        raise ValueError(f"state.recurrent_state must be [N, Hv, Dk, Dv] = {want_rec} ({n_is}), "
                         f"got {tuple(state.recurrent_state.shape)}")
    for name, t in (("conv_state", state.conv_state), ("recurrent_state", state.recurrent_state)):
        if dtype is None and t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"state.{name} must be float32 (float64 with float64 activations), got {t.dtype}")
        want = state_dtype(dtype)
        if dtype is not None and t.dtype != want:
            raise TypeError(f"state.{name} must be {want} with {dtype} activations "
                            f"(float32 unless the activations are float64), got {t.dtype}")
        if t.device != device:
            raise ValueError(f"state.{name} is on {t.device} but hidden_states is on {device}")


def state_for_autograd(state: "GDNState | None") -> "GDNState | None":
    """``state`` as it may enter a computation autograd records: a state made under
    ``torch.inference_mode`` (an eval or prefill pass) holds inference tensors, which autograd cannot
    save, so outside inference mode they are copied (the same on every rank: no rank fails alone later,
    deep in a collective). Any other state, and every state under inference mode or a trace, as is."""
    if state is None or torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
        return state
    if not (state.conv_state.is_inference() or state.recurrent_state.is_inference()):
        return state
    return GDNState(state.conv_state.clone(), state.recurrent_state.clone())
