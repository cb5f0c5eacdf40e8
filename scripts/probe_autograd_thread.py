"""Where the layer's fixed host cost on CUDA goes: forward and backward host time of one layer call under
three settings of the autograd engine and the interpreter.

    python scripts/probe_autograd_thread.py [--layer null|ft] [--T 8192]

``null``: the tiny layer of ``bench_null_backend.py`` (its backend only allocates outputs); ``ft``: the
fine-tune example's layer (hidden 576, Hk 4, Hv 8, D 64) with ``backend="auto"``, bf16, 9 documents.
Settings: ``default``; ``single-thread`` (``torch.autograd.set_multithreading_enabled(False)``: the
backward runs on the calling thread instead of the CUDA device thread); ``switch-1e-5``
(``sys.setswitchinterval(1e-5)``: a thread waiting for the GIL gets it after 10 us instead of 5 ms).
Prints the median host ms of the forward (grad on), of ``backward()`` and of both, over ``--iters`` calls,
the GPU synced before each.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def setting(name):
    old_switch = sys.getswitchinterval()
    if name == "single-thread":
        with torch.autograd.set_multithreading_enabled(False):
            yield
        return
    if name == "switch-1e-5":
        sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old_switch)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] + " Needs a CUDA GPU.")
    ap.add_argument("--layer", default="null", choices=["null", "ft"])
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from requires import require_cuda
    require_cuda("probe_autograd_thread.py")
    from gdn_layer import GatedDeltaNet
    from gdn_layer.kernels.validation import skip_value_checks
    dev = "cuda"
    if args.layer == "null":
        from bench_null_backend import alloc_only_backend
        from gdn_layer.kernels import registry
        registry.register_backend(alloc_only_backend())
        layer = GatedDeltaNet(64, 2, 4, 16, 16, backend="null", device=dev)
        x = torch.randn(1, 16, 64, requires_grad=True, device=dev)
        cu = torch.tensor([0, 8, 16], device=dev)
    else:
        from bench_host_cost import packing
        from gdn_layer.kernels import warmup
        layer = GatedDeltaNet(576, 4, 8, 64, 64, backend="auto", device=dev, dtype=torch.bfloat16)
        warmup(layer, include_decode=False, include_states=False)
        x = torch.randn(1, args.T, 576, requires_grad=True, device=dev, dtype=torch.bfloat16)
        cu = torch.tensor(packing(args.T, 9), dtype=torch.int32, device=dev)
    import threading
    backward_threads = set()
    x.register_hook(lambda grad: backward_threads.add(threading.get_ident()))   # runs on the backward's thread
    dy = None
    for name in ("default", "single-thread", "switch-1e-5", "default"):
        fw, bw, both = [], [], []
        backward_threads.clear()
        with skip_value_checks(), setting(name):
            for i in range(args.iters + 5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                y = layer(x, cu_seqlens=cu)
                t1 = time.perf_counter()
                dy = torch.ones_like(y) if dy is None else dy
                t2 = time.perf_counter()
                y.backward(dy)
                t3 = time.perf_counter()
                if i >= 5:
                    fw.append(t1 - t0)
                    bw.append(t3 - t2)
                    both.append(t1 - t0 + t3 - t2)
        med = lambda v: round(statistics.median(v) * 1e3, 3)
        print(f"{args.layer} {name:14s} forward {med(fw)} ms  backward {med(bw)} ms  both {med(both)} ms "
              f"(min {round(min(both) * 1e3, 3)}); backward on the "
              f"{'calling' if backward_threads == {threading.get_ident()} else 'autograd device'} thread", flush=True)


if __name__ == "__main__":
    main()
