"""One GatedDeltaNet layer on one device vs Ulysses SP vs state-passing CP, at the same global packed length.

Every mode runs the same layer (one set of weights, built with seed 0 and loaded into each variant) on the
same packed input ``[1, T, hidden]`` with the same ``cu_seqlens`` (``--docs`` documents, random cuts, seed 0):

- ``one``: the layer without a group, the whole T on rank 0 (the other ranks wait at a barrier);
- ``sp``: ``sp_group`` = all ranks (Ulysses); rank r passes its contiguous slice ``T/P`` of the input;
- ``cp``: ``cp_group`` = all ranks, sp = 1 (state passing); rank r passes slice r the same way.

For each mode and T: the median of ``--iters`` after ``--warmup`` of the forward alone (``no_grad``) and of
forward + backward (loss ``out.float().square().mean()``), the slowest rank's; CUDA events on GPU,
``perf_counter`` on CPU; every iteration starts after a sync of the ranks involved. Also the peak memory
(``torch.cuda.max_memory_allocated``, the largest rank's), the bytes each rank hands to torch.distributed
collectives in one forward (``timing.count_sent_bytes``), and the speedup ``one / mode`` of forward +
backward. A mode that runs out of GPU memory gives an ``OOM`` row. Rank 0 prints a markdown table
(``--json`` writes it); ``--check`` first prints each mode's max relative error against ``one`` (output and
input gradient, on every rank).

    torchrun --nproc_per_node=2 benchmarks/bench_parallel.py --device cuda --dtype bfloat16 --backend auto \\
        --seq-lens 65536 131072 --docs 9
    torchrun --nproc_per_node=2 benchmarks/bench_parallel.py --device cpu --dtype float32 --backend torch \\
        --seq-lens 512 --hidden 64 --k-heads 2 --v-heads 4 --head-dim 16
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the sibling timing.py

import torch
import torch.distributed as dist

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import warmup
from timing import Timer, add_common_args, count_sent_bytes, init_distributed

MODES = ("one", "sp", "cp")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, iters=10)
    p.add_argument("--backend", default="auto", help="kernel backend of the layer")
    p.add_argument("--docs", type=int, default=9, help="documents per pack (random cuts, seed 0)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--check", action="store_true", help="first compare sp and cp with one (max rel error)")
    p.add_argument("--warmup-kernels", action="store_true",
                   help="first run gdn_layer.kernels.warmup() on each mode's layer (every rank; prints the seconds it took)")
    return p.parse_args(argv)


def build_layers(args, device, modes):
    """``{mode: layer}``, every variant with the weights of one layer built from seed 0."""
    dtype, world = getattr(torch, args.dtype), dist.group.WORLD
    sizes = (args.hidden, args.k_heads, args.v_heads, args.head_dim, args.head_dim)
    torch.manual_seed(0)
    one = GatedDeltaNet(*sizes, backend=args.backend, device=device, dtype=dtype)
    groups = {"one": {}, "sp": {"sp_group": world}, "cp": {"cp_group": world}}
    layers = {}
    for mode in modes:
        layers[mode] = one if mode == "one" else GatedDeltaNet(*sizes, backend=args.backend, device=device,
                                                               dtype=dtype, **groups[mode])
        layers[mode].load_state_dict(one.state_dict())
    return layers


def make_input(T, args, device, mode):
    """This rank's part of the packed input of length T (seed 0, identical on every rank) and the global
    ``cu_seqlens``; ``one`` gets all of it, ``sp`` / ``cp`` rank r its contiguous slice r of P."""
    rnd = random.Random(0)
    cu = torch.tensor([0, *sorted(rnd.sample(range(1, T), args.docs - 1)), T], dtype=torch.int32, device=device)
    gen = torch.Generator(device).manual_seed(0)
    x = torch.randn(1, T, args.hidden, device=device, dtype=getattr(torch, args.dtype), generator=gen)
    if mode != "one":
        P, r = dist.get_world_size(), dist.get_rank()
        x = x[:, r * T // P:(r + 1) * T // P].clone()   # clone: drop the full buffer
    return x.requires_grad_(), cu


def fwd_bwd(layer, x, cu):
    x.grad = None
    layer.zero_grad(set_to_none=True)
    layer(x, cu_seqlens=cu).float().square().mean().backward()


def measure(layer, mode, T, args, device):
    """One row on this rank: times (s), peak bytes, bytes sent in one forward. ``one`` runs on rank 0 only."""
    x, cu = make_input(T, args, device, mode)
    timer = Timer(device, None if mode == "one" else dist.group.WORLD, args.iters, args.warmup)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        fwd = timer(lambda: layer(x, cu_seqlens=cu))
    fwd_bwd_s = timer(lambda: fwd_bwd(layer, x, cu))
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    with torch.no_grad(), count_sent_bytes() as sent:
        layer(x, cu_seqlens=cu)
    layer.zero_grad(set_to_none=True)
    return dict(fwd_ms=fwd * 1e3, fwd_bwd_ms=fwd_bwd_s * 1e3, peak_gb=peak, sent_bytes=sent["bytes"],
                collectives=sent["calls"])


def run_mode(layer, mode, T, args, device):
    """``measure`` on the ranks that take part, OOM caught, the worst rank's numbers on rank 0 (None: OOM)."""
    row, oom = None, 0
    if mode != "one" or dist.get_rank() == 0:
        try:
            row = measure(layer, mode, T, args, device)
        except torch.cuda.OutOfMemoryError:
            # Sizes are the same on every rank, so every rank runs out alike (one rank alone would leave
            # the others in a collective until the NCCL timeout).
            oom = 1
        layer.zero_grad(set_to_none=True)
        gc.collect()                      # the traceback's frames held the activations until here
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if mode == "one":
        dist.barrier()
        return row
    flags = torch.tensor([oom], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags.item():
        return None
    worst = torch.tensor([row["peak_gb"] or 0, row["sent_bytes"]], device=device, dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    row["sent_bytes"] = int(worst[1])
    if row["peak_gb"] is not None:
        row["peak_gb"] = float(worst[0])
    return row


def check(layers, T, args, device):
    """Max relative error (``max|diff| / max|ref|``) of each mode's output and input gradient against ``one``
    run on every rank on the whole input, over all ranks; rank 0 prints them."""
    ref_layer = layers["one"] if "one" in layers else build_layers(args, device, ["one"])["one"]
    x, cu = make_input(T, args, device, "one")
    y = ref_layer(x, cu_seqlens=cu)
    y.float().square().sum().backward()
    P, r = dist.get_world_size(), dist.get_rank()
    lo, hi = r * T // P, (r + 1) * T // P
    for mode in (m for m in args.modes if m != "one"):
        xl = x.detach()[:, lo:hi].clone().requires_grad_()
        yl = layers[mode](xl, cu_seqlens=cu)
        yl.float().square().sum().backward()     # the per-rank sums add up to the global loss
        with torch.no_grad():
            err = torch.stack([(yl - y[:, lo:hi]).abs().max() / y.abs().max(),
                               (xl.grad - x.grad[:, lo:hi]).abs().max() / x.grad.abs().max()]).double()
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        if r == 0:
            print(f"check T={T}: {mode} vs one: max rel error output {err[0]:.2e}, input grad {err[1]:.2e}",
                  flush=True)
        layers[mode].zero_grad(set_to_none=True)
    ref_layer.zero_grad(set_to_none=True)


def table(rows):
    one = {r["T"]: r for r in rows if r["mode"] == "one" and r.get("fwd_bwd_ms")}
    lines = ["| mode | T | fwd ms | fwd+bwd ms | speedup vs one (fwd+bwd) | peak GB | MB sent per rank (fwd) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("oom"):
            lines.append(f"| {r['mode']} | {r['T']} | OOM | OOM | - | - | - |")
            continue
        ratio = f"{one[r['T']]['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x" if r["T"] in one else "-"
        peak = "-" if r["peak_gb"] is None else f"{r['peak_gb']:.2f}"
        lines.append(f"| {r['mode']} | {r['T']} | {r['fwd_ms']:.2f} | {r['fwd_bwd_ms']:.2f} | {ratio} "
                     f"| {peak} | {r['sent_bytes'] / 1e6:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    device = init_distributed(args.device)
    P = dist.get_world_size()
    for T in args.seq_lens:
        if T % P:
            raise ValueError(f"--seq-lens: T = {T} must be divisible by the number of ranks {P}")
        if not 1 <= args.docs <= T:
            raise ValueError(f"--docs must be in [1, T], got {args.docs} for T = {T}")
    layers = build_layers(args, device, args.modes)
    if args.warmup_kernels:
        for mode, layer in layers.items():
            if mode == "one" and dist.get_rank() != 0:
                dist.barrier()
                continue
            seconds = warmup(layer)
            if mode == "one":
                dist.barrier()
            if dist.get_rank() == 0:
                print(f"warmup {mode}: {seconds:.1f} s", flush=True)
    if args.check:
        for T in args.seq_lens:
            check(layers, T, args, device)
    rows = []
    for T in args.seq_lens:
        for mode in args.modes:
            row = run_mode(layers[mode], mode, T, args, device)
            rows.append(dict(mode=mode, T=T, oom=True) if row is None else dict(mode=mode, T=T, **row))
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        backend = next(iter(layers.values())).resolved_backend
        print(f"P={P} device={name} dtype={args.dtype} backend={args.backend}->{backend} hidden={args.hidden} "
              f"Hk={args.k_heads} Hv={args.v_heads} D={args.head_dim} docs={args.docs}; median of {args.iters} "
              f"after {args.warmup} warm-up, slowest rank")
        print(table(rows), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(args=vars(args), P=P, device=name, backend=backend, rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
