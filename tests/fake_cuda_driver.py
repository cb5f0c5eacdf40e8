"""A Triton driver for a CUDA GPU that is not there: Triton's real compile pipeline (TTIR -> TTGIR -> LLVM
-> PTX -> cubin, with the ptxas shipped in the triton wheel) runs on this CPU machine for an SM90 target,
``load_binary`` returns a dummy handle and the launcher does nothing. Kernels are "launched" with CPU
tensors (only their data pointers and dtypes reach Triton), so a test can count what a sequence of
launches compiles. Used by tests/test_triton_compile.py in a subprocess without TRITON_INTERPRET.
"""
from __future__ import annotations

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.backends.nvidia.driver import ty_to_cpp

from fake_driver_base import NoDeviceDriver

PROPS = {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32,
         "sm_clock_rate": 1980000, "mem_clock_rate": 2619000, "mem_bus_width": 5120}


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 64, 0, 1024          # module, function, n_regs, n_spills, max threads per block

    def get_device_properties(self, device):
        return dict(PROPS)


class _Launcher:
    def __init__(self, src, metadata):
        pass

    def __call__(self, *args, **kwargs):
        pass


class FakeCudaDriver(NoDeviceDriver, DriverBase):
    def __init__(self, capability: int = 90):
        self.capability = capability
        self.utils = _Utils()
        self.launcher_cls = _Launcher

    def map_python_to_cpp_type(self, ty):
        return ty_to_cpp(ty)

    def get_current_target(self):
        return GPUTarget("cuda", self.capability, 32)

    def get_device_capability(self, device=0):
        return divmod(self.capability, 10)

    def get_device_interface(self):
        return torch.cuda


def install() -> list:
    """Make the fake driver Triton's active driver; returns a list that collects one entry per compile."""
    import triton
    from triton import knobs
    triton.runtime.driver.set_active(FakeCudaDriver())
    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(k.get("key", a[:1]))
    return compiled
