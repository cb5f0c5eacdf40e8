"""The stride rule of our Triton launchers, in one place (docs/kernels.md, "Strides").

A kernel reads its inputs in place through their strides on every dim but the last, which must be
unit-stride: ``unit_last`` passes a tensor whose last dim is (or has one element) as it is and copies
any other (a transposed ``[B, H, T]`` buffer read as ``[B, T, H]``, an expanded gradient). Every
launcher calls it on what it reads, so every caller (the registry's ops through ``kernels/triton_ops.py``,
the modules' own autograd functions) gets the same rule. The conv, which reads any strides, has one
rule of its own: ``narrow_offsets``.
"""
from __future__ import annotations

import torch


def unit_last(*tensors):
    """Each tensor as is when its last dim is unit-stride (or has at most one element), else a contiguous
    copy; None passes through. One tensor in, one out; several in, a tuple out."""
    out = tuple(t if t is None or t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()
                for t in tensors)
    return out if len(out) > 1 else out[0]


# Offsets along a kernel's channel (or tap) dim are 32-bit where it computes them from a 32-bit index
# (the conv's c * channel stride, k * tap stride; its token, batch and sequence offsets are int64).
OFFSET_LIMIT = 2 ** 31


def narrow_offsets(t, dims=(-1,)):
    """``t`` (None stays None), or ``t.contiguous()`` where ``(size - 1) * |stride|`` of one of ``dims``
    reaches ``OFFSET_LIMIT``: a layout that puts the last channel 2**31 elements or more from the first
    (a channel-major x with T * C past 2**31, a state laid out channel-outermost for very many sequences)
    comes as a contiguous copy; every other layout is read in place."""
    if t is not None and any((t.shape[d] - 1) * abs(t.stride(d)) >= OFFSET_LIMIT for d in dims if t.shape[d]):
        return t.contiguous()
    return t


def row_strides(t, dims: int) -> tuple:
    """The strides of t's first ``dims`` dims (those that address a row: B, T[, H]), B's as 0 when B == 1
    (only row 0 is read then, so its stride neither matters nor depends on T)."""
    return ((0 if t.shape[0] == 1 else t.stride(0)), *t.stride()[1:dims])


def rows_align(tensors, dims: int) -> int:
    """``row_align`` over the ``row_strides`` of every tensor (same element size): the kernels' row hint."""
    return row_align(tensors[0].element_size(), *(s for t in tensors for s in row_strides(t, dims)))


def row_align(element_size: int, *strides: int) -> int:
    """The largest power of 2 elements, at most 16 bytes' worth, that divides every stride (0 divides by
    all): rows that start a multiple of it apart can be read as vectors of that many elements. A kernel
    takes it as a ``tl.constexpr`` row hint (``tl.multiple_of``) where its strides are runtime arguments;
    computed from strides that no token count changes, it compiles nothing new per packed length."""
    align = max(1, 16 // element_size)
    while align > 1 and any(s % align for s in strides):
        align //= 2
    return align


def out_buffer(out, like, name: str):
    """An output of ``like``'s shape, dtype and device: a new contiguous one for ``out=None``, else ``out`` itself
    (a caller's buffer, e.g. a column slice of a wider gradient: any strides but a unit-stride last dim), checked.

    Raises:
        ValueError: ``out`` (named ``name``) of another shape, dtype or device, or with a strided last dim.
    """
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if (out.shape != like.shape or out.dtype != like.dtype or out.device != like.device
            or (out.shape[-1] > 1 and out.stride(-1) != 1)):
        raise ValueError(f"{name} must be {tuple(like.shape)} in {like.dtype} on {like.device} with a unit-stride "
                         f"last dim, got {tuple(out.shape)} in {out.dtype} on {out.device} with strides {out.stride()}")
    return out
