"""transformers adapter: build a GatedDeltaNet from a transformers block, or swap every block of a model.

Tested against transformers 5.24 (the ``hf`` extra pins ``>=5.24,<5.25``): Qwen3-Next
(``Qwen3NextGatedDeltaNet``, fused projections) and Qwen3.5 (``Qwen3_5GatedDeltaNet``, split projections).
The swapped block keeps the transformers forward signature ``(hidden_states, cache=None,
attention_mask=None, **kwargs)`` and reads/writes the model's own cache object through its public
linear-attention methods (``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``,
``update_recurrent_state``). transformers keeps W conv inputs per sequence where ``GDNState`` keeps W-1;
the oldest of transformers' W is never read by its conv, so the adapter stores it as zero.
Speculative decoding's past recording (``cache.activate_past_recording``) is not supported.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gdn_layer.layer import GatedDeltaNet
from gdn_layer.state import GDNState


def _hf_sizes(hf_module: nn.Module) -> dict:
    """Constructor arguments of a transformers GatedDeltaNet block, read from its attributes."""
    if hasattr(hf_module, "in_proj_qkvz"):
        layout = "fused"
    elif hasattr(hf_module, "in_proj_qkv"):
        layout = "split"
    else:
        raise TypeError(f"hf_module must be a transformers GatedDeltaNet block (with in_proj_qkvz or "
                        f"in_proj_qkv), got {type(hf_module).__name__}")
    return dict(hidden_size=hf_module.hidden_size, num_k_heads=hf_module.num_k_heads,
                num_v_heads=hf_module.num_v_heads, head_k_dim=hf_module.head_k_dim,
                head_v_dim=hf_module.head_v_dim, conv_kernel_size=hf_module.conv_kernel_size,
                norm_eps=hf_module.layer_norm_epsilon, projection_layout=layout)


def _build(cls, hf_module: nn.Module, sp_group, backend):
    sizes = _hf_sizes(hf_module)
    activation = getattr(hf_module, "activation", "silu")
    if activation not in ("silu", "swish"):
        raise ValueError(f"only the SiLU conv activation is supported, hf_module uses {activation!r}")
    p = hf_module.out_proj.weight
    layer = cls(**sizes, sp_group=sp_group, backend=backend, device=p.device, dtype=p.dtype)
    layer.load_state_dict(hf_module.state_dict(), strict=True)
    return layer


def from_hf(hf_module: nn.Module, sp_group=None, backend: str = "auto") -> GatedDeltaNet:
    """A ``GatedDeltaNet`` with the sizes and a copy of the weights of a transformers block.

    Raises:
        TypeError: ``hf_module`` is not a transformers GatedDeltaNet block.
    """
    return _build(GatedDeltaNet, hf_module, sp_group, backend)


class HFGatedDeltaNet(GatedDeltaNet):
    """A ``GatedDeltaNet`` that speaks transformers' block interface (used by ``swap_gated_deltanet``).

    ``forward(hidden_states [B, T, hidden], cache=None, attention_mask=None, **kwargs) -> [B, T, hidden]``.
    ``attention_mask [B, T]`` (1 = token, 0 = padding) zeroes padded inputs as transformers does;
    ``cu_seq_lens_q`` in kwargs (transformers' packed-batch convention) becomes ``cu_seqlens``.
    """

    layer_idx: int = 0

    def forward(self, hidden_states, cache=None, attention_mask=None, cu_seqlens=None, **kwargs):
        cache = kwargs.pop("cache_params", cache)
        cu_seqlens = kwargs.pop("cu_seq_lens_q", cu_seqlens)
        if attention_mask is not None and attention_mask.dim() == 2:
            hidden_states = (hidden_states * attention_mask[:, -hidden_states.shape[1]:, None]).to(hidden_states.dtype)
        if cache is None:
            return super().forward(hidden_states, cu_seqlens=cu_seqlens)
        conv, rec = cache.get_conv_state(self.layer_idx), cache.get_recurrent_state(self.layer_idx)
        state = None
        if conv is not None and rec is not None:
            state = GDNState(conv[..., conv.shape[-1] - (self.conv_kernel_size - 1):].float(), rec.float())
        y, new = super().forward(hidden_states, cu_seqlens=cu_seqlens, state=state, output_state=True)
        cache.update_conv_state(F.pad(new.conv_state, (1, 0)).to(hidden_states.dtype), self.layer_idx,
                                conv_kernel_size=self.conv_kernel_size)
        cache.update_recurrent_state(new.recurrent_state, self.layer_idx)
        return y


def swap_gated_deltanet(model: nn.Module, sp_group=None, backend: str = "auto") -> int:
    """Replace every transformers GatedDeltaNet block in ``model`` by an ``HFGatedDeltaNet`` in place.

    Weights are copied, parameter names are unchanged (checkpoints still load), and the model's own
    cache object and forward signature keep working. Returns the number of blocks replaced.
    """
    targets = [(name, m) for name, m in model.named_modules()
               if type(m).__name__.endswith("GatedDeltaNet") and type(m).__module__.startswith("transformers.")]
    for name, m in targets:
        new = _build(HFGatedDeltaNet, m, sp_group, backend)
        new.layer_idx = m.layer_idx
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, name.rpartition(".")[2], new)
    return len(targets)
