"""Input validation shared by every backend: one place for the rules in DESIGN.md "Errors".

Shape, dtype and device checks always run. Checks that must read tensor values (``cu_seqlens``
contents, ``g <= 0``, NaN inputs) need the values on the host: they always run for CPU tensors,
and for accelerator tensors only when validation is switched on, because there they cost a
device-to-host sync. The switch is ``GDN_LAYER_VALIDATE=1`` in the environment or
``gdn_layer.kernels.set_validation(True)``. A caller that holds ``cu_seqlens`` on the host can pass
that CPU tensor even for accelerator activations: then its values are checked with no sync.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from .cu_cache import as_int64, capturing, host_copy

_VALIDATE: bool | None = None
_SKIP_DEPTH = 0


def set_validation(enabled: bool | None) -> None:
    """Switch value checks on accelerators on (True), off (False) or back to the env default (None)."""
    global _VALIDATE
    _VALIDATE = enabled


def validation_enabled() -> bool:
    """True when value checks run on accelerator tensors (``GDN_LAYER_VALIDATE=1`` or ``set_validation``)."""
    if _VALIDATE is not None:
        return _VALIDATE
    return os.environ.get("GDN_LAYER_VALIDATE", "0") not in ("", "0", "false", "False")


@contextmanager
def skip_value_checks():
    """Inside this block kernels skip value checks: for a caller that checked its inputs already and
    must not raise on one rank only (under SP, after the first collective)."""
    global _SKIP_DEPTH
    _SKIP_DEPTH += 1
    try:
        yield
    finally:
        _SKIP_DEPTH -= 1


def values_checkable(t: torch.Tensor) -> bool:
    """Whether value checks on ``t`` run now: always on CPU, on accelerators only when switched on, and
    never while ``torch.compile`` traces (a host read of tensor values would break the graph; shape,
    dtype and device checks still run there and become guards), nor during a CUDA graph capture (a
    sync is not allowed there)."""
    if _SKIP_DEPTH or torch.compiler.is_compiling() or capturing(t):
        return False
    return t.device.type == "cpu" or validation_enabled()


def check_cu_seqlens(cu_seqlens, total_len: int | None, device: torch.device | None = None,
                     name: str = "cu_seqlens", length_hint: str = "") -> torch.Tensor:
    """Validate packed-sequence boundaries and return them as int64 on ``device``.

    Args:
        cu_seqlens: 1-D integer tensor ``[N + 1]`` with ``cu[0] == 0``, non-decreasing, ``cu[-1] == total_len``.
            Zero-length segments are legal. int32 and int64 give identical results (int32 is
            converted, never reinterpreted).
        total_len: the packed length T the boundaries must end at (None skips that check).
        device: where the returned tensor lives (default: where ``cu_seqlens`` lives).
        length_hint: appended to the ``cu[-1] != total_len`` message (e.g. how to fix it under SP).

    Raises:
        TypeError: not a tensor.
        ValueError: not 1-D, fewer than 2 entries, not an integer dtype, or (values checked) not
            starting at 0, decreasing, or not ending at ``total_len``.
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32/int64, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"{name} must be 1-D [N + 1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.device.type == "meta":
        raise ValueError(f"{name} must hold real values (it is on the meta device)")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"{name} must hold at least 2 entries (one sequence), got {cu_seqlens.numel()}")
    target = torch.device(device) if device is not None else cu_seqlens.device
    if cu_seqlens.device != target and capturing(target):
        raise ValueError(f"{name} must be on {target} during a CUDA graph capture, got a {cu_seqlens.device} "
                         "tensor: its values would be copied once, at capture, and a replay would not see a "
                         "new packing (keep a device cu_seqlens buffer and copy_ each packing into it)")
    if values_checkable(cu_seqlens):
        host = host_copy(cu_seqlens)
        if int(host[0]) != 0:
            raise ValueError(f"{name} must start at 0, got {name}[0] = {int(host[0])}")
        steps = host[1:] - host[:-1]
        if bool((steps < 0).any()):
            i = int(torch.nonzero(steps < 0)[0])
            raise ValueError(f"{name} must be non-decreasing, but {name}[{i + 1}] = {int(host[i + 1])} "
                             f"< {name}[{i}] = {int(host[i])}")
        if total_len is not None and int(host[-1]) != total_len:
            raise ValueError(f"{name}[-1] must equal the packed length T = {total_len}, got {int(host[-1])}"
                             + (f"; {length_hint}" if length_hint else ""))
    # one shared int64 copy per tensor (cu_cache): every layer of a step then hands the backends the
    # same tensor, and what they derive from it is computed once
    return as_int64(cu_seqlens, device if device is not None else cu_seqlens.device)


def _sequences(cu_seqlens, B: int, T: int, device: torch.device) -> tuple[int, torch.Tensor | None]:
    """``(N, cu)`` of a call with batch B and length T: N = B and None without ``cu_seqlens``, else the number
    of packed sequences and ``check_cu_seqlens``' int64 copy on ``device``.

    Raises:
        ValueError: ``cu_seqlens`` with ``B != 1``, or malformed (``check_cu_seqlens``).
    """
    if cu_seqlens is None:
        return B, None
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {B}")
    cu = check_cu_seqlens(cu_seqlens, T, device=device)
    return cu.numel() - 1, cu


def check_no_nan(name: str, t: torch.Tensor | None, finite: bool = False) -> None:
    """Raise ValueError if ``t`` holds NaN (or, with ``finite``, inf too; only where values are checkable)."""
    if t is None or not t.is_floating_point() or not values_checkable(t):
        return
    if finite and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or inf")
    if bool(torch.isnan(t).any()):
        raise ValueError(f"{name} contains NaN")


def check_float_tensors(**named) -> None:
    """Each argument is a floating-point tensor on the device of the first one (named in the error)."""
    first_name, first = next(iter(named.items()))
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_flags(**flags) -> None:
    """Each flag must be a real bool (``"no"`` is not False)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_scale(scale) -> None:
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")


def check_gated_delta_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> tuple[int, int, torch.Tensor | None]:
    """Validate the inputs of ``chunk_gated_delta_rule`` / ``recurrent_gated_delta_rule``.

    Floating dtypes may mix, as fla's ops accept (e.g. q, k fp32 with v, beta fp16, an fp16
    ``initial_state``): the math runs in fp32, or fp64 when any input is fp64. Integer, bool and complex
    tensors raise TypeError.

    Returns ``(N, r, cu)`` where N is the number of sequences (B, or len(cu_seqlens) - 1), r = Hv / Hk and
    cu the int64 ``cu_seqlens`` (or None).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, T, H, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [B, T, Hk, Dk]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, Hk, Dk = k.shape
    if Dk == 0 or v.shape[3] == 0:
        raise ValueError(f"head dims must be positive; got Dk = q.shape[3] = {Dk}, Dv = v.shape[3] = {v.shape[3]}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, Hv, Dv] with B={B}, T={T} as in k; got {tuple(v.shape)}")
    Hv = v.shape[2]
    if Hk == 0 or Hv % Hk != 0:
        raise ValueError(f"num_v_heads (v.shape[2] = {Hv}) must be a multiple of num_k_heads (k.shape[2] = {Hk})")
    for name, t in (("g", g), ("beta", beta)):
        if tuple(t.shape) != (B, T, Hv):
            raise ValueError(f"{name} must be [B, T, Hv] = {(B, T, Hv)} (one value per value head), "
                             f"got {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; all inputs must be on one device")
    N, cu = _sequences(cu_seqlens, B, T, q.device)
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor):
            raise TypeError(f"initial_state must be a torch.Tensor, got {type(initial_state).__name__}")
        if tuple(initial_state.shape) != (N, Hv, Dk, v.shape[3]):
            raise ValueError(f"initial_state must be [N, Hv, Dk, Dv] = {(N, Hv, Dk, v.shape[3])} "
                             f"(N = number of sequences), got {tuple(initial_state.shape)}")
        if not initial_state.is_floating_point():
            raise TypeError(f"initial_state must be a floating-point tensor, got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}")
    if values_checkable(g):
        if bool((g > 0).any()):
            raise ValueError("g is the log-space decay and must be <= 0 everywhere (g = -inf is a reset); "
                             f"got max(g) = {float(g.max())}")
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state)):
            check_no_nan(name, t)
    return N, Hv // Hk, cu


def check_conv_inputs(x, weight, bias, initial_state, cu_seqlens, activation,
                      x_name: str = "x") -> tuple[int, torch.Tensor | None]:
    """Validate ``causal_conv1d`` inputs; returns ``(N, cu)``. ``x_name``: what the caller calls x (in messages)."""
    for name, t in ((x_name, x), ("weight", weight), ("bias", bias), ("initial_state", initial_state)):
        if t is None and name in ("bias", "initial_state"):
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if x.dim() != 3:
        raise ValueError(f"{x_name} must be [B, T, C], got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if B == 0 or C == 0:
        raise ValueError(f"{x_name} must have a positive batch size and channel count, got shape {tuple(x.shape)}")
    if weight.dim() == 3 and weight.shape[1] == 1:
        raise ValueError(f"weight must be [C, W]; squeeze nn.Conv1d's [C, 1, W] weight first (got {tuple(weight.shape)})")
    if weight.dim() != 2 or weight.shape[0] != C or weight.shape[1] < 1:
        raise ValueError(f"weight must be [C, W] with C = {x_name}.shape[-1] = {C} and W >= 1, got "
                         f"{tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (C,):
        raise ValueError(f"bias must be [C] = [{C}], got {tuple(bias.shape)}")
    if activation not in (None, "silu", "swish", "identity"):
        raise ValueError(f"activation must be 'silu', 'swish', 'identity' or None, got {activation!r}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but {x_name} is on {x.device}")
    for name, t in ((x_name, x), ("weight", weight), ("bias", bias)):
        check_no_nan(name, t)
    N, cu = _sequences(cu_seqlens, B, T, x.device)
    W = weight.shape[1]
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, C, W - 1):
            raise ValueError(f"initial_state (conv state) must be [N, C, W-1] = {(N, C, W - 1)}, "
                             f"got {tuple(initial_state.shape)}")
        if initial_state.device != x.device:
            raise ValueError(f"initial_state is on {initial_state.device} but {x_name} is on {x.device}")
        check_no_nan("initial_state", initial_state)
    return N, cu


def check_l2norm_head_dim(l2norm_head_dim, split_sizes) -> int:
    """Validate ``causal_conv1d_gate``'s ``l2norm_head_dim`` against its (validated) ``split_sizes``: None, or an
    int in ``(0, 2**31)`` dividing the first two sizes (whole heads of q and k). Returns it, 0 for None."""
    if l2norm_head_dim is None:
        return 0
    if isinstance(l2norm_head_dim, bool) or not isinstance(l2norm_head_dim, int):
        raise TypeError(f"l2norm_head_dim must be None or an int, got {type(l2norm_head_dim).__name__}")
    if not 0 < l2norm_head_dim < 2 ** 31:
        raise ValueError(f"l2norm_head_dim must be positive and below 2**31, got {l2norm_head_dim}")
    if any(w % l2norm_head_dim for w in split_sizes[:2]):
        raise ValueError(f"l2norm_head_dim = {l2norm_head_dim} must divide split_sizes[0] and split_sizes[1] "
                         f"(whole heads of q and k), got split_sizes {list(split_sizes)}")
    return l2norm_head_dim


def check_split_sizes(split_sizes, C: int, what: str = "x.shape[-1]") -> list[int]:
    """Validate ``causal_conv1d_split``'s ``split_sizes`` for C channels (``what``: where C comes from, for
    the message); returns them padded with zeros to 3."""
    if not isinstance(split_sizes, (list, tuple)) or not 1 <= len(split_sizes) <= 3 or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in split_sizes):
        raise TypeError(f"split_sizes must be a list or tuple of 1 to 3 non-negative ints, got {split_sizes!r}")
    if sum(split_sizes) != C:
        raise ValueError(f"split_sizes must sum to C = {what} = {C}, got {list(split_sizes)} "
                         f"(sum {sum(split_sizes)})")
    return [*split_sizes, *[0] * (3 - len(split_sizes))]
