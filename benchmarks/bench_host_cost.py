"""Host cost of one GatedDeltaNet layer call: kernel launches, host time and GPU time per forward+backward.

For each shape (``--shapes``: the fine-tune example's ``ft`` = hidden 576, Hk 4, Hv 8, D 64 and Qwen3-Next's
``qwen3next`` = hidden 2048, Hk 16, Hv 32, D 128) and packed length T (``--T``, default 2k, 8k, 32k; ``--docs``
random documents), bf16, value checks off, after ``gdn_layer.kernels.warmup``:

- ``launches``: kernel launches per forward+backward (``cudaLaunchKernel``, ``cuLaunchKernel(Ex)``,
  ``cudaLaunchKernelExC`` runtime calls counted by ``torch.profiler`` over ``--prof-iters`` calls);
- ``host_ms``: host time to issue one forward+backward (the GPU synced before; clock stopped when
  ``backward()`` returns, before any sync): what the Python and launch path costs;
- ``gpu_ms``: the sum of the kernels' device times per forward+backward (profiler), i.e. the GPU busy time;
- ``wall_ms``: median wall time of one synced forward+backward (CUDA events), over ``--iters``;
- ``host_fwd_nograd_ms`` (JSON only): host time of one forward under ``torch.no_grad``;
- ``graph_ms`` (``--graphs``, our layer only): median wall time of one replay of a CUDA graph holding the
  forward+backward, captured at the pack's capacity (T tokens, ``cu_seqlens`` padded to ``docs + 4``
  segments) and replayed after copying in another packing each time.

If ``host_ms > gpu_ms`` the GPU waits on this layer (the aim: host below GPU at 8k, so that a training step is
bound by the GPU).
A fresh ``cu_seqlens`` tensor is made for every call, as a training loop gets one per step (nothing
derived from an earlier call's is reused), unless ``--same-cu``.

    python benchmarks/bench_host_cost.py [--backend auto] [--T 2048 8192 32768] [--json out.json] [--top 0]

``--top N`` also prints the N host ops with the largest self CPU time and the N most launched kernels
of the first shape and length. ``--pyprof N`` runs N more calls under torch.profiler's Python tracer and
prints the self host time per Python function and op, and summed per package (``_where``: triton, fla,
flash_qla, torch's custom-op and autograd glue, this project, aten ops, CUDA runtime calls); the tracer
slows Python down, so read the shares. ``--breakdown`` times the bodies of the backend functions.
Needs a CUDA GPU (``examples/requires.py``; ``--layer fla`` also fla-core).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))  # graph_step, requires

SHAPES = {"ft": (576, 4, 8, 64), "qwen3next": (2048, 16, 32, 128)}
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def packing(T: int, docs: int, seed: int = 0) -> list[int]:
    rnd = random.Random(seed)
    return [0] + sorted(rnd.sample(range(1, T), docs - 1)) + [T]


def backend_host_ms(call, iters: int) -> dict:
    """Host ms per ``call()`` spent inside each function of the bound backends (the bodies of the
    custom ops: our Triton launchers, fla's / FlashQLA's Python and launches), the GPU synced before
    each call; ``"total"`` is the whole call. The rest is the layer's Python, the custom ops' dispatch
    and autograd, and the aten ops (projections, casts, gradient sums)."""
    from gdn_layer.kernels import registry
    spent: dict = {}
    saved = []
    for b in {id(b): b for b in registry._BACKENDS.values()}.values():
        for field in ("chunk_gated_delta_rule", "chunk_gated_delta_rule_bwd", "causal_conv1d", "causal_conv1d_bwd",
                      "gdn_gate", "gdn_gate_bwd", "gated_rms_norm", "gated_rms_norm_bwd"):
            fn = getattr(b, field, None)
            if fn is None:
                continue

            def timed(*a, _fn=fn, _key=f"{b.name}.{field}", **k):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    spent[_key] = spent.get(_key, 0.0) + time.perf_counter() - t0
            saved.append((b, field, fn))
            object.__setattr__(b, field, timed)
    try:
        total = 0.0
        for _ in range(iters):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            total += time.perf_counter() - t0
        torch.cuda.synchronize()
    finally:
        for b, field, fn in saved:
            object.__setattr__(b, field, fn)
    spent["total"] = total
    return {k: v / iters * 1e3 for k, v in spent.items()}


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = tuple(os.path.join(_REPO, d) + os.sep for d in ("gdn_layer", "kernels", "parallel"))


def _resolve(path: str) -> str:
    """The absolute file of a frame name: torch's tracer cuts any ``sys.path`` prefix off (a checkout on
    ``PYTHONPATH`` gives ``kernels/registry.py``), so a relative name is looked up along ``sys.path``."""
    if os.path.isabs(path):
        return path
    for root in sys.path:
        candidate = os.path.join(os.path.abspath(root or "."), path)
        if os.path.isfile(candidate):
            return candidate
    return path
_PACKAGES = ("triton", "fla", "flash_qla", "tilelang", "torch/_library", "torch/autograd", "torch/_ops",
             "torch/_dynamo", "torch/utils", "gdn_layer")


def _where(name: str) -> str:
    """The package a profiler event belongs to: a Python frame by its file (whole path components: a
    frame of ``flash_qla/`` is not fla's; this checkout's files are ``gdn_layer``'s), an aten op, a CUDA
    runtime call."""
    if ".py(" in name:
        if _resolve(name.split(".py(")[0] + ".py").startswith(_OURS):   # this checkout's package folders
            return "gdn_layer (Python)"
        path = name.split(".py(")[0] + "/"
        for key in _PACKAGES:               # site-packages frames are named from their package, others in full
            if path.startswith(key + "/") or f"/{key}/" in path:
                return key + " (Python)"
        return "other Python"
    if name.startswith("<built-in") or name.startswith("<method"):
        return "builtins called from Python"
    if name.startswith("aten::"):
        return "aten ops (dispatch, allocation)"
    if name.startswith("cu") or name.startswith("Memcpy"):
        return "CUDA runtime calls"
    return "other: " + name[:50]


def python_profile(call, calls: int, top: int, sync=None) -> dict:
    """Self host time per Python function and op over ``calls`` calls (``torch.profiler`` with
    ``with_stack=True``: its Python tracer slows Python down, so read the shares, not the absolute times),
    and the same summed per package (``_where``), which it also returns (ms per call).
    ``sync``: waits for the device (default ``torch.cuda.synchronize``)."""
    sync = torch.cuda.synchronize if sync is None else sync
    for attempt in range(3):
        sync()
        with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
            for _ in range(calls):
                call()
            sync()
        try:
            averages = prof.key_averages()
            break
        except UnicodeDecodeError:   # torch's profiler now and then fails to decode an event name: profile again
            if attempt == 2:
                raise
    rows = [(e.key, e.self_cpu_time_total / calls / 1e3, e.count / calls) for e in averages]
    total = sum(ms for _, ms, _ in rows)
    per = {}
    for name, ms, _ in rows:
        per[_where(name)] = per.get(_where(name), 0.0) + ms
    print(f"self host ms per forward+backward under the Python tracer (total {total:.2f} ms):", flush=True)
    for name, ms in sorted(per.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {ms:7.3f}  {100 * ms / total:5.1f}%  {name}")
    for name, ms, n in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"  {ms:7.3f}  x{n:5.1f}  {name[:150]}")
    return per


def graph_replay_ms(layer, x, dy, T, docs, iters):
    """Median wall time of one replay of the captured forward+backward, a new packing copied in before each."""
    from graph_step import capture
    from gdn_layer.parallel import pad_cu_seqlens
    n_max = docs + 4
    packs = [pad_cu_seqlens(torch.tensor(packing(T, docs, seed=s), dtype=torch.int32, device=x.device), n_max)
             for s in range(4)]
    static_cu = packs[0].clone()
    graph, _ = capture(lambda: layer(x, cu_seqlens=static_cu).backward(dy))
    times = []
    for i in range(iters):
        static_cu.copy_(packs[i % len(packs)])
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(layer, T, docs, iters, prof_iters, same_cu, top, cprofile=0, breakdown=False, graphs=False, pyprof=0):
    from gdn_layer.kernels import warmup
    dev, dt = layer.A_log.device, torch.bfloat16
    cu_list = packing(T, docs)
    x = torch.randn(1, T, layer.hidden_size, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn_like(x)
    cu_fixed = torch.tensor(cu_list, dtype=torch.int32, device=dev)

    fla = not hasattr(layer, "resolved_backend")   # fla's own layer (--layer fla): returns a tuple

    def forward(cu):
        return layer(x, cu_seqlens=cu)[0] if fla else layer(x, cu_seqlens=cu)

    def call():
        cu = cu_fixed if same_cu else torch.tensor(cu_list, dtype=torch.int32, device=dev)
        forward(cu).backward(dy)

    if not fla:
        warmup(layer, include_decode=False, include_states=False)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    host, wall = [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        call()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        torch.cuda.synchronize()
        wall.append(start.elapsed_time(end))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(prof_iters):
            call()
        torch.cuda.synchronize()
    events = prof.events()
    launches = sum(1 for e in events if e.name in LAUNCH_CALLS) / prof_iters
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3 / prof_iters
    host_fwd = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            forward(cu_fixed if same_cu else torch.tensor(cu_list, dtype=torch.int32, device=dev))
        host_fwd.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    if breakdown and not fla:
        print(f"host ms per forward+backward inside each backend function (T={T}, {iters} calls):", flush=True)
        for name, ms in sorted(backend_host_ms(call, iters).items(), key=lambda kv: -kv[1]):
            print(f"  {ms:7.3f}  {name}")
    if pyprof:
        python_profile(call, pyprof, max(top, 40))
    if cprofile:
        import cProfile
        import pstats
        torch.cuda.synchronize()
        with cProfile.Profile() as cp:
            for _ in range(cprofile):
                call()
            torch.cuda.synchronize()
        stats = pstats.Stats(cp)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(45)
    row = {"T": T, "docs": docs, "launches": launches, "host_ms": round(statistics.median(host), 3),
           "host_fwd_nograd_ms": round(statistics.median(host_fwd), 3),
           "gpu_ms": round(gpu_ms, 3), "wall_ms": round(statistics.median(wall), 3),
           "kernels": len(kernels) / prof_iters}
    if graphs and not fla:
        row["graph_ms"] = round(graph_replay_ms(layer, x, dy, T, docs, iters), 3)
    if top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top), flush=True)
        counts = {}
        for e in kernels:
            counts[e.name] = counts.get(e.name, 0) + 1
        for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]:
            print(f"{n / prof_iters:6.1f}  {name[:140]}")
    return row


def main(argv=None):
    class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
        pass
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=Formatter)
    ap.add_argument("--backend", default="auto", help="the layer's backend (ours)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                    help="layer shapes: ft (fine-tune example) and / or qwen3next")
    ap.add_argument("--T", type=int, nargs="+", default=[2048, 8192, 32768], help="packed tokens per call")
    ap.add_argument("--docs", type=int, default=9, help="random documents per pack")
    ap.add_argument("--iters", type=int, default=20, help="timed calls for host_ms and wall_ms (medians)")
    ap.add_argument("--prof-iters", type=int, default=5, help="profiled calls for launches and gpu_ms")
    ap.add_argument("--same-cu", action="store_true", help="one cu_seqlens tensor for every call")
    ap.add_argument("--top", type=int, default=0, help="also print the N host ops with the largest self CPU time "
                    "and the N most launched kernels (first shape and length)")
    ap.add_argument("--cprofile", type=int, default=0, help="also run this many calls of the first shape and "
                    "length under cProfile and print the top Python functions")
    ap.add_argument("--breakdown", action="store_true", help="also print the host time inside each backend "
                    "function of the first shape and length")
    ap.add_argument("--pyprof", type=int, default=0, help="also run this many calls of the first shape and length "
                    "under torch.profiler's Python tracer and print the self host time per function and per package")
    ap.add_argument("--layer", default="ours", choices=["ours", "fla"], help="ours, or fla 0.6's layer "
                    "(fla.layers.GatedDeltaNet, expand_v=1) for comparison")
    ap.add_argument("--graphs", action="store_true", help="also time a CUDA graph replay of forward+backward "
                    "(our layer)")
    ap.add_argument("--mix-graphs", nargs="+", default=["on", "off"], choices=["on", "off"],
                    help="our layer with its token mixing replayed from per-signature CUDA graphs (on, the "
                    "default of the layer) and / or run op by op (off: gdn_layer.mix_graphs.set_enabled(False))")
    ap.add_argument("--label", default="", help="a name printed in each row (e.g. 'before' / 'after')")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    from requires import require_cuda
    require_cuda("bench_host_cost.py", fla=args.layer == "fla")
    from gdn_layer import GatedDeltaNet, mix_graphs
    rows = []
    print("| label | shape | T | docs | launches | host ms | GPU busy ms | wall ms |\n|---|---|---|---|---|---|---|---|",
          flush=True)
    for i, shape in enumerate(args.shapes):
        H, HK, HV, D = SHAPES[shape]
        torch.manual_seed(0)
        if args.layer == "fla":
            from fla.layers import GatedDeltaNet as FlaGDN
            layer = FlaGDN(hidden_size=H, expand_v=1, head_dim=D, num_heads=HK, num_v_heads=HV, mode="chunk",
                           use_short_conv=True).to("cuda", torch.bfloat16)
        else:
            layer = GatedDeltaNet(H, HK, HV, D, D, backend=args.backend, device="cuda", dtype=torch.bfloat16)
        for j, T in enumerate(args.T):
            for mode in (args.mix_graphs if args.layer == "ours" else ["-"]):
                mix_graphs.set_enabled(mode != "off")
                row = measure(layer, T, args.docs, args.iters, args.prof_iters, args.same_cu,
                              args.top if i == j == 0 else 0, args.cprofile if i == j == 0 else 0,
                              args.breakdown and i == j == 0, args.graphs and mode != "on",
                              args.pyprof if i == j == 0 else 0)
                label = f"{args.label} mix graphs {mode}" if args.layer == "ours" else args.label
                row.update(shape=shape, label=label, layer=args.layer, same_cu=args.same_cu, mix_graphs=mode,
                           backend=getattr(layer, "resolved_backend", "fla layer"), mix_stats=mix_graphs.stats())
                rows.append(row)
                print(f"| {label} | {shape} | {T} | {args.docs} | {row['launches']:.0f} | {row['host_ms']} | "
                      f"{row['gpu_ms']} | {row['wall_ms']} |" + (f" graph replay {row['graph_ms']} ms"
                                                                 if "graph_ms" in row else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
