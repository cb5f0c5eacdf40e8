"""CUDA-kernel time breakdown of one GatedDeltaNet layer forward+backward: ours and fla 0.6's layer.

Same shapes and input as examples/bench_vs_fla.py (Qwen3-Next: hidden 2048, Hk 16, Hv 32, D 128, bf16,
packed T in --docs documents). After two warm-up steps, torch.profiler records --steps steps; prints the
top kernels by total CUDA time per step, and the sum over all kernels. Needs CUDA and fla-core.

    FLA_FLASH_QLA=0 python3 scripts/profile_layer.py --backend fla --T 32768 --docs 9
"""
import argparse
import os
import random
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))  # requires


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--docs", type=int, default=9)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=22)
    args = ap.parse_args()
    from requires import require_cuda
    require_cuda("profile_layer.py", fla=True)
    from fla.layers import GatedDeltaNet as FlaGDN

    from gdn_layer import GatedDeltaNet
    H, HK, HV, D, dt = 2048, 16, 32, 128, torch.bfloat16
    rnd = random.Random(0)
    cu = torch.tensor([0, *sorted(rnd.sample(range(1, args.T), args.docs - 1)), args.T], device="cuda",
                      dtype=torch.int32)
    x = torch.randn(1, args.T, H, device="cuda", dtype=dt, requires_grad=True)
    torch.manual_seed(0)
    ours = GatedDeltaNet(H, HK, HV, D, D, backend=args.backend, device="cuda", dtype=dt)
    fla = FlaGDN(hidden_size=H, expand_v=1, head_dim=D, num_heads=HK, num_v_heads=HV, mode="chunk",
                 use_short_conv=True).to("cuda", dt)
    for name, step in (("ours (" + ours.resolved_backend + ")", lambda: ours(x, cu_seqlens=cu)),
                       ("fla layer", lambda: fla(x, cu_seqlens=cu)[0])):
        for _ in range(2):
            step().float().square().mean().backward()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step().float().square().mean().backward()
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / args.steps / 1e3, e.count // args.steps)
                for e in prof.key_averages() if e.device_time_total > 0]
        rows.sort(key=lambda r: -r[1])
        total = sum(r[1] for r in rows)
        print(f"\n## {name}: {total:.2f} ms of CUDA kernels per fwd+bwd step (T={args.T}, docs={args.docs})")
        print("| ms/step | calls | kernel |\n|---|---|---|")
        for key, ms, n in rows[:args.top]:
            print(f"| {ms:.3f} | {n} | {key[:90]} |")


if __name__ == "__main__":
    main()
