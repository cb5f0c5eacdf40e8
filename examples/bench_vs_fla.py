"""One GatedDeltaNet layer, ours vs fla 0.6's ``fla.layers.GatedDeltaNet``, side by side in one process.

Same shapes (Qwen3-Next: hidden 2048, Hk 16, Hv 32, Dk = Dv = 128, conv 4; fla's ``expand_v=1``), same
packed bf16 input, forward and forward+backward timed with ``triton.testing.do_bench`` (median), peak
memory of one forward+backward each, the order alternated. fla's chunk op hands itself to FlashQLA
unless ``FLA_FLASH_QLA=0``; set that to compare the Triton paths.

    python examples/bench_vs_fla.py --backend fla --T 32768 --docs 9
"""
from __future__ import annotations

import argparse
import json
import random

import torch
import triton


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="auto", help="our layer's backend")
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--docs", type=int, default=9)
    ap.add_argument("--rep", type=int, default=100, help="do_bench repetition time, ms")
    args = ap.parse_args(argv)
    from fla.layers import GatedDeltaNet as FlaGDN

    from gdn_layer import GatedDeltaNet
    H, HK, HV, D, dt = 2048, 16, 32, 128, torch.bfloat16
    rnd = random.Random(0)
    cu = [0, *sorted(rnd.sample(range(1, args.T), args.docs - 1)), args.T]
    cut = torch.tensor(cu, device="cuda", dtype=torch.int32)
    x = torch.randn(1, args.T, H, device="cuda", dtype=dt, requires_grad=True)
    torch.manual_seed(0)
    layers = {
        "ours": (GatedDeltaNet(H, HK, HV, D, D, backend=args.backend, device="cuda", dtype=dt),
                 lambda m: m(x, cu_seqlens=cut)),
        "fla": (FlaGDN(hidden_size=H, expand_v=1, head_dim=D, num_heads=HK, num_v_heads=HV, mode="chunk",
                       use_short_conv=True).to("cuda", dt), lambda m: m(x, cu_seqlens=cut)[0]),
    }
    print(f"ours: backend {args.backend!r} -> {layers['ours'][0].resolved_backend!r}", flush=True)
    res = {}
    for name in ["ours", "fla", "ours", "fla"]:          # alternate; the second round is the one kept
        m, call = layers[name]
        fwdbwd = lambda: call(m).float().square().mean().backward()
        fwdbwd(); torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        fwdbwd(); torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 1e9
        with torch.no_grad():
            f = triton.testing.do_bench(lambda: call(m), warmup=10, rep=args.rep, return_mode="median")
        fb = triton.testing.do_bench(fwdbwd, warmup=10, rep=args.rep, return_mode="median")
        res[name] = {"fwd_ms": round(f, 3), "fwdbwd_ms": round(fb, 3), "peak_gb": round(peak, 3)}
        print(name, json.dumps(res[name]), flush=True)
    o, f = res["ours"], res["fla"]
    print(f"\nT={args.T} docs={args.docs}: fwd {o['fwd_ms']} vs {f['fwd_ms']} ms ({o['fwd_ms'] / f['fwd_ms']:.2f}x), "
          f"fwd+bwd {o['fwdbwd_ms']} vs {f['fwdbwd_ms']} ms ({o['fwdbwd_ms'] / f['fwdbwd_ms']:.2f}x), "
          f"peak {o['peak_gb']} vs {f['peak_gb']} GB")


if __name__ == "__main__":
    main()
