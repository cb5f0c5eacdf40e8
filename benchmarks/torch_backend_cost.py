"""Time and peak memory of the torch backend (the CPU path) on packs that mix one long and many short
documents, and on one very long document; the numbers in docs/kernels.md come from this script.

    OMP_NUM_THREADS=1 python benchmarks/torch_backend_cost.py

Memory is the peak of the bytes held by torch's CPU allocator during the call, above what was held
before it (torch's profiler with ``profile_memory=True``): inputs and weights already allocated do not
count, everything the call allocates (outputs included) does. Time is the best of ``--repeat`` runs
without the profiler. Everything runs in float32 under ``torch.no_grad()``.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import chunk_gated_delta_rule


def peak_bytes(fn) -> int:
    """Peak bytes allocated by torch on the CPU while ``fn()`` runs, above the level before it."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e["args"] for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    if not events:
        return 0
    base = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(e["Total Allocated"] for e in events) - base


def seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def cu_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths]).cumsum(0)


def chunk_kernel_case(lengths: list[int]):
    torch.manual_seed(0)
    T = sum(lengths)
    q, k = torch.randn(1, T, 1, 16), torch.randn(1, T, 1, 16)
    v = torch.randn(1, T, 2, 16)
    g = -torch.rand(1, T, 2) * 0.1
    beta = torch.rand(1, T, 2)
    cu = cu_of(lengths)
    return lambda: chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm=True, backend="torch")


def layer_case(sizes: tuple, lengths: list[int]):
    torch.manual_seed(0)
    layer = GatedDeltaNet(*sizes, backend="torch")
    x = torch.randn(1, sum(lengths), sizes[0])
    cu = cu_of(lengths) if len(lengths) > 1 else None
    return lambda: layer(x, cu_seqlens=cu)


CASES = {
    "chunk kernel Hk=1 Hv=2 D=16, [2048]": lambda: chunk_kernel_case([2048]),
    "chunk kernel Hk=1 Hv=2 D=16, [2048] + 63 x [1]": lambda: chunk_kernel_case([2048] + [1] * 63),
    "GatedDeltaNet(256, 2, 4, 64, 64), [2048]": lambda: layer_case((256, 2, 4, 64, 64), [2048]),
    "GatedDeltaNet(256, 2, 4, 64, 64), [2048] + 127 x [1]": lambda: layer_case((256, 2, 4, 64, 64), [2048] + [1] * 127),
    "GatedDeltaNet(64, 2, 4, 16, 16), [4096]": lambda: layer_case((64, 2, 4, 16, 16), [4096]),
    "GatedDeltaNet(64, 2, 4, 16, 16), [65536]": lambda: layer_case((64, 2, 4, 16, 16), [65536]),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--only", default="", help="run the cases whose name contains this text")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    with torch.no_grad():
        for name, make in CASES.items():
            if args.only not in name:
                continue
            fn = make()
            fn()  # warm-up
            mb = peak_bytes(fn) / 2**20
            print(f"{name:55s} {seconds(fn, args.repeat):8.3f} s  +{mb:8.1f} MB", flush=True)


if __name__ == "__main__":
    main()
