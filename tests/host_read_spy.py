"""A spy for host reads and host-built tensors on a CPU run: what would sync, or copy host to device, on a GPU.

On the CPU every tensor is already on the host, so a device-to-host read (``cu.tolist()``, ``int(t)``,
``.cpu()``) costs nothing and no sync debug mode can see it. ``HostReadSpy`` is a ``TorchFunctionMode``:
it sees every Python-level torch call (and nothing inside a ``torch.library`` custom op, whose
implementation runs with the mode switched off: each kernel is one opaque call, as on a GPU where the
kernel backends own their launches) and records

- reads of tensor values on the host: ``tolist``, ``item``, ``cpu``, ``numpy``, ``bool()``, ``int()``,
  ``float()``, ``index()``, and ops whose output shape depends on the values (``nonzero``, ..., and
  those ``_value_shaped`` names: tensor-repeat ``repeat_interleave``, one-argument ``where``,
  ``bincount``, boolean-mask indexing, indexing with a 0-dim integer tensor);
- tensors built on the host: ``torch.tensor`` / ``as_tensor`` from Python data, and factories called
  without a ``device`` (on a GPU run they land on the CPU and are copied over per call).

Calls made by code that runs only for CPU tensors are not counted: ``gdn_layer.derived`` compares a
CPU ``cu_seqlens`` with its snapshot at each lookup (``_unchanged``, ``_snapshot``; on an accelerator
no snapshot is kept and nothing is read).

Backward: ``Tensor.backward`` is itself an overridable call, inside which the mode is off; ``backward``
below runs the autograd engine directly, so the Python parts of backward (custom ops' backward
functions, autograd.Functions, collectives) are seen too.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
          "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose"}
_FROM_HOST_DATA = {"tensor", "as_tensor", "from_numpy", "asarray"}
_FACTORIES = {"arange", "zeros", "ones", "empty", "full", "eye", "linspace", "rand", "randn", "randint",
              "tril_indices", "triu_indices"}


# functions that run only for CPU tensors (see the module docstring)
_CPU_ONLY = {("derived.py", "_unchanged"), ("derived.py", "_snapshot")}


def _from_cpu_only_code() -> bool:
    frame = sys._getframe(2)
    while frame is not None and "/torch/" in frame.f_code.co_filename:   # torch's own dispatch frames
        frame = frame.f_back
    return frame is not None and (os.path.basename(frame.f_code.co_filename), frame.f_code.co_name) in _CPU_ONLY


def _value_shaped(name, args, kwargs) -> bool:
    """Calls whose output shape depends on tensor values (a sync on a GPU) beyond ``_READS``: tensor-repeat
    ``repeat_interleave`` without ``output_size`` (also its one-argument form), one-argument ``where``,
    ``bincount``, and indexing with a boolean tensor."""
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if len(args) == 1 else None)
        return kwargs.get("output_size") is None and isinstance(repeats, torch.Tensor)
    if name == "where":
        return len(args) + len(kwargs) == 1
    if name == "bincount":
        return True
    if name == "__getitem__" and len(args) > 1:
        # a boolean mask, or a 0-dim integer tensor (read on the host as an int: ``t[i]``, ``i = x.argmax()``)
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        host = [i for i in index if isinstance(i, torch.Tensor)]
        return any(i.dtype == torch.bool or (i.dim() == 0 and not i.is_floating_point()) for i in host)
    return False


class HostReadSpy(TorchFunctionMode):
    """``with HostReadSpy() as spy: ...`` then ``spy.found``: ``[(what, detail)]`` in call order."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS | _FROM_HOST_DATA | _FACTORIES and _from_cpu_only_code():
            pass
        elif name in _READS or _value_shaped(name, args, kwargs):
            self.found.append(("host read", name))
        elif name in _FROM_HOST_DATA:
            self.found.append(("tensor from host data", name))
        elif name in _FACTORIES and kwargs.get("device") is None and not any(
                isinstance(a, torch.Tensor) for a in args):
            self.found.append(("factory without device", name))
        return func(*args, **kwargs)


def backward(loss: torch.Tensor) -> None:
    """``loss.backward()`` through the autograd engine itself, so that an active ``HostReadSpy`` sees the
    backward pass (see the module docstring)."""
    torch.autograd.Variable._execution_engine.run_backward(
        (loss,), (torch.ones_like(loss),), False, False, (), True, True)
