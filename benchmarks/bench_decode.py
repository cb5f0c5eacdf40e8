"""Decode-step time of one GatedDeltaNet layer (Qwen3-Next's shape) on one GPU, side by side in one process.

Each sequence is prefilled with ``--prefill`` tokens, then one token per sequence is decoded per step under
``torch.inference_mode``; the time of a step is the CUDA-event time from its first launch to its last kernel's end
(host gaps included), median of ``--steps`` steps after ``--warm`` unmeasured ones. Rows, for each N:

- ``ours_state``: the layer with a ``GDNState`` per step (``state=``, ``output_state=True``), eager;
- ``ours_pool_op``: the layer over a state pool (``state=pool, state_slots=slots``), rows in place, eager and op by
  op (``mix_graphs.paused()``);
- ``ours_pool``: the same eager call as users make it: from its third step it replays a graph by itself
  (gdn_layer/decode_replay.py);
- ``ours_graph``: the same step as one CUDA-graph replay (``gdn_layer.DecodeGraph``, copies in and out included);
- ``fla_layer``: fla's ``GatedDeltaNet`` layer (``expand_v=1``) decoding from its ``Cache``, eager;
- ``fla_ops_graph``: the same step chained by hand from fla's ops (projections, ``causal_conv1d_update``,
  ``fused_recurrent_gated_delta_rule`` with the gate, beta and q/k L2 norm in the kernel, ``FusedRMSNormGated``,
  output projection) with the state rows gathered from and written back to a pool, in one CUDA graph.

    python benchmarks/bench_decode.py --n 1 64 256     # a few minutes: warmup(layer) first compiles every kernel
    python benchmarks/bench_decode.py --warmup none    # compiles only what the decode steps launch
    python benchmarks/bench_decode.py --kernels        # the fused decode kernels alone, per tile config
    python benchmarks/bench_decode.py --profile        # the pool step's kernels and their GPU times
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

H, HK, HV, D, W = 2048, 16, 32, 128, 4


def step_ms(fn, steps, warm):
    for _ in range(warm):
        fn()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graphed(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def fla_ops_step(ours, n, slots, pool_conv, pool_rec, x):
    """One decode step from fla's ops with our layer's weights (split layout), state rows in pools."""
    from fla.modules import FusedRMSNormGated
    from fla.modules.causal_conv1d.ops import causal_conv1d_update
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    w_qkv = torch.cat([ours.in_proj_qkv.weight, ours.in_proj_a.weight, ours.in_proj_b.weight])
    conv_w = ours.conv1d.weight.squeeze(1)
    norm = FusedRMSNormGated(D, eps=1e-6).to("cuda", torch.bfloat16)
    kd, vd = HK * D, HV * D

    def step():
        mixed = F.linear(x, w_qkv)                                         # [n, 1, C + 2 Hv]
        z = F.linear(x, ours.in_proj_z.weight).view(n, 1, HV, D)
        conv = pool_conv.index_select(0, slots)                            # [n, C, W]
        qkv, _ = causal_conv1d_update(mixed[..., :2 * kd + vd], conv, weight=conv_w, activation="silu")
        pool_conv.index_copy_(0, slots, conv)
        q, k, v = qkv.view(1, n, -1).split([kd, kd, vd], -1)
        a, b = mixed[..., 2 * kd + vd:].view(1, n, 2, HV).unbind(2)
        h0 = pool_rec.index_select(0, slots)
        o, ht = fused_recurrent_gated_delta_rule(
            q.view(1, n, HK, D), k.view(1, n, HK, D), v.view(1, n, HV, D), g=a, beta=b, initial_state=h0,
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=ours.A_log,
            dt_bias=ours.dt_bias, use_beta_sigmoid_in_kernel=True,
            cu_seqlens=torch.arange(n + 1, device="cuda"))
        pool_rec.index_copy_(0, slots, ht)
        return F.linear(norm(o.view(n, 1, HV, D), z).view(n, 1, vd), ours.out_proj.weight)
    return step


def run(n, args):
    from fla.layers import GatedDeltaNet as FlaGDN
    from fla.models.cache_utils import Cache

    from gdn_layer import DecodeGraph, GatedDeltaNet, mix_graphs
    from gdn_layer.kernels import warmup
    torch.manual_seed(0)
    dt = torch.bfloat16
    ours = GatedDeltaNet(H, HK, HV, D, D, backend=args.backend, device="cuda", dtype=dt).eval()
    fla = FlaGDN(hidden_size=H, expand_v=1, head_dim=D, num_heads=HK, num_v_heads=HV, mode="chunk",
                 use_short_conv=True, layer_idx=0).to("cuda", dt).eval()
    if n == args.n[0] and args.warmup == "full":
        warmup(ours)
    prompt = torch.randn(n, args.prefill, H, device="cuda", dtype=dt)
    x = torch.randn(n, 1, H, device="cuda", dtype=dt)
    slots = torch.randperm(2 * n, device="cuda")[:n]
    res = {}
    with torch.inference_mode():
        _, state = ours(prompt, output_state=True)
        res["ours_state"] = step_ms(lambda: ours(x, state=state, output_state=True), args.steps, args.warm)
        pool = ours.new_state(2 * n)
        ours(prompt, state=pool, state_slots=slots)
        with mix_graphs.paused():
            res["ours_pool_op"] = step_ms(lambda: ours(x, state=pool, state_slots=slots), args.steps, args.warm)
        res["ours_pool"] = step_ms(lambda: ours(x, state=pool, state_slots=slots), args.steps, args.warm)
        graph = DecodeGraph(ours, pool, n)
        res["ours_graph"] = step_ms(lambda: graph(x, slots), args.steps, args.warm)
        cache = Cache()
        fla(prompt, past_key_values=cache, use_cache=True)
        res["fla_layer"] = step_ms(lambda: fla(x, past_key_values=cache, use_cache=True), args.steps, args.warm)
        pool_conv = torch.randn(2 * n, 2 * HK * D + HV * D, W, device="cuda", dtype=dt)
        pool_rec = torch.randn(2 * n, HV, D, D, device="cuda", dtype=torch.float32) * 0.01
        try:
            replay = graphed(fla_ops_step(ours, n, slots, pool_conv, pool_rec, x))
            res["fla_ops_graph"] = step_ms(replay, args.steps, args.warm)
        except Exception as e:   # noqa: BLE001 - a baseline that does not run is reported, not fatal
            print(f"fla_ops_graph at N = {n} failed: {type(e).__name__}: {e}", flush=True)
            res["fla_ops_graph"] = float("nan")
    row = {"N": n, **{k: round(v, 4) for k, v in res.items()},
           "graph_vs_fla_ops": round(res["ours_graph"] / res["fla_ops_graph"], 2)}
    print(json.dumps(row), flush=True)
    return row


def sweep_kernels(args):
    """The two fused decode kernels alone (kernels/triton/decode.py), graph-replayed, per (BV_MAX, NUM_WARPS,
    CONV_BC): us per step and the state rows' traffic in GB/s (read + written, fp32)."""
    from gdn_layer.kernels.triton import decode
    C = 2 * HK * D + HV * D
    rows = []
    for n in args.n:
        torch.manual_seed(0)
        mixed = torch.randn(n, C + 2 * HV, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(C, W, device="cuda", dtype=torch.bfloat16)
        A_log, dt_bias = torch.rand(HV, device="cuda"), torch.rand(HV, device="cuda")
        conv = torch.randn(2 * n, C, W - 1, device="cuda")
        rec = torch.randn(2 * n, HV, D, D, device="cuda") * 0.01
        slots = torch.randperm(2 * n, device="cuda")[:n]
        for bv in (16, 32, 64):
            for warps in (2, 4, 8):
                for bc in (64, 128, 256):
                    if bc != 128 and (bv, warps) != (32, 4):
                        continue
                    decode.BV_MAX, decode.NUM_WARPS, decode.CONV_BC = bv, warps, bc
                    def fn():
                        return decode.decode_step(mixed, weight, A_log, dt_bias, conv, rec, slots, HK, HV, D, D)
                    us = 1000 * step_ms(graphed(fn), args.steps, args.warm)
                    gbs = n * HV * D * D * 4 * 2 / us / 1e3
                    rows.append({"N": n, "BV_MAX": bv, "NUM_WARPS": warps, "CONV_BC": bc, "us": round(us, 2),
                                 "state_GB_s": round(gbs, 1)})
                    print(json.dumps(rows[-1]), flush=True)
    for n in args.n:
        best = min((r for r in rows if r["N"] == n), key=lambda r: r["us"])
        print("best at N =", n, json.dumps(best), flush=True)
    return rows


def profile_step(args):
    """The eager pool step's kernels at each N (torch.profiler): name, launches, GPU us per step."""
    from torch.profiler import ProfilerActivity, profile

    from gdn_layer import GatedDeltaNet
    ours = GatedDeltaNet(H, HK, HV, D, D, backend=args.backend, device="cuda", dtype=torch.bfloat16).eval()
    for n in args.n:
        x = torch.randn(n, 1, H, device="cuda", dtype=torch.bfloat16)
        pool = ours.new_state(2 * n)
        slots = torch.randperm(2 * n, device="cuda")[:n]
        with torch.inference_mode():
            for _ in range(args.warm):
                ours(x, state=pool, state_slots=slots)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    ours(x, state=pool, state_slots=slots)
                torch.cuda.synchronize()
        print(f"N = {n}: kernels of 10 eager pool steps", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1, 64, 256], help="sequences decoded per step")
    p.add_argument("--prefill", type=int, default=256, help="tokens per sequence before decoding")
    p.add_argument("--steps", type=int, default=50, help="measured steps (median)")
    p.add_argument("--warm", type=int, default=10, help="unmeasured steps first")
    p.add_argument("--backend", default="auto", help="our kernel backend")
    p.add_argument("--warmup", choices=("full", "none"), default="full",
                   help="full: warmup(layer) first (every kernel the layer can launch; minutes cold); none: only "
                        "the --warm eager steps compile what the measured steps launch")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--kernels", action="store_true", help="only the fused decode kernels, per tile config")
    p.add_argument("--profile", action="store_true", help="only the eager pool step's kernels (torch.profiler)")
    args = p.parse_args()
    if args.kernels or args.profile:
        rows = sweep_kernels(args) if args.kernels else profile_step(args)
        if args.json and rows:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    rows = [run(n, args) for n in args.n]
    print("\n| N | ours, GDNState eager | ours, pool op by op | ours, pool eager | ours, pool graph | fla layer eager | "
          "fla ops graph | graph / fla ops |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['N']} | {r['ours_state']:.3f} | {r['ours_pool_op']:.3f} | {r['ours_pool']:.3f} | "
              f"{r['ours_graph']:.3f} | "
              f"{r['fla_layer']:.3f} | {r['fla_ops_graph']:.3f} | {r['graph_vs_fla_ops']:.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
