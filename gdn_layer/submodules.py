"""Which submodule weights ``GatedDeltaNet`` may read directly, and how it honours what wraps them.

The layer reads ``conv1d.weight`` itself (its causal conv restarts at packed boundaries and hands states
on, which ``nn.Conv1d.forward`` cannot), so anything that acts through ``conv1d``'s forward would be
skipped: a PEFT-style wrapper replacing the module (LoRA), a forward hook, a replaced ``forward``.
Those raise, naming ``conv1d``, instead of being ignored. accelerate's hooks (``module._hf_hook``: CPU /
disk offload, device alignment) are honoured: the weight is read between the hook's ``pre_forward``
(which restores it) and ``post_forward`` (which may offload it again), as transformers'
``force_accelerate_hooks`` does for its own block. The projections, ``norm`` and ``out_proj`` are
called as modules whenever anything wraps them (``in_projection.plain_linear``), so their hooks run as usual.
Global module hooks (``torch.nn.modules.module.register_module_forward_hook``) are not checked: they
do not see ``conv1d`` run.
"""
from __future__ import annotations

import torch
from torch import nn


def check_conv1d(conv: nn.Module) -> None:
    """ValueError naming ``conv1d`` when something would act through its forward, which the layer skips."""
    fix = ("GatedDeltaNet reads conv1d.weight directly for its causal conv (packed boundaries, states), so "
           "it would be silently ignored: merge the change into conv1d.weight (e.g. peft's merge_and_unload), "
           "or leave conv1d out of the adapter's target modules")
    if type(conv) is not nn.Conv1d:
        raise ValueError(f"conv1d is a {type(conv).__name__}, not a plain torch.nn.Conv1d (a LoRA / PEFT or other "
                         f"wrapper?): {fix}")
    if conv._forward_hooks or conv._forward_pre_hooks or conv._backward_hooks or conv._backward_pre_hooks:
        raise ValueError(f"conv1d has forward or backward hooks, which would never fire: {fix}")
    if "forward" in conv.__dict__ and getattr(conv, "_hf_hook", None) is None:
        raise ValueError(f"conv1d.forward was replaced on the instance: {fix}")


def conv_weight(conv: nn.Conv1d) -> torch.Tensor:
    """``conv.weight``, restored first by an accelerate hook if ``conv`` has one (and given back to it
    after: the tensor returned stays valid, the module's parameter may go back to ``meta``)."""
    hook = getattr(conv, "_hf_hook", None)
    if hook is None:
        return conv.weight
    hook.pre_forward(conv)
    weight = conv.weight
    hook.post_forward(conv, ())
    return weight


def unhooked(m: nn.Module) -> bool:
    """Whether ``m`` has no forward or backward hook of its own and no global module hook is registered: a call
    that reads ``m``'s weights without calling it (a fused GEMM, a CUDA graph replay) skips nothing then."""
    g = nn.modules.module
    return not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
                or g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
                or g._global_backward_pre_hooks)
