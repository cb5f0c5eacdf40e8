"""The stride rule of our Triton launchers, in one place (docs/kernels.md, "Strides").

A kernel reads its inputs in place through their strides on every dim but the last, which must be
unit-stride: ``unit_last`` passes a tensor whose last dim is (or has one element) as it is and copies
any other (a transposed ``[B, H, T]`` buffer read as ``[B, T, H]``, an expanded gradient). Every
launcher calls it on what it reads, so every caller (the registry's ops through ``kernels/triton_ops.py``,
the modules' own autograd functions) gets the same rule.
"""
from __future__ import annotations


def unit_last(*tensors):
    """Each tensor as is when its last dim is unit-stride (or has at most one element), else a contiguous
    copy; None passes through. One tensor in, one out; several in, a tuple out."""
    out = tuple(t if t is None or t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()
                for t in tensors)
    return out if len(out) > 1 else out[0]
