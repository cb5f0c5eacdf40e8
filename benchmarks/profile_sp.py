"""Where the time of Ulysses goes: a kernel timeline of one rank, all-to-all against compute.

Under torchrun, every rank profiles ``--steps`` steps (after two warm-up steps) of either

- ``--what layer``: one GatedDeltaNet layer under ``sp_group`` = all ranks, forward + backward on this
  rank's slice of a packed ``[1, T, hidden]`` batch (Qwen3-Next's sizes, ``--docs`` documents), or
- ``--what a2a``: ``seq_to_head`` and ``head_to_seq`` alone on the layer's buffers, forward + backward,

with ``torch.profiler`` (CPU and CUDA), a device sync and a barrier between steps. From the trace it
reports per step (median over the steps, rank 0 prints every rank): the span from the first kernel's
start to the last kernel's end, the time some kernel ran (busy), the time NCCL kernels ran, the time
other kernels ran (compute), the part of NCCL time with compute running beside it (overlapped) and
without (exposed), the idle time inside the span, and the top kernels by time. ``--trace DIR`` also
writes each rank's Chrome trace (``trace_rank{r}.json.gz``).

    torchrun --nproc_per_node=2 benchmarks/profile_sp.py --what layer --T 65536 --docs 9
    torchrun --nproc_per_node=2 benchmarks/profile_sp.py --what a2a --T 65536
"""
from __future__ import annotations

import argparse
import sys
import gzip
import json
import os
import random
import statistics
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function
from timing import add_shape_args


def union(intervals):
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def intersect_len(a, b):
    """Length of (union of a) intersected with (union of b)."""
    return union(a) + union(b) - union(a + b)


def analyse(trace_path):
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    marks = sorted((e["ts"], int(e["name"][len("gdn_step"):])) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                   and str(e.get("name", "")).startswith("gdn_step"))
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    starts = [ts for ts, _ in marks] + [float("inf")]
    steps, per_kernel = [], {}
    for i in range(len(marks)):
        ks = [k for k in kernels if starts[i] <= k["ts"] < starts[i + 1]]
        if not ks:
            continue
        iv = lambda sel: [(k["ts"], k["ts"] + k["dur"]) for k in ks if sel(k)]
        nccl = iv(lambda k: "nccl" in k["name"].lower())
        comp = iv(lambda k: "nccl" not in k["name"].lower())
        span = max(e for _, e in nccl + comp) - min(s for s, _ in nccl + comp)
        both = intersect_len(nccl, comp)
        busy = union(nccl + comp)
        steps.append(dict(span=span, busy=busy, nccl=union(nccl), compute=union(comp), overlapped=both,
                          exposed=union(nccl) - both, idle=span - busy))
        for k in ks:
            per_kernel[k["name"]] = per_kernel.get(k["name"], 0.0) + k["dur"] / len(marks)
    keys = ("span", "busy", "nccl", "compute", "overlapped", "exposed", "idle")
    med = {key: statistics.median(s[key] for s in steps) / 1e3 if steps else 0.0 for key in keys}
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    return med, top


def layer_step(args, device):
    from gdn_layer import GatedDeltaNet
    P = dist.get_world_size()
    dt = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layer = GatedDeltaNet(args.hidden, args.k_heads, args.v_heads, args.head_dim, args.head_dim,
                          backend=args.backend, sp_group=dist.group.WORLD, device=device, dtype=dt)
    rnd = random.Random(0)
    cu = torch.tensor([0, *sorted(rnd.sample(range(1, args.T), args.docs - 1)), args.T], device=device,
                      dtype=torch.int32)
    x = torch.randn(1, args.T // P, args.hidden, device=device, dtype=dt, requires_grad=True)

    def step():
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x, cu_seqlens=cu).float().square().mean().backward()
    return step, layer.resolved_backend


def a2a_step(args, device):
    from gdn_layer import GatedDeltaNet
    from gdn_layer.parallel import head_to_seq, seq_to_head
    P = dist.get_world_size()
    dt = getattr(torch, args.dtype)
    group = dist.group.WORLD
    layer = GatedDeltaNet(args.hidden, args.k_heads, args.v_heads, args.head_dim, args.head_dim,
                          sp_group=group, device=device, dtype=dt)
    fi = layer._feature_index(device)
    F = layer.conv_dim + 2 * args.v_heads
    F_local = layer.heads.v_heads_per_rank * args.head_dim
    x = torch.randn(1, args.T // P, F, device=device, dtype=dt, requires_grad=True)
    gy = torch.randn(1, args.T, fi.shape[1], device=device, dtype=dt)
    o = torch.randn(1, args.T, F_local, device=device, dtype=dt, requires_grad=True)
    go = torch.randn(1, args.T // P, P * F_local, device=device, dtype=dt)

    def step():
        x.grad = o.grad = None
        with record_function("seq_to_head"):
            seq_to_head(x, fi, group).backward(gy)
        with record_function("head_to_seq"):
            head_to_seq(o, group).backward(go)
    return step, "none"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--what", choices=["layer", "a2a"], default="layer")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--T", type=int, default=65536, help="global packed tokens")
    ap.add_argument("--docs", type=int, default=9)
    add_shape_args(ap)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--trace", help="also write each rank's Chrome trace here (gzipped)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from requires import require_cuda
    require_cuda("profile_sp.py")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    r = dist.get_rank()
    step, backend = (layer_step if args.what == "layer" else a2a_step)(args, device)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.steps):
            with record_function(f"gdn_step{i}"):
                step()
                torch.cuda.synchronize()
            dist.barrier()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    med, top = analyse(path)
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        with open(path, "rb") as f, gzip.open(os.path.join(args.trace, f"trace_rank{r}.json.gz"), "wb") as g:
            g.write(f.read())
    lines = [f"## rank {r}: {args.what}, T={args.T}, backend={backend}, median of {args.steps} steps (ms)",
             "| span | busy | NCCL | compute | NCCL overlapped | NCCL exposed | idle |", "|---|---|---|---|---|---|---|",
             "| " + " | ".join(f"{med[k]:.2f}" for k in
                              ("span", "busy", "nccl", "compute", "overlapped", "exposed", "idle")) + " |",
             "", "| ms/step | kernel |", "|---|---|"]
    lines += [f"| {us / 1e3:.3f} | {name[:100]} |" for name, us in top[:args.top]]
    report = "\n".join(lines)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if r == 0:
        print("\n\n".join(reports), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
