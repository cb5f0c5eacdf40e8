"""GPU compile check: after ``warmup()``, packed layouts of new total length T and sequence count N
compile nothing, on every backend the layer can use.

Starts with empty Triton and TileLang caches (fresh temporary folders, set before either is imported),
builds one GatedDeltaNet layer, times ``gdn_layer.kernels.warmup(layer)``, then runs forward+backward
over 9 packed layouts (few long documents and many short ones, one with an empty segment: on both sides of
FlashQLA's automatic intra-card CP choice, which the backend keeps off because each side compiles its own
kernels) and prints, per layout, the kernels compiled during its first call (files new in the caches, and
Triton JIT compiles counted by ``knobs.runtime.jit_post_compile_hook``) and its first-call vs steady-state
time. Must print 0 new compiles everywhere.

    python benchmarks/compile_check.py --backend auto --dtype bfloat16          # Qwen3-Next's layer shape
    python benchmarks/compile_check.py --backend fla --dtype float32 --head-dim 64
    python benchmarks/compile_check.py --backend auto --no-states      # the training path only (faster cold)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))  # requires


def layouts(seed: int = 0):
    rnd = random.Random(seed)
    out = []
    for T, n in ((32768, 9), (32691, 6), (30000, 1), (31111, 2), (29999, 64), (8192, 3), (4099, 17),
                 (65536, 33)):
        cuts = sorted(rnd.sample(range(1, T), n - 1))
        out.append([0, *cuts, T])
    out.append([0, 4000, 4000, 9000, 16384])          # a zero-length segment (FlashQLA gets the pack without it)
    return out


def count_files(d: str) -> int:
    return sum(len(f) for _, _, f in os.walk(d)) if os.path.isdir(d) else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--k-heads", type=int, default=16)
    ap.add_argument("--v-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-states", action="store_true",
                    help="warmup(include_states=False): build only the stateless training path, and time that")
    ap.add_argument("--workers", type=int, default=None,
                    help="warmup()'s child processes that build kernels in parallel (default: its own choice; 0: none)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)

    caches = {"triton": os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton_")),
              "tilelang": os.environ.setdefault("TILELANG_CACHE_DIR", tempfile.mkdtemp(prefix="tilelang_"))}
    import torch
    from requires import require_cuda
    require_cuda("compile_check.py")
    import triton

    from gdn_layer import GatedDeltaNet
    from gdn_layer.kernels import warmup

    jit_compiles = [0]
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: jit_compiles.__setitem__(0, jit_compiles[0] + 1)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    layer = GatedDeltaNet(args.hidden, args.k_heads, args.v_heads, args.head_dim, args.head_dim,
                          backend=args.backend, device="cuda", dtype=dtype)
    print(f"backend {args.backend!r} -> {layer.resolved_backend!r}; torch {torch.__version__}, triton "
          f"{triton.__version__}; {torch.cuda.get_device_name()}", flush=True)
    files0 = {k: count_files(v) for k, v in caches.items()}
    warm_s = warmup(layer, include_states=not args.no_states, workers=args.workers)
    after_warm = {k: count_files(v) for k, v in caches.items()}
    print(f"warmup: {warm_s:.1f} s, Triton compiles {jit_compiles[0]}, cache files "
          f"{ {k: after_warm[k] - files0[k] for k in caches} }", flush=True)

    rows = []
    for cu in layouts():
        T = cu[-1]
        x = torch.randn(1, T, args.hidden, device="cuda", dtype=dtype, requires_grad=True)
        cut = torch.tensor(cu, device="cuda", dtype=torch.int32)
        before = {k: count_files(v) for k, v in caches.items()}
        jit_before = jit_compiles[0]
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            layer(x, cu_seqlens=cut).float().square().mean().backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        new = {k: count_files(v) - before[k] for k, v in caches.items()}
        rows.append({"T": T, "N": len(cu) - 1, "new_cache_files": new, "new_jit_compiles": jit_compiles[0] - jit_before,
                     "first_call_s": round(times[0], 4), "steady_s": round(min(times[1:]), 4)})
        print(json.dumps(rows[-1]), flush=True)
    total = sum(r["new_jit_compiles"] + sum(r["new_cache_files"].values()) for r in rows)
    print(f"\n| T | N | new compiles (Triton JIT / cache files) | first call s | steady s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['N']} | {r['new_jit_compiles']} / {sum(r['new_cache_files'].values())} | "
              f"{r['first_call_s']} | {r['steady_s']} |")
    print(f"\nwarmup {warm_s:.1f} s; new compiles after warmup over {len(rows)} layouts: {total}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"warmup_s": warm_s, "layouts": rows, "backend": layer.resolved_backend}, f, indent=1)


if __name__ == "__main__":
    main()
