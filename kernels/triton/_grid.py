"""Launch-grid sizes shared by our kernels: no launch has more than ``MAX_PROGRAMS`` programs.

triton-ascend refuses a launch whose grid (the product over its axes) exceeds 65 535 programs
("grid should be less than 65536"); CUDA caps grid axes 1 and 2 at 65 535. So every kernel here is
persistent along its long axis: the launcher asks for ``min(tiles, MAX_PROGRAMS // other_axes)``
programs and program p takes tiles p, p + P, p + 2P, ... (P = programs on that axis, read in the kernel
with ``tl.num_programs``). Where tiles fit, each program takes one tile, as a plain grid would; the
program count is a runtime value, so it never reaches a compile key.
"""
from __future__ import annotations

MAX_PROGRAMS = 65535


def programs(tiles: int, other_axes: int = 1, cap: int = MAX_PROGRAMS) -> int:
    """Programs on the long axis for ``tiles`` tiles when the other axes hold ``other_axes`` programs
    together (0 when there are no tiles). ``cap``: a launcher's own bound on the programs of all axes
    together (a tuning knob, e.g. the conv's ``DZ_PROGRAMS``); at least one program per other-axis block
    whatever it is, so that a cap below 1 still writes every output.

    Raises:
        ValueError: the other axes alone exceed ``MAX_PROGRAMS``.
    """
    if other_axes > MAX_PROGRAMS:
        raise ValueError(f"a launch's other grid axes hold {other_axes} programs, more than {MAX_PROGRAMS}")
    other_axes = max(other_axes, 1)
    return min(tiles, MAX_PROGRAMS // other_axes, cdiv(max(1, min(cap, MAX_PROGRAMS)), other_axes))


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the launchers' host code (``triton.cdiv`` is a ``constexpr_function`` since Triton 3.5:
    its wrapper costs about 3 µs per host call, some 45 calls per layer step on the conv alone)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n = 0), as ``triton.next_power_of_2`` without its wrapper."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def on_cuda(x) -> bool:
    """Whether ``x`` is on a CUDA device. The launchers' CUDA-only kernel variants (the gated norm's hardware
    rounding, the conv's pipelined dz pass) ask this one function, read as ``_grid.on_cuda``, so that the
    compile probes can let CPU tensors stand in for CUDA ones by patching it."""
    return x.is_cuda
