"""Elementwise helpers shared by the Triton kernels, written with portable ``tl`` ops only.

Rounding to bfloat16 is spelled out (``rne``) rather than left to ``.to(tl.bfloat16)``: Triton's
interpreter truncates on that cast (it keeps bf16 as raw uint16 bits) while GPUs and torch round to
nearest even, so the CPU tests would see a biased bf16 path that no device runs. With ``rne`` every
backend, the interpreter included, rounds exactly as torch does.

No libdevice / CUDA-only intrinsics (the kernels must carry to triton-ascend and run under
``TRITON_INTERPRET=1``); both branches of every ``tl.where`` are finite, so the interpreter's numpy
raises no warnings and the compiled code produces no NaN that a ``where`` would have to hide.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
}


def tl_dtype(dtype: torch.dtype):
    """The ``tl`` dtype of a torch floating dtype (passed to kernels as a ``tl.constexpr``)."""
    return _TL_DTYPES[dtype]


def compute_tl_dtype(*tensors: torch.Tensor):
    """``tl.float64`` if any tensor is float64, else ``tl.float32`` (the reference's compute dtype)."""
    return tl.float64 if any(t.dtype == torch.float64 for t in tensors) else tl.float32


@triton.jit
def sigmoid(x):
    """``1 / (1 + exp(-x))`` without overflow: ``exp`` only ever sees ``-|x|``. One division (``e / (1 + e)``
    for x < 0 as ``e * (1 / (1 + e))``, within an ulp of it): the gated norm is bound by its instructions."""
    e = tl.exp(-tl.abs(x))
    r = 1.0 / (1.0 + e)
    return tl.where(x >= 0, r, e * r)


@triton.jit
def softplus(x):
    """``log(1 + exp(x))`` with torch's threshold (``x`` itself for ``x > 20``).

    ``max(x, 0) + log1p(exp(-|x|))``; there is no portable ``log1p``, so it is
    ``log(u) * e / (u - 1)`` with ``u = 1 + e`` (Goldberg's trick: exact to a few ulp, where
    ``log(1 + e)`` would return 0 for ``e`` below half an ulp of 1, i.e. ``x < -17`` in fp32).
    """
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    exact = u == 1.0
    log1p = tl.where(exact, e, tl.log(u) * (e / tl.where(exact, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)


@triton.jit
def rne(x, DTYPE: tl.constexpr):
    """``x`` (fp32 or float64) rounded to nearest-even in ``DTYPE``, kept in x's dtype."""
    if DTYPE == tl.bfloat16:
        # add 0x7FFF plus the lowest kept bit, then drop the low 16 bits: ties go to even
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(x.dtype)
    else:
        return x.to(DTYPE).to(x.dtype)


@triton.jit
def rne_by(x, DTYPE: tl.constexpr, HW: tl.constexpr):
    """``rne(x, DTYPE)``; with ``HW``, by the device's own conversion and back (``cvt.rn`` on CUDA: one
    instruction each way, where ``rne``'s bit arithmetic for bfloat16 takes four or five). Launchers set
    ``HW`` for CUDA tensors only: the interpreter truncates on that cast, and other devices' rounding is
    not checked."""
    if HW:
        return x.to(DTYPE).to(x.dtype)
    else:
        return rne(x, DTYPE)


@triton.jit
def cast_rne(x, DTYPE: tl.constexpr):
    """``x`` converted to ``DTYPE`` with round-to-nearest-even (exact after ``rne``, whatever the cast mode)."""
    return rne(x, DTYPE).to(DTYPE)
