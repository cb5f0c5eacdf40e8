"""A triton-ascend driver for an Ascend NPU that is not there (runs in ``.venv-ascend``, where
``triton-ascend`` replaces the ``triton`` package).

triton-ascend's own JIT, specialisation and cache run, and its real lowering: TTIR (``make_ttir``) ->
``ttadapter`` (linalg with HIVM annotations, by the ``triton-adapter-opt`` binary in the wheel). Only the
last stage, ``npubin`` (``bishengir-compile`` from CANN), is replaced by a stub that parses the
``ttadapter`` module the way triton-ascend does (kernel name, mix mode, tensor kinds) and returns an empty
binary. ``load_binary`` returns a dummy handle and the launcher records the grid instead of launching, so
kernels are "launched" with CPU (or meta) tensors and nothing runs. triton-ascend's JIT itself refuses a
grid of more than 65 535 programs (``RuntimeError: grid should be less than 65536``) before the launcher
is called.

Also makes ``torch.npu`` answer the questions fla-core asks at import (device count, current device,
a device context) without importing torch_npu, which cannot import where CANN is missing.
Used by ``tests/ascend_probe.py``.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import types

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

from fake_driver_base import NoDeviceDriver

ARCH = "Ascend910B2"            # a 910B2(C): 24 AI cores (cube), 48 vector cores
PROPS = {"max_shared_mem": 1, "num_aicore": 24, "num_vectorcore": 48}
GRID_LIMIT = 65535              # triton-ascend's JIT raises above this many programs per launch


class Record:
    """What the stand-in saw: one entry per compile and per launch."""

    def __init__(self):
        self.compiles: list[dict] = []     # {"kernel", "key"}
        self.launches: list[dict] = []     # {"kernel", "grid"}
        self.lowered: dict[str, str] = {}   # kernel name -> mix_mode of its ttadapter module ("aiv": vector
        #                                     cores only, "mix": cube and vector)
        self.adapter_crashes: list[dict] = []   # {"kernel", "signal"}: a lowering retried (see below)


RECORD = Record()


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 0, 0                   # module, function, n_regs, n_spills

    def get_device_properties(self, device):
        return dict(PROPS)

    def get_arch(self):
        return ARCH

    def get_aicore_num(self):
        return PROPS["num_aicore"]

    def get_aivector_core_num(self):
        return PROPS["num_vectorcore"]


class _Launcher:
    def __init__(self, src, metadata):
        self.name = getattr(metadata, "kernel_name", None) or src.fn.__name__

    def __call__(self, grid_0, grid_1, grid_2, *args, **kwargs):
        RECORD.launches.append({"kernel": self.name, "grid": [int(grid_0), int(grid_1), int(grid_2)]})


class FakeNPUDriver(NoDeviceDriver, DriverBase):
    def __init__(self):
        self.utils = _Utils()
        self.launcher_cls = _Launcher

    def get_current_target(self):
        return GPUTarget("npu", ARCH, 0)

    def get_device_interface(self):
        return torch.npu


# triton-ascend 3.2.0's ``triton-adapter-opt`` reads freed memory in its ``--triton-to-unstructure`` pass on
# fla-core's fused recurrent kernel: run under ``MALLOC_PERTURB_=165`` it segfaults every time; without, it
# is killed by glibc ("corrupted size vs. prev_size", SIGABRT) about once in a few hundred runs, and its
# output is otherwise the same byte for byte. A lowering whose tool died by a signal is run again; a
# lowering that fails with the tool's own error (an exit code) is not. Each retry is recorded.
ADAPTER_ATTEMPTS = 4


def retry_on_signal(lower, kernel, crashes: list, attempts: int = ADAPTER_ATTEMPTS):
    """Call ``lower()``; when it raises ``subprocess.CalledProcessError`` for a process killed by a
    signal (negative return code), append ``{"kernel": kernel(), "signal"}`` to ``crashes`` and call it
    again, at most ``attempts`` times in all. Any other error, and the last crash, propagate."""
    import subprocess
    for attempt in range(1, attempts + 1):
        try:
            return lower()
        except subprocess.CalledProcessError as e:
            if e.returncode >= 0:
                raise
            crashes.append({"kernel": kernel(), "signal": -e.returncode})
            print(f"{e.cmd[0] if isinstance(e.cmd, (list, tuple)) else e.cmd} died by signal {-e.returncode} "
                  f"lowering {crashes[-1]['kernel']} (attempt {attempt} of {attempts})", file=sys.stderr)
            if attempt == attempts:
                raise


_ASCEND_COMPILER: dict = {}     # the globals of triton-ascend's compiler module (its own copy; install())


def kill_adapter_on(kernel: str) -> None:
    """For the retry's test: put a script in front of ``triton-adapter-opt`` that kills itself with
    SIGSEGV when the module it is given defines ``kernel``, and runs the real tool otherwise."""
    import stat
    import tempfile
    module = _ASCEND_COMPILER            # triton-ascend's compiler module, as install() found it
    real = module["_get_triton_adapter_opt_path"]()
    script = os.path.join(tempfile.mkdtemp(prefix="gdn_adapter_"), "triton-adapter-opt")
    with open(script, "w") as f:
        f.write(f'#!/bin/sh\ngrep -q "@{kernel}(" "$1" && kill -SEGV $$\nexec "{real}" "$@"\n')
    os.chmod(script, os.stat(script).st_mode | stat.S_IXUSR)
    module["_get_triton_adapter_opt_path"] = lambda: script


def _kernel_name(ttir) -> str:
    m = re.search(r"tt\.func (?:public |private )?@([\w$.]+)", str(ttir))
    return m.group(1) if m else "?"


def _npubin_stub(linalg: str, metadata: dict, opt):
    """Stands in for ``bishengir-compile`` (CANN): checks the ttadapter module is linalg with HIVM's
    annotations and fills the metadata fields the launch path reads, by triton-ascend's own parser."""
    from triton.backends.ascend import compiler as ac
    if "linalg." not in linalg:
        raise RuntimeError("the ttadapter stage did not produce linalg")
    ac._parse_linalg_metadata(linalg, metadata)     # raises if the module lacks HIVM's mix_mode / kernel name
    RECORD.lowered[metadata["kernel_name"]] = metadata["mix_mode"]
    return b""


def _fake_torch_npu():
    """``torch.npu`` with what fla-core touches at import and in its launchers (no torch_npu)."""
    if hasattr(torch, "npu"):
        return
    npu = types.ModuleType("torch.npu")
    npu.is_available = lambda: True
    npu.device_count = lambda: 1
    npu.current_device = lambda: 0
    npu.set_device = lambda d: None
    npu.synchronize = lambda *a, **k: None
    npu.device = lambda index=None: contextlib.nullcontext()
    npu.get_device_name = lambda *a, **k: ARCH
    npu.amp = types.SimpleNamespace(custom_fwd=torch.amp.custom_fwd, custom_bwd=torch.amp.custom_bwd)
    torch.npu = npu
    sys.modules["torch.npu"] = npu


def install() -> Record:
    """Make the stand-in triton-ascend's active driver (before fla is imported); returns the record."""
    import triton
    from triton.backends import backends
    from triton.runtime.jit import JITFunction

    _fake_torch_npu()
    triton.runtime.driver.set_active(FakeNPUDriver())
    ascend = backends["ascend"].compiler       # the class triton's make_backend uses (its own module copy)
    add_stages = ascend.add_stages

    def add_stages_stubbed(self, stages, options):
        add_stages(self, stages, options)
        if "ttadapter" not in stages:
            raise RuntimeError("triton-ascend did not add the ttadapter stage (force_simt_only?)")
        lower = stages["ttadapter"]
        stages["ttadapter"] = lambda src, metadata: retry_on_signal(
            lambda: lower(src, metadata), lambda: _kernel_name(src), RECORD.adapter_crashes)
        stages["npubin"] = lambda src, metadata: _npubin_stub(src, metadata, options)

    ascend.add_stages = add_stages_stubbed
    global _ASCEND_COMPILER
    _ASCEND_COMPILER = add_stages.__globals__

    def compiled(*args, **kwargs):
        fn = kwargs.get("fn")
        RECORD.compiles.append({"kernel": getattr(fn, "name", "?"), "key": str(kwargs.get("key"))})
        return False

    JITFunction.compiled_hook = compiled
    return RECORD
