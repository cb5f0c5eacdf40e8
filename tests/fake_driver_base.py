"""What the stand-in Triton drivers (``fake_cuda_driver``, ``fake_npu_driver``) share: a driver for a device
that is not there, whose tensors are CPU tensors, with one device and one stream, and a benchmarker that
runs each candidate once and calls them all equal (an autotuner then takes its first config). Imports only
torch, so both Triton builds (CUDA's and triton-ascend) can use it."""
from __future__ import annotations

import torch


class NoDeviceDriver:
    """Mixed into a ``triton.backends.driver.DriverBase`` subclass before it."""

    @classmethod
    def is_active(cls):
        return True

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_benchmarker(self):
        def bench(fn, *args, quantiles=None, **kwargs):
            fn()
            return [1.0] * len(quantiles) if quantiles else 1.0
        return bench

    def get_empty_cache_for_benchmark(self):
        return torch.empty(1)

    def clear_cache(self, cache):
        pass
