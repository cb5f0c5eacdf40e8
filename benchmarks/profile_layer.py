"""CUDA-kernel time breakdown of one GatedDeltaNet layer forward+backward: ours and fla 0.6's layer.

Same shapes and input as benchmarks/bench_vs_fla.py (Qwen3-Next: hidden 2048, Hk 16, Hv 32, D 128, bf16,
packed T in --docs documents). After two warm-up steps, torch.profiler records --steps steps; prints the
top kernels by total CUDA time per step, and the sum over all kernels. Needs CUDA and fla-core.

    FLA_FLASH_QLA=0 python3 benchmarks/profile_layer.py --backend fla --T 32768 --docs 9
    python3 benchmarks/profile_layer.py --only ours --gaps --why "Memcpy|direct_copy|elementwise"

``--gaps``: the time the GPU sat idle inside the profiled steps (the span from the first kernel's start to the
last one's end, less the kernels' union), the largest idle gaps with the kernels around them, and the host
synchronisations (``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, device-to-host
copies) with the aten ops they ran in. ``--why PATTERN``: for each kernel whose name matches the regular
expression, the aten ops and Python frames that launched it (one line per distinct origin, with its time).

``--loop N``: N more steps as ``triton.testing.do_bench`` times them in benchmarks/bench_vs_fla.py (a 256 MB L2 clear
before each, CUDA events around it), run twice. Unprofiled: the events' median / min / max ms per step, and the
host's time to issue a step (``fwdbwd()`` called until it returns, no sync). Profiled, one row per step: the events'
ms and the host ms of that run (the profiler slows the host), the GPU window (from the end of the step's L2-clear
kernel to the start of the next clear: it holds the backward's kernels, which autograd's thread launches), the
kernels' busy time and the idle time inside it, and its largest idle gap with the kernels on either side; before the
table, each kernel's time per step inside the windows and their total (compare with the back-to-back table above).
With ``--grad output`` (default) each step sets the gradients to None first, as do_bench's ``grad_to_none``; with
``--grad loss`` they accumulate, as in bench_vs_fla.py's ``--grad loss``.
"""
import argparse
import collections
import json
import os
import random
import re
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))  # requires
from profile_sp import intersect_len, union  # noqa: E402  (the interval arithmetic of the SP profile)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--backend", default="auto", help="our layer's backend")
    ap.add_argument("--T", type=int, default=32768, help="packed tokens")
    ap.add_argument("--docs", type=int, default=9, help="documents per pack (random boundaries, seed 0)")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps (after two warm-up steps)")
    ap.add_argument("--top", type=int, default=22, help="kernels listed")
    ap.add_argument("--only", choices=["ours", "fla"], help="profile one layer only")
    ap.add_argument("--grad", choices=["output", "loss"], default="output",
                    help="backward from a random output gradient (grads set to None before each step), or from "
                         "y.float().square().mean() with gradients accumulating")
    ap.add_argument("--gaps", action="store_true", help="GPU idle time in the steps, its largest gaps, host syncs")
    ap.add_argument("--why", metavar="PATTERN", help="the aten ops / Python frames launching matching kernels")
    ap.add_argument("--loop", type=int, metavar="N",
                    help="also N steps as triton.testing.do_bench times them (L2 flushed, CUDA events around each "
                         "step), unprofiled (events' and host's ms per step) and profiled (per step: events, host, GPU "
                         "window, busy, idle, largest gap; kernel time per step in the windows); see the docstring")
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
    dy = torch.randn(1, args.T, H, device="cuda", dtype=dt)
    torch.manual_seed(0)
    ours = GatedDeltaNet(H, HK, HV, D, D, backend=args.backend, device="cuda", dtype=dt)
    fla = FlaGDN(hidden_size=H, expand_v=1, head_dim=D, num_heads=HK, num_v_heads=HV, mode="chunk",
                 use_short_conv=True).to("cuda", dt)
    layers = (("ours", "ours (" + ours.resolved_backend + ")", lambda: ours(x, cu_seqlens=cu)),
              ("fla", "fla layer", lambda: fla(x, cu_seqlens=cu)[0]))
    for key, name, step in layers:
        if args.only and key != args.only:
            continue
        m = ours if key == "ours" else fla

        def fwdbwd():
            if args.grad == "loss":
                return step().float().square().mean().backward()
            for t in (x, *m.parameters()):
                t.grad = None
            step().backward(dy)
        for _ in range(2):
            fwdbwd()
        torch.cuda.synchronize()
        trace = args.gaps or args.why
        acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
        with profile(activities=acts, with_stack=bool(args.why)) as prof:
            for _ in range(args.steps):
                fwdbwd()
            torch.cuda.synchronize()
        events = None
        if trace:
            events = _trace_events(prof)
            per = collections.defaultdict(lambda: [0.0, 0])
            for k in _kernels(events):
                per[k["name"]][0] += k["dur"]
                per[k["name"]][1] += 1
            rows = [(n, us / args.steps / 1e3, c // args.steps) for n, (us, c) in per.items()]
        else:
            rows = [(e.key, e.device_time_total / args.steps / 1e3, e.count // args.steps)
                    for e in prof.key_averages() if e.device_time_total > 0]
        rows.sort(key=lambda r: -r[1])
        total = sum(r[1] for r in rows)
        print(f"\n## {name}: {total:.2f} ms of CUDA kernels per fwd+bwd step (T={args.T}, docs={args.docs}, "
              f"backward from {'a random output gradient' if args.grad == 'output' else 'the square-mean loss'})")
        print("| ms/step | calls | kernel |\n|---|---|---|")
        for key, ms, n in rows[:args.top]:
            print(f"| {ms:.3f} | {n} | {key[:90]} |")
        if args.loop:
            bench_loop(fwdbwd, args.loop)
        if trace:
            if args.gaps:
                print_gaps(events, args.steps)
            if args.why:
                print_why(events, args.why, args.steps)


def bench_loop(fwdbwd, n):
    """``n`` steps as ``do_bench`` runs them, once unprofiled and once profiled: where its time per step differs from
    the kernels' sum (module docstring, ``--loop``)."""
    cache = torch.empty(int(256e6 // 4), dtype=torch.int, device="cuda")
    starts, ends = ([torch.cuda.Event(enable_timing=True) for _ in range(n)] for _ in range(2))
    host = []

    def loop():   # (with --grad output fwdbwd sets the gradients to None itself, as do_bench's grad_to_none)
        torch.cuda.synchronize()
        fwdbwd()                                    # do_bench's warm-up call
        host.clear()
        for i in range(n):
            with torch.profiler.record_function(f"bench_clear_{i}"):
                cache.zero_()                       # (its kernel marks where step i starts on the GPU)
            starts[i].record()
            t0 = time.perf_counter()
            fwdbwd()
            host.append((time.perf_counter() - t0) * 1e3)
            ends[i].record()
        torch.cuda.synchronize()
    loop()
    plain = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    print(f"\n{n} steps as do_bench runs them, not profiled: median {plain[n // 2]:.3f} ms, min {plain[0]:.3f}, "
          f"max {plain[-1]:.3f}; the host's time to issue a step: median {sorted(host)[n // 2]:.3f} ms, min "
          f"{min(host):.3f}, max {max(host):.3f}")
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        loop()
    print_loop(_trace_events(prof), [s.elapsed_time(e) for s, e in zip(starts, ends)], host)


def step_windows(events, n):
    """Per step i, the GPU window ``(a, b)`` from the end of the L2 clear before it (``bench_clear_i``'s kernel)
    to the start of the next clear (the last: to the end of the last kernel); None where a clear is missing."""
    clears = {e["name"]: e for e in events if e.get("cat") == "gpu_user_annotation"
              and e["name"].startswith("bench_clear_")}
    ks = _kernels(events)
    last = max((k["ts"] + k["dur"] for k in ks), default=0)
    out = []
    for i in range(n):
        c, nxt = clears.get(f"bench_clear_{i}"), clears.get(f"bench_clear_{i + 1}")
        out.append(None if c is None else (c["ts"] + c["dur"], nxt["ts"] if nxt is not None else last))
    return out


def print_loop(events, event_ms, host_ms):
    """The profiled loop's table: per step the CUDA events' time, the GPU window (``step_windows``), its busy
    and idle time, and its largest idle gap with the kernels on either side."""
    ks = _kernels(events)
    per_step = step_windows(events, len(event_ms))
    windows = [w for w in per_step if w is not None]
    per = collections.Counter()
    for k in ks:
        if any(a <= k["ts"] < b for a, b in windows):
            per[k["name"]] += k["dur"]
    steps = max(len(windows), 1)
    print(f"kernels in the {len(windows)} windows, {sum(per.values()) / steps / 1e3:.3f} ms per step in all; us per "
          "step: " + "; ".join(f"{_short(n, 48)} {us / steps:.0f}" for n, us in per.most_common(24)))
    print("profiled (GPU window: from the end of the step's L2 clear to the start of the next clear; the events "
          "start at the same point, so events <= window)\n| step | events ms | host ms | GPU window ms | busy ms | "
          "idle ms | largest gap us: after -> before |\n|---|---|---|---|---|---|---|")
    for i, w in enumerate(per_step):
        if w is None:
            print(f"| {i} | {event_ms[i]:.3f} | {host_ms[i]:.3f} | (no clear kernel found) | | | |")
            continue
        a, b = w
        inside = [k for k in ks if k["ts"] < b and k["ts"] + k["dur"] > a]
        busy = busy_in(ks, a, b)
        ends = [{"ts": a, "dur": 0, "name": "(L2 clear)"}, {"ts": b, "dur": 0, "name": "(next clear)"}]
        gaps = timeline(sorted(inside + ends, key=lambda k: k["ts"]))[2]
        g = max(gaps, default=(0.0, "", ""))
        print(f"| {i} | {event_ms[i]:.3f} | {host_ms[i]:.3f} | {(b - a) / 1e3:.3f} | {busy / 1e3:.3f} | "
              f"{(b - a - busy) / 1e3:.3f} | {g[0]:.0f}: {_short(g[1], 40)} -> {_short(g[2], 40)} |")


def _short(name: str, n: int) -> str:
    """A kernel's name cut to n characters after dropping aten's common prefixes (which would fill them)."""
    for prefix in ("void ", "at::native::", "(anonymous namespace)::"):
        name = name[len(prefix):] if name.startswith(prefix) else name
    return name[:n]


_SYNCS = re.compile(r"cuda(Stream|Device|Event)Synchronize|cudaMemcpy$")


def _trace_events(prof):
    """The complete ("X") events of a finished profile, from its Chrome trace."""
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(os.path.join(d, "t.json"))
        with open(os.path.join(d, "t.json")) as f:
            return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def _kernels(events):
    return sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])


def _enclosing(events, at, tid, cats=("cpu_op",)):
    """Names of the events of ``cats`` on thread ``tid`` that contain time ``at``, outermost first."""
    return [e["name"] for e in sorted((e for e in events if e.get("cat") in cats and e["tid"] == tid
                                       and e["ts"] <= at <= e["ts"] + e["dur"]), key=lambda e: e["ts"])]


def _intervals(ks):
    return [(k["ts"], k["ts"] + k["dur"]) for k in ks]


def timeline(ks):
    """``(span, busy, gaps)`` of kernels ``ks`` sorted by start (trace events, µs): first start to last end, the
    union of their intervals, and each idle gap as ``(length, kernel before, kernel after)``."""
    if not ks:
        return 0.0, 0.0, []
    end, gaps, last = ks[0]["ts"], [], None
    for k in ks:
        if k["ts"] > end:
            gaps.append((k["ts"] - end, last["name"] if last else "", k["name"]))
        if k["ts"] + k["dur"] >= end:
            end, last = k["ts"] + k["dur"], k
    return end - ks[0]["ts"], union(_intervals(ks)), gaps


def busy_in(ks, a, b):
    """The union of kernels ``ks`` clipped to the window ``[a, b]``."""
    return intersect_len(_intervals(ks), [(a, b)])


def print_gaps(events, steps):
    ks = _kernels(events)
    span, busy, gaps = timeline(ks)
    print(f"\nGPU span {span / steps / 1e3:.3f} ms per step, busy {busy / steps / 1e3:.3f}, idle "
          f"{(span - busy) / steps / 1e3:.3f} ({len(gaps) / steps:.0f} gaps per step; "
          f"{sum(g for g, *_ in gaps if g > 10) / steps / 1e3:.3f} ms in gaps over 10 us)")
    print("| gap us | after kernel | before kernel |\n|---|---|---|")
    for g, a, b in sorted(gaps, reverse=True)[:15]:
        print(f"| {g:.1f} | {a[:60]} | {b[:60]} |")
    syncs = [e for e in events if e.get("cat") == "cuda_runtime" and _SYNCS.search(e["name"])]
    by = collections.Counter()
    for e in syncs:
        by[(e["name"], " > ".join(_enclosing(events, e["ts"], e["tid"])[-4:]))] += e["dur"]
    print(f"\nhost syncs / blocking copies: {len(syncs) / steps:.1f} per step")
    for (n, where), us in by.most_common(12):
        print(f"  {us / steps:8.1f} us/step  {n}  in  {where[:160]}")


def print_why(events, pattern, steps):
    rx = re.compile(pattern)
    runtime = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    origin = collections.Counter()
    for k in _kernels(events):
        if not rx.search(k["name"]):
            continue
        r = runtime.get(k.get("args", {}).get("correlation"))
        if r is None:
            continue
        ops = _enclosing(events, r["ts"], r["tid"])
        frames = [n for n in _enclosing(events, r["ts"], r["tid"], ("python_function",))
                  if "/gdn_layer/" in n or "/flash_qla/" in n or "/fla/" in n or "profile_layer" in n]
        origin[(k["name"][:50], " > ".join(ops[-3:]), " < ".join(reversed(frames[-4:])))] += k["dur"]
    print(f"\nkernels matching {pattern!r}, by origin (us per step):")
    for (kname, ops, frames), us in origin.most_common(30):
        print(f"  {us / steps:8.1f}  {kname}\n           ops: {ops[:150]}\n           py:  {frames[:300]}")


if __name__ == "__main__":
    main()
