"""One GatedDeltaNet layer, ours vs fla 0.6's ``fla.layers.GatedDeltaNet``, side by side in one process.

Same shapes (Qwen3-Next: hidden 2048, Hk 16, Hv 32, Dk = Dv = 128, conv 4; fla's ``expand_v=1``), same
packed bf16 input, forward and forward+backward timed with ``triton.testing.do_bench`` (median), peak
memory of one forward+backward each, the order alternated. fla's chunk op hands itself to FlashQLA
unless ``FLA_FLASH_QLA=0``; set that to compare the Triton paths.

What a forward+backward is (``--grad``): ``output`` (the default) times the layer as it runs inside a model:
``y.backward(dy)`` with a random bf16 ``dy`` drawn once, the input's and parameters' gradients set to None
before each timed call (``do_bench(grad_to_none=...)``, as after ``zero_grad()``). ``loss`` backpropagates
``y.float().square().mean()`` with gradients accumulating across calls, which adds the same ≈ 1.2 ms of fp32
loss kernels and gradient sums to both layers at T = 32k (docs/performance.md).

    python benchmarks/bench_vs_fla.py --backend fla --T 32768 --docs 9
    python benchmarks/bench_vs_fla.py --backend fla --max-tokens      # largest pack of 32k documents that fits

``--max-tokens`` instead runs one forward+backward per layer at growing packed lengths (documents of
32 768 tokens) until the GPU runs out of memory, and prints the largest that fit, its peak memory and time.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))  # requires


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--backend", default="auto", help="our layer's backend")
    ap.add_argument("--T", type=int, nargs="+", default=[32768], help="packed lengths, one table row each")
    ap.add_argument("--docs", type=int, default=9, help="documents per pack (random boundaries, seed 0)")
    ap.add_argument("--rep", type=int, default=1000,
                    help="do_bench's timing budget per measurement, ms: about rep / step time timed steps, whose median is reported (at 100 only 6 steps at 32k and 1 at 128k would be timed)")
    ap.add_argument("--grad", choices=["output", "loss"], default="output",
                    help="backward from a random output gradient, or from the fp32 square-mean loss with gradients accumulating")
    ap.add_argument("--max-tokens", action="store_true", help="search the largest packed T that fits instead")
    ap.add_argument("--layers", nargs="+", default=["ours", "fla"], choices=["ours", "fla"],
                    help="with --max-tokens: which layers to search")
    args = ap.parse_args(argv)
    from requires import require_cuda
    require_cuda("bench_vs_fla.py", fla=True)
    if args.max_tokens:
        return max_tokens(args)
    H, HK, HV, D, dt = 2048, 16, 32, 128, torch.bfloat16
    made = make_layers(args.backend, H, HK, HV, D, dt)
    print(f"ours: backend {args.backend!r} -> {made['ours'][0].resolved_backend!r}; backward from "
          f"{'a random output gradient' if args.grad == 'output' else 'y.float().square().mean()'}", flush=True)
    rows = [compare_at(T, args, made, H, dt) for T in args.T]
    print("\n| T | docs | fwd ms ours / fla | ratio | fwd+bwd ms ours / fla | ratio | peak GB ours / fla |\n"
          "|---|---|---|---|---|---|---|")
    for T, o, f in rows:
        print(f"| {T} | {args.docs} | {o['fwd_ms']} / {f['fwd_ms']} | {o['fwd_ms'] / f['fwd_ms']:.2f} | "
              f"{o['fwdbwd_ms']} / {f['fwdbwd_ms']} | {o['fwdbwd_ms'] / f['fwdbwd_ms']:.2f} | "
              f"{o['peak_gb']} / {f['peak_gb']} |")


def compare_at(T, args, made, H, dt):
    """Both layers at packed length T (--docs random documents): fwd / fwd+bwd median ms, peak GB."""
    rnd = random.Random(0)
    cut = torch.tensor([0, *sorted(rnd.sample(range(1, T), args.docs - 1)), T], device="cuda", dtype=torch.int32)
    x = torch.randn(1, T, H, device="cuda", dtype=dt, requires_grad=True)
    dy = torch.randn(1, T, H, device="cuda", dtype=dt)
    res = {}
    for name in ["ours", "fla", "ours", "fla"]:          # alternate; the second round is the one kept
        m, call = made[name]
        run = lambda: call(m, x, cut)
        if args.grad == "output":
            fwdbwd, fresh = lambda: run().backward(dy), [x, *m.parameters()]
        else:
            fwdbwd, fresh = lambda: run().float().square().mean().backward(), None
        fwdbwd(); torch.cuda.synchronize()
        for t in fresh or ():
            t.grad = None
        torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        fwdbwd(); torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 1e9
        with torch.no_grad():
            f = triton.testing.do_bench(run, warmup=10, rep=args.rep, return_mode="median")
        fb = triton.testing.do_bench(fwdbwd, warmup=10, rep=args.rep, grad_to_none=fresh, return_mode="median")
        res[name] = {"fwd_ms": round(f, 3), "fwdbwd_ms": round(fb, 3), "peak_gb": round(peak, 3)}
        print(T, name, json.dumps(res[name]), flush=True)
    for m, _ in made.values():
        m.zero_grad(set_to_none=True)
    return T, res["ours"], res["fla"]


def make_layers(backend, H, HK, HV, D, dt):
    from fla.layers import GatedDeltaNet as FlaGDN

    from gdn_layer import GatedDeltaNet
    torch.manual_seed(0)
    return {"ours": (GatedDeltaNet(H, HK, HV, D, D, backend=backend, device="cuda", dtype=dt),
                     lambda m, x, cu: m(x, cu_seqlens=cu)),
            "fla": (FlaGDN(hidden_size=H, expand_v=1, head_dim=D, num_heads=HK, num_v_heads=HV, mode="chunk",
                           use_short_conv=True).to("cuda", dt), lambda m, x, cu: m(x, cu_seqlens=cu)[0])}


def max_tokens(args, sizes=(262144, 524288, 786432, 917504, 1048576, 1310720, 1572864, 2097152)):
    """Per layer: one forward+backward at each packed T (documents of 32k) until out of memory."""
    import time
    H, HK, HV, D, dt = 2048, 16, 32, 128, torch.bfloat16
    layers = make_layers(args.backend, H, HK, HV, D, dt)
    for name in list(layers):
        m, call = layers.pop(name)
        if name not in args.layers:
            continue
        best = None
        for T in sizes:
            x = cu = None
            try:
                cu = torch.arange(0, T + 1, 32768, device="cuda", dtype=torch.int32)
                x = torch.randn(1, T, H, device="cuda", dtype=dt, requires_grad=True)
                torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                call(m, x, cu).float().square().mean().backward()
                torch.cuda.synchronize()
                best = (T, torch.cuda.max_memory_allocated() / 1e9, time.perf_counter() - t0)
                print(f"{name}: T={T} fits, peak {best[1]:.1f} GB, {best[2]:.2f} s", flush=True)
            except torch.cuda.OutOfMemoryError:
                print(f"{name}: T={T} out of memory", flush=True)
                break
            finally:
                del x, cu
                m.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
        print(f"{name}: largest packed T that fits: {best}", flush=True)
        del m
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
