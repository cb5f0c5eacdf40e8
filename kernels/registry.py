"""One registry of backends for the GatedDeltaNet math.

A backend is a named set of ops (``chunk_gated_delta_rule``, ``recurrent_gated_delta_rule``,
``causal_conv1d``, ``gated_rms_norm``) plus a check of whether it can run on a device. ``"auto"`` is
resolved once per (device type) and the choice is logged once; an explicit name that cannot run on
the device raises at bind time (``resolve_backend``), not deep inside a forward.

Registered here: ``"torch"`` (the reference, any device). Every other backend is a module
``kernels/<name>_backend.py`` that registers itself with ``register_backend`` when imported (a backend
whose library is missing either registers with an ``available`` that says why, or does not register);
``import_backend_modules`` imports them all, once, from the package's ``__init__``.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import pathlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import reference

log = logging.getLogger("gdn_layer.kernels")


@dataclass(frozen=True)
class Backend:
    """A named implementation of the ops; ``available(device) -> (ok, reason)``.

    The forward callables have the signatures of ``reference.py``'s functions (inputs validated,
    ``cu`` int64 or None). Each ``*_bwd`` is optional: given, it computes the input gradients from the
    inputs and the output gradients, and replaces the automatic gradient entirely (so it must handle every
    argument the forward takes, ``use_qk_l2norm`` and ``initial_state`` included); None means the gradients
    are the vector-Jacobian product of the forward callable (right for pure-torch implementations).

    Backward callables (gradients in any float dtype, cast by ``ops``; None for an absent optional input):

    - ``chunk_gated_delta_rule_bwd`` / ``recurrent_gated_delta_rule_bwd``: ``(do, dfinal, q, k, v, g, beta, *,
      scale, initial_state, cu, use_qk_l2norm) -> (dq, dk, dv, dg, dbeta, dh0)``, and ``residuals=`` for the
      chunk one of a backend with ``chunk_residuals``; ``dfinal`` None when the forward gave no final state,
      ``dh0`` None without ``initial_state``. The layer calls the chunk
      op with ``use_qk_l2norm=True`` except where its conv normalised q and k (``conv_fuses_l2norm``).
    - ``causal_conv1d_bwd``: ``(dy, dfinal, x, weight, bias, *, activation, cu, initial_state[, dx][, l2norm_out])
      -> (dx, dweight, dbias, dinitial)`` (dy a list of parts with ``conv_splits``).
    - ``gdn_gate_bwd``: ``(dg, dbeta, a, b, A_log, dt_bias[, *, da, db]) -> (da, db, dA_log, ddt_bias)``.
    - ``gated_rms_norm_bwd``: ``(dy, x, z, weight, eps) -> (dx, dz, dweight)``.

    Flags and hooks (each one's promise in the comment above its field; ``register_backend`` checks the
    keywords a flag needs): ``conv_splits`` (one conv launch for q, k, v), ``grads_into`` (backwards that write
    into views of one gradient buffer: ``dx=``, ``da=``, ``db=``), ``conv_l2norm`` (the conv normalises q and k:
    ``l2norm_dim=`` / ``l2norm_out=``), ``chunk_residuals`` (the chunk forward keeps tensors for its backward:
    ``residuals=``), ``dense_as_packed``, ``warmup_sequence_counts``, ``as_in_capture``. A shipped backend is a
    starting point: ``dataclasses.replace(resolve_backend("torch", "cpu"), name=..., ...)``.
    """
    name: str
    chunk_gated_delta_rule: Callable
    recurrent_gated_delta_rule: Callable
    causal_conv1d: Callable
    gated_rms_norm: Callable
    available: Callable[[torch.device], tuple[bool, str]]
    priority: int = 0   # "auto" takes the available backend with the highest priority
    gdn_gate: Callable = reference.gdn_gate
    chunk_gated_delta_rule_bwd: Callable | None = None
    recurrent_gated_delta_rule_bwd: Callable | None = None
    causal_conv1d_bwd: Callable | None = None
    gdn_gate_bwd: Callable | None = None
    gated_rms_norm_bwd: Callable | None = None
    # its ``causal_conv1d`` takes ``split_sizes=`` (1-3 channel counts) and returns y as a list of that
    # many contiguous parts, and its ``causal_conv1d_bwd`` takes dy as such a list (one launch for the
    # layer's q, k and v; kernels/triton/conv.py). False: ``causal_conv1d_split`` runs one conv per part
    conv_splits: bool = False
    # its ``causal_conv1d_bwd`` takes ``dx=`` and its ``gdn_gate_bwd`` ``da=``, ``db=``: column slices of one
    # gradient buffer to write into (the ``conv_gate`` op's backward then concatenates nothing). False: the
    # gradients come back as new tensors and are copied into the buffer
    grads_into: bool = False
    # its ``causal_conv1d`` takes ``l2norm_dim=`` D and then returns ``(y, final, rstd [B, T, C // D])``, y
    # L2-normalised per head of D channels, and its ``causal_conv1d_bwd`` takes ``l2norm_out=(y, rstd)`` (the
    # gradient through the norm from them; ``kernels/triton/conv.py``): the layer's q and k, with the delta rule's
    # own norm off. False: the ``conv_gate`` op normalises in torch around the conv, and the layer leaves the norm
    # to the delta-rule kernel (``conv_fuses_l2norm``)
    conv_l2norm: bool = False
    # its ``chunk_gated_delta_rule`` takes ``residuals=True`` and then returns ``(o, final, residuals)``, residuals
    # ``()`` or a pair of tensors its ``chunk_gated_delta_rule_bwd`` takes back as ``residuals=`` instead of
    # recomputing them (FlashQLA: the gate's chunk-local cumsum and the UT matrices A, which FlashQLA's and fla's
    # own autograd save too). Opaque to ``ops``: two tensors (no None), saved for backward as returned (the layout
    # the backend was called with: packed ``[1, B*T, ...]`` for a dense call with ``dense_as_packed``; any shape).
    # The backward is called with ``residuals=None`` where the forward returned ``()`` or two empty tensors or was
    # not asked (under ``torch.compile``, without autograd or an input needing a gradient, and for the recurrent
    # op: never asked), and must then recompute. False: never asked
    chunk_residuals: bool = False
    # run dense ``[B, T]`` delta-rule calls as a pack of B sequences of T tokens (exact): compiled
    # backends then build one (varlen) kernel variant per flag set instead of two
    dense_as_packed: bool = False
    # ``warmup_sequence_counts(num_v_heads) -> counts``: sequence counts N (for the value heads per call)
    # whose packs build each compiled variant the backend picks from N (``warmup()`` runs one pack per N);
    # None: nothing the backend compiles depends on N
    warmup_sequence_counts: Callable[[int], tuple[int, ...]] | None = None
    # ``as_in_capture()`` -> context manager under which the backend runs the kernels it runs during a CUDA
    # graph capture, for a backend whose captured calls take other kernels than its eager ones (FlashQLA
    # hands them to fla): ``warmup()`` runs the packed training calls once more under it, so a capture
    # compiles and autotunes nothing. None: a capture runs the eager kernels
    as_in_capture: Callable[[], Any] | None = None


_BACKENDS: dict[str, Backend] = {}
_AUTO_LOGGED: set[str] = set()


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend by name.

    Raises:
        TypeError: ``grads_into=True`` without a ``causal_conv1d_bwd`` taking ``dx=`` and a ``gdn_gate_bwd``
            taking ``da=`` and ``db=`` (the flag promises both; a backend built by ``dataclasses.replace`` of a
            shipped one inherits it); ``conv_l2norm=True`` without a ``causal_conv1d`` taking ``l2norm_dim=``
            and a ``causal_conv1d_bwd`` taking ``l2norm_out=`` (likewise); ``chunk_residuals=True`` without a
            ``chunk_gated_delta_rule`` and a ``chunk_gated_delta_rule_bwd`` taking ``residuals=``.
    """
    if backend.grads_into:
        for field, kwargs in (("causal_conv1d_bwd", ("dx",)), ("gdn_gate_bwd", ("da", "db"))):
            fn = getattr(backend, field)
            if fn is None or not _takes(fn, kwargs):
                raise TypeError(f"backend {backend.name!r} has grads_into=True, so its {field} must take "
                                f"{', '.join(k + '=' for k in kwargs)} (views of the gradient buffer to write into); "
                                f"set grads_into=False if it does not")
    if backend.conv_l2norm:
        for field, kwarg in (("causal_conv1d", "l2norm_dim"), ("causal_conv1d_bwd", "l2norm_out")):
            fn = getattr(backend, field)
            if fn is None or not _takes(fn, (kwarg,)):
                raise TypeError(f"backend {backend.name!r} has conv_l2norm=True, so its {field} must take {kwarg}= "
                                f"(the conv's own q / k norm); set conv_l2norm=False if it does not")
    if backend.chunk_residuals:
        for field in ("chunk_gated_delta_rule", "chunk_gated_delta_rule_bwd"):
            fn = getattr(backend, field)
            if fn is None or not _takes(fn, ("residuals",)):
                what = "is None: it needs one" if fn is None else "must take residuals="
                raise TypeError(f"backend {backend.name!r} has chunk_residuals=True, so its {field} {what} "
                                f"(the tensors its chunk forward keeps for the backward go to it); set "
                                f"chunk_residuals=False if it does not")
    _BACKENDS[backend.name] = backend


def _takes(fn, names) -> bool:
    """Whether ``fn`` accepts each of ``names`` as a keyword (or any keyword); True where it has no signature."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    keywords = {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                    inspect.Parameter.KEYWORD_ONLY)}
    return set(names) <= keywords


def _available(b: Backend, device: torch.device) -> tuple[bool, str]:
    """``b.available(device)`` as ``(ok, reason)``; a plain bool is accepted too."""
    res = b.available(device)
    return (res, "" if res else "its available() said no") if isinstance(res, bool) else tuple(res)


def backend_by_name(name: str) -> Backend:
    """The registered backend called ``name`` (no device check; ``resolve_backend`` does that)."""
    return _BACKENDS[name]


@torch.compiler.assume_constant_result
def _resolved_name(name: str, device: str) -> str:
    return resolve_backend(name, device).name


def backend_name(name: str, device: torch.device | str) -> str:
    """``resolve_backend(name, device).name``; under ``torch.compile`` evaluated once while tracing and
    baked into the graph as a constant (the registry is host-side state)."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    return _resolved_name(name, str(device))


def fuses_l2norm(b: Backend) -> bool:
    """Whether backend ``b``'s conv normalises the q / k parts itself: ``conv_l2norm`` with one conv per part
    (no ``conv_splits``) and a conv backward of its own (the ``conv_gate`` op, ``ops_conv_gate.py``, asks the same)."""
    return b.conv_l2norm and not b.conv_splits and b.causal_conv1d_bwd is not None


@torch.compiler.assume_constant_result
def _conv_fuses_l2norm(name: str, device: str) -> bool:
    return fuses_l2norm(resolve_backend(name, device))


def conv_fuses_l2norm(name: str, device: torch.device | str) -> bool:
    """Whether ``causal_conv1d_gate(..., l2norm_head_dim=)`` on backend ``name`` (``"auto"`` resolved for
    ``device``) normalises q and k inside its conv kernels (``Backend.conv_l2norm``, one conv per part) rather
    than in torch around them: the layer moves the delta rule's q / k norm into the conv only then. Constant
    under ``torch.compile``, as ``backend_name``."""
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    return _conv_fuses_l2norm(name, str(device))


def available_backends(device: torch.device | str | None = None) -> list[str]:
    """Names of registered backends; with ``device``, only those that can run there."""
    if device is None:
        return sorted(_BACKENDS)
    device = torch.device(device)
    return sorted(n for n, b in _BACKENDS.items() if _available(b, device)[0])


def resolve_backend(name: str, device: torch.device | str) -> Backend:
    """Bind a backend name (or ``"auto"``) to an implementation for ``device``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: unknown name, or the named backend cannot run on ``device`` (the reason is given).
    """
    if not isinstance(name, str):
        raise TypeError(f"backend must be a string, got {type(name).__name__}")
    device = torch.device(device)
    if name == "auto":
        ok = [b for b in _BACKENDS.values() if _available(b, device)[0]]
        best = max(ok, key=lambda b: b.priority)
        if device.type not in _AUTO_LOGGED:
            _AUTO_LOGGED.add(device.type)
            log.info("backend='auto' on %s resolved to %r", device.type, best.name)
        return best
    if name not in _BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {available_backends()}, got {name!r}")
    b = _BACKENDS[name]
    ok, why = _available(b, device)
    if not ok:
        raise ValueError(f"backend {name!r} cannot run on {device}: {why}")
    return b


register_backend(Backend(
    name="torch",
    chunk_gated_delta_rule=reference.chunk_gated_delta_rule,
    recurrent_gated_delta_rule=reference.recurrent_gated_delta_rule,
    causal_conv1d=reference.causal_conv1d,
    gated_rms_norm=reference.gated_rms_norm,
    available=lambda device: (True, ""),
    priority=0,
))


def import_backend_modules() -> list[str]:
    """Import every ``*_backend`` module of this package, in name order; each registers its backend at
    import (``register_backend``, guarded by what it needs: the Ascend one only where torch_npu
    imports). Called once by ``gdn_layer.kernels``' ``__init__``, so adding a backend is adding one
    ``kernels/<name>_backend.py``; the registry itself imports no backend. Returns the module names."""
    names = sorted(m.name for m in pkgutil.iter_modules([str(pathlib.Path(__file__).parent)])
                   if m.name.endswith("_backend"))
    for name in names:
        importlib.import_module(f"{__package__}.{name}")
    return names
