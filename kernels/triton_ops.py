"""Our Triton kernels (``kernels/triton/``) behind the registry's call signatures, imported lazily.

Shared by the CUDA backends (``"fla"``, ``"flash_qla"``) and the Ascend one: conv, gate, gated RMSNorm
and the q/k L2 norm never go through fla's modules (which re-autotune on length buckets). Imported
lazily so that ``gdn_layer.kernels`` imports where Triton does not.

The public ops take tensors of any strides (docs/kernels.md, "Strides"): every launcher applies the
one stride rule itself (``triton/_layout.py``), so nothing is copied here.
"""
from __future__ import annotations


def l2norm_qk_fwd(q, k):
    from .triton.l2norm import l2norm_pair_fwd
    return l2norm_pair_fwd(q, k)


def l2norm_qk_bwd(q, k, dq, dk):
    from .triton.l2norm import l2norm_pair_bwd
    return l2norm_pair_bwd(q, dq, k, dk)


def gate_fwd(a, b, A_log, dt_bias):
    from .triton.gate import gdn_gate_fwd
    return gdn_gate_fwd(a, b, A_log, dt_bias)


def gate_bwd(dg, dbeta, a, b, A_log, dt_bias, da=None, db=None):
    from .triton.gate import gdn_gate_bwd
    return gdn_gate_bwd(dg, dbeta, a, b, A_log, dt_bias, da, db)


def norm_fwd(x, z, weight, eps=1e-6):
    from .triton.norm import gated_rms_norm_fwd
    return gated_rms_norm_fwd(x, z, weight, eps)[0]


def norm_bwd(dy, x, z, weight, eps=1e-6):
    from .triton.norm import gated_rms_norm_bwd
    return gated_rms_norm_bwd(dy, x, z, weight, None, eps)


def conv_fwd(x, weight, bias=None, activation="silu", cu=None, initial_state=None, output_final_state=False,
             split_sizes=None, l2norm_dim=0):
    from .triton.conv import causal_conv1d_fwd
    return causal_conv1d_fwd(x, weight, bias, cu, initial_state, activation, output_final_state, split_sizes,
                             l2norm_dim)


def conv_bwd(dy, dfinal, x, weight, bias=None, activation="silu", cu=None, initial_state=None, dx=None,
             l2norm_out=None):
    from .triton.conv import causal_conv1d_bwd
    return causal_conv1d_bwd(dy, dfinal, x, weight, bias, cu, initial_state, activation, dx, l2norm_out)
