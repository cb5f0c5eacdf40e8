"""Can a packed layer step at fixed capacity be captured in a CUDA graph? Where does it read the host?

One GatedDeltaNet layer (``--shape``, bf16, ``--backend``), a pack of exactly ``--T`` tokens whose
``cu_seqlens`` is padded to ``--n-max + 1`` entries (``gdn_layer.parallel.pad_cu_seqlens``):

1. the synchronising calls of one eager forward+backward on a NEW cu_seqlens (CUDA sync debug mode,
   counted by their innermost Python frames outside torch: ``profile_finetune.sync_sources``);
2. ``torch.cuda.graph`` around forward+backward on static ``x`` / ``cu_seqlens`` buffers: captured or the
   error and where it was raised; if captured, replayed after ``cu.copy_(...)`` / ``x.copy_(...)`` with
   other packings of the same capacity and compared with eager calls (output and input gradient).

    python scripts/probe_graph_capture.py --backend auto --shape ft --T 8192 --n-max 16
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import torch

from bench_host_cost import SHAPES


def packings(T, n_max, count, seed=0):
    rnd = random.Random(seed)
    out = []
    for _ in range(count):
        n = rnd.randint(1, n_max)
        out.append([0] + sorted(rnd.sample(range(1, T), n - 1)) + [T])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--shape", default="ft", choices=list(SHAPES))
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--n-max", type=int, default=16)
    args = ap.parse_args(argv)
    from requires import require_cuda
    require_cuda("probe_graph_capture.py")
    from graph_step import capture
    from profile_finetune import sync_sources
    from gdn_layer import GatedDeltaNet
    from gdn_layer.kernels import warmup
    from gdn_layer.parallel import pad_cu_seqlens
    H, HK, HV, D = SHAPES[args.shape]
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    layer = GatedDeltaNet(H, HK, HV, D, D, backend=args.backend, device=dev, dtype=dt)
    warmup(layer, include_decode=False, include_states=False)
    print(f"shape {args.shape} backend {layer.resolved_backend} T {args.T} n_max {args.n_max}", flush=True)
    packs = packings(args.T, args.n_max, 4)
    cu_of = lambda p: pad_cu_seqlens(torch.tensor(p, dtype=torch.int32, device=dev), args.n_max)  # noqa: E731
    x = torch.randn(1, args.T, H, device=dev, dtype=dt)
    dy = torch.randn_like(x)

    def eager(cu):
        xi = x.clone().requires_grad_(True)
        layer(xi, cu_seqlens=cu).backward(dy)
        return xi.grad

    eager(cu_of(packs[0]))
    torch.cuda.synchronize()
    print("== synchronising calls of one forward+backward on a new cu_seqlens (count  innermost frames):")
    for site, n in sync_sources(lambda: (eager(cu_of(packs[1])), torch.cuda.synchronize())).most_common():
        print(f"{n:4d}  {site}")

    def compare(label, p, y, x_grad):
        """``y`` and the input gradient of a forward+backward on packing ``p`` against eager calls."""
        want_x = eager(cu_of(p))
        with torch.no_grad():
            want_y = layer(x, cu_seqlens=cu_of(p))
        err = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
        print(f"  {label}N={len(p) - 1}: rel err y {err(y.detach(), want_y):.2e}, x.grad {err(x_grad, want_x):.2e}")

    def failed(what, e):
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/torch/" not in f.filename]
        print(f"{what} FAILED: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        for f in frames[-6:]:
            print(f"    {os.path.basename(f.filename)}:{f.lineno} {f.name}: {f.line}")

    print("== CUDA graph capture of forward+backward", flush=True)
    static_cu, static_x = cu_of(packs[0]).clone(), x.clone().requires_grad_(True)

    def step():
        y = layer(static_x, cu_seqlens=static_cu)
        y.backward(dy)
        return y
    try:
        graph, y = capture(step, before_each=lambda: setattr(static_x, "grad", None))
    except Exception as e:  # noqa: BLE001 - report whatever stops the capture
        return failed("capture", e)
    print("captured; replaying over other packings of the same capacity")
    for p in packs[1:]:
        static_cu.copy_(cu_of(p))
        graph.replay()
        compare("", p, y, static_x.grad)

    print("== torch.compile(mode='reduce-overhead') over the same packings", flush=True)
    try:
        compiled = torch.compile(layer, mode="reduce-overhead")
        cu_buf = cu_of(packs[0]).clone()
        for i, p in enumerate(packs + packs[:1]):
            cu_buf.copy_(cu_of(p))
            layer.zero_grad(set_to_none=True)   # as an optimizer does: a backward may not accumulate into a
            xi = x.clone().requires_grad_(True)  # .grad that the trees' pool holds (docs/performance.md)
            y = compiled(xi, cu_seqlens=cu_buf)
            y.backward(dy)
            compare(f"call {i} ", p, y, xi.grad)
    except Exception as e:  # noqa: BLE001 - report whatever stops it
        failed("reduce-overhead", e)


if __name__ == "__main__":
    main()
