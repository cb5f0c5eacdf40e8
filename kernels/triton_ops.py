"""Our Triton kernels (``kernels/triton/``) behind the registry's call signatures, imported lazily.

Shared by the CUDA backends (``"fla"``, ``"flash_qla"``) and the Ascend one: conv, gate, gated RMSNorm
and the q/k L2 norm never go through fla's modules (which re-autotune on length buckets). Imported
lazily so that ``gdn_layer.kernels`` imports where Triton does not.

The stride rule, in this one place for every Triton kernel: the public ops take tensors of any strides
(docs/kernels.md, "Strides"). A kernel reads its inputs in place through their strides on every dim but
the last, which must be unit-stride: ``_unit_last`` copies a tensor whose last dim is not (a transposed
``[B, H, T]`` buffer viewed as ``[B, T, H]``, an expanded gradient) and passes every other one as is.
"""
from __future__ import annotations


def _unit_last(*tensors):
    """Each tensor as is when its last dim is unit-stride (or has one element), else a contiguous copy;
    None passes through."""
    out = tuple(t if t is None or t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()
                for t in tensors)
    return out if len(out) > 1 else out[0]


def l2norm_fwd(x):
    from .triton.l2norm import l2norm_fwd as f
    return f(_unit_last(x))


def l2norm_bwd(x, dy):
    from .triton.l2norm import l2norm_bwd as f
    return f(*_unit_last(x, dy))


def gate_fwd(a, b, A_log, dt_bias):
    from .triton.gate import gdn_gate_fwd
    return gdn_gate_fwd(*_unit_last(a, b, A_log, dt_bias))


def gate_bwd(dg, dbeta, a, b, A_log, dt_bias):
    from .triton.gate import gdn_gate_bwd
    return gdn_gate_bwd(*_unit_last(dg, dbeta, a, b, A_log, dt_bias))


def norm_fwd(x, z, weight, eps=1e-6):
    from .triton.norm import gated_rms_norm_fwd
    return gated_rms_norm_fwd(*_unit_last(x, z, weight), eps)[0]


def norm_bwd(dy, x, z, weight, eps=1e-6):
    from .triton.norm import gated_rms_norm_bwd
    return gated_rms_norm_bwd(*_unit_last(dy, x, z, weight), None, eps)


def conv_fwd(x, weight, bias=None, activation="silu", cu=None, initial_state=None, output_final_state=False):
    from .triton.conv import causal_conv1d_fwd
    return causal_conv1d_fwd(x, weight, bias, cu, initial_state, activation, output_final_state)


def conv_bwd(dy, dfinal, x, weight, bias=None, activation="silu", cu=None, initial_state=None):
    from .triton.conv import causal_conv1d_bwd
    return causal_conv1d_bwd(dy, dfinal, x, weight, bias, cu, initial_state, activation)
