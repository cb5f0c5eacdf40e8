"""Ulysses all-to-all pair vs a raw ``all_to_all_single`` of the same bytes, at the layer's own buffers.

``seq_to_head`` moves the layer's packed ``[q | k | v | a | b]`` buffer ``[1, T/P, 2*Hk*Dk + Hv*Dv + 2*Hv]``
with the layer's real ``_feature_index``; ``head_to_seq`` moves the kernel output ``[1, T, Hv/P * Dv]``.
Each is timed forward alone and forward + backward, next to one ``all_to_all_single`` of a buffer of
the same size (what the collective alone costs) and one ``batch_isend_irecv`` of the peers' equal blocks
of it (what our point-to-point exchange posts). Median of ``--iters`` after ``--warmup``; CUDA events
on GPU, ``perf_counter`` on CPU; every iteration starts after a sync of all ranks, and the table gives
the slowest rank's median. A second table times the layer's way in: the input projection (hidden ->
the packed buffer) as one GEMM followed by ``seq_to_head``, against ``project_seq_to_head`` (the GEMM
writes the send buffer itself), forward+backward. Rank 0 prints the tables (and ``--json`` writes them).

    torchrun --nproc_per_node=2 benchmarks/bench_all_to_all.py --device cuda --dtype bfloat16 --seq-lens 65536 131072
    torchrun --nproc_per_node=2 benchmarks/bench_all_to_all.py --device cpu --dtype float32 --seq-lens 256 \\
        --hidden 64 --k-heads 2 --v-heads 4 --head-dim 16
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # the sibling timing.py

import torch
import torch.distributed as dist

from gdn_layer import GatedDeltaNet
from gdn_layer.parallel import head_to_seq, project_seq_to_head, seq_to_head
from timing import Timer, add_common_args, init_distributed


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(p, iters=20)
    return p.parse_args(argv)


def raw_all_to_all(numel, dtype, device, group):
    """One all_to_all_single of a contiguous buffer of ``numel`` elements (split equally)."""
    send = torch.randn(numel, device=device).to(dtype)
    recv = torch.empty_like(send)
    return lambda: dist.all_to_all_single(recv, send, group=group)


def raw_p2p(numel, dtype, device, group):
    """The peers' equal blocks of a ``numel`` buffer in one ``batch_isend_irecv`` (what our exchange
    posts, the block a rank keeps left out), waited for."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    send = torch.randn(numel, device=device).to(dtype).view(P, -1)
    recv = torch.empty_like(send)
    ops = [op for d in range(P) if d != me
           for op in (dist.P2POp(dist.irecv, recv[d], group=group, group_peer=d),
                      dist.P2POp(dist.isend, send[d], group=group, group_peer=d))]

    def run():
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return run


def bench_one(T, args, feature_index, F, F_local, timer, group):
    P, device, dtype = dist.get_world_size(group), timer.device, getattr(torch, args.dtype)
    T_local = T // P
    # seq_to_head on the layer's packed buffer
    x = torch.randn(1, T_local, F, device=device, dtype=dtype, requires_grad=True)
    gy = torch.randn(1, T, feature_index.shape[1], device=device, dtype=dtype)

    def s2h_fwd():
        seq_to_head(x, feature_index, group)

    def s2h_fwd_bwd():
        x.grad = None
        seq_to_head(x, feature_index, group).backward(gy)

    s2h_bytes = P * T_local * feature_index.shape[1] * x.element_size()   # send buffer of one rank
    row = dict(T=T, s2h_fwd=timer(s2h_fwd), s2h_fwd_bwd=timer(s2h_fwd_bwd),
               s2h_raw=timer(raw_all_to_all(s2h_bytes // x.element_size(), dtype, device, group)),
               s2h_p2p=timer(raw_p2p(s2h_bytes // x.element_size(), dtype, device, group)),
               s2h_mb=s2h_bytes / 1e6)
    del x
    # the layer's path: its input projection feeding the all-to-all, as a GEMM then seq_to_head, and
    # written straight into the send buffer (project_seq_to_head)
    h = torch.randn(1, T_local, args.hidden, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(F, args.hidden, device=device, dtype=dtype, requires_grad=True)

    def proj(fused):
        def run():
            h.grad = w.grad = None
            out = (project_seq_to_head(h, w, feature_index, group) if fused
                   else seq_to_head(torch.nn.functional.linear(h, w), feature_index, group))
            out.backward(gy)
        return run

    row.update(proj_then_s2h_fwd_bwd=timer(proj(False)), proj_into_send_fwd_bwd=timer(proj(True)))
    del h, w, gy
    # head_to_seq on the kernel output of this rank's value heads
    o = torch.randn(1, T, F_local, device=device, dtype=dtype, requires_grad=True)
    go = torch.randn(1, T_local, P * F_local, device=device, dtype=dtype)

    def h2s_fwd():
        head_to_seq(o, group)

    def h2s_fwd_bwd():
        o.grad = None
        head_to_seq(o, group).backward(go)

    row.update(h2s_fwd=timer(h2s_fwd), h2s_fwd_bwd=timer(h2s_fwd_bwd),
               h2s_raw=timer(raw_all_to_all(o.numel(), dtype, device, group)),
               h2s_p2p=timer(raw_p2p(o.numel(), dtype, device, group)),
               h2s_mb=o.numel() * o.element_size() / 1e6)
    return row


def fmt(s):
    return f"{s * 1e3:.2f} ms"


def main(argv=None):
    args = parse_args(argv)
    device = init_distributed(args.device)
    group = dist.group.WORLD
    P = dist.get_world_size()
    layer = GatedDeltaNet(args.hidden, args.k_heads, args.v_heads, args.head_dim, args.head_dim,
                          sp_group=group, device=device, dtype=getattr(torch, args.dtype))
    feature_index = layer._feature_index(device)          # the rows the layer itself sends
    F = layer.conv_dim + 2 * args.v_heads
    F_local = layer.heads.v_heads_per_rank * args.head_dim
    del layer
    timer = Timer(device, group, args.iters, args.warmup)
    rows = []
    for T in args.seq_lens:
        if T % P:
            raise ValueError(f"--seq-lens: T = {T} must be divisible by the number of ranks {P}")
        rows.append(bench_one(T, args, feature_index, F, F_local, timer, group))
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"P={P} device={name} dtype={args.dtype} hidden={args.hidden} Hk={args.k_heads} "
              f"Hv={args.v_heads} D={args.head_dim}; median of {args.iters} after {args.warmup} warm-up, slowest rank")
        print("| global T | seq_to_head fwd | seq_to_head fwd+bwd | raw a2a of its bytes | raw p2p "
              "| head_to_seq fwd | head_to_seq fwd+bwd | raw a2a | raw p2p |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['T']} | {fmt(r['s2h_fwd'])} ({r['s2h_fwd'] / r['s2h_raw']:.2f}x) "
                  f"| {fmt(r['s2h_fwd_bwd'])} ({r['s2h_fwd_bwd'] / r['s2h_raw']:.2f}x) | {fmt(r['s2h_raw'])} "
                  f"({r['s2h_mb']:.3g} MB) | {fmt(r['s2h_p2p'])} | {fmt(r['h2s_fwd'])} ({r['h2s_fwd'] / r['h2s_raw']:.2f}x) "
                  f"| {fmt(r['h2s_fwd_bwd'])} ({r['h2s_fwd_bwd'] / r['h2s_raw']:.2f}x) | {fmt(r['h2s_raw'])} "
                  f"({r['h2s_mb']:.3g} MB) | {fmt(r['h2s_p2p'])} |", flush=True)
        print("\n| global T | projection GEMM + seq_to_head, fwd+bwd | project_seq_to_head (GEMM into the send buffer), fwd+bwd |")
        print("|---|---|---|")
        for r in rows:
            print(f"| {r['T']} | {fmt(r['proj_then_s2h_fwd_bwd'])} | {fmt(r['proj_into_send_fwd_bwd'])} |", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(args=vars(args), P=P, device=name, rows=rows), f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
