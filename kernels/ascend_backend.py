"""``"ascend"`` backend: Huawei Ascend NPUs through torch_npu, fla's Triton chunk kernels (which fla
runs on triton-ascend) and our Triton kernels for conv, gate and norms.

Registered only where ``torch_npu`` imports. NOT RUN on an NPU by this project (no NPU is reachable
from its machines): what is checked without one is that this module imports cleanly everywhere, that
it does not register without torch_npu, and that our kernels pass the static no-specialisation rules
(``shared/tools/scan_triton.py``) that the Ascend compiler needs as much as CUDA's. See docs/kernels.md.
"""
from __future__ import annotations

import dataclasses
import importlib.util

import torch

from . import fla_backend


def torch_npu_importable() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401
    except Exception:
        return False
    return True


def available(device: torch.device) -> tuple[bool, str]:
    if device.type != "npu":
        return False, "the ascend backend runs on NPU devices only"
    return fla_backend.fla_importable()


def make_backend():
    return dataclasses.replace(fla_backend.make_backend(), name="ascend", available=available, priority=10)
