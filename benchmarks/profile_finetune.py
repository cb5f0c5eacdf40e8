"""Where a fine-tuning step's time goes: the GPU timeline of ``examples/finetune.py``'s train step.

Takes finetune.py's own arguments (model, data, layers, backend, seq-len, dtype, ...), builds the same
model and optimizer, runs three steps to warm up, then records ``--profile-steps`` steps with
``torch.profiler`` (CPU and CUDA, a device sync after each). Prints (rank 0; median over the steps, ms):
the step's wall time, the span of its kernels, the time some kernel ran (busy) and the time the GPU
sat idle inside the span; the CUDA kernels grouped as the GDN layers', the attention layers' and the
rest by kernel name (the profiler does not record which module launched a kernel; see ``GROUPS``);
the top kernels; the host calls that wait for the GPU (``cudaStreamSynchronize``, ``cudaMemcpy``...,
``aten::item`` / ``_local_scalar_dense``) with their counts per step, and the Python frames of one
step's device syncs.

    python3 benchmarks/profile_finetune.py --model DIR --device cuda --dtype bfloat16 --seq-len 8192 --train all \
        [--profile-steps 5] [--cuda-graphs]
"""
from __future__ import annotations

import collections
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import finetune
import graph_step
import text_data
from profile_sp import analyse

# kernel-name fragments -> group (first match wins)
GROUPS = (("gdn: conv/gate/norm (ours)", ("_conv_", "_gate_", "_norm_", "_l2norm", "_rms")),
          ("gdn: chunk kernels (fla / FlashQLA)", ("chunk", "fused_recurrent", "kkt", "solve_tril", "wy_",
                                                   "flash_qla", "main_kernel", "prepare", "cumsum")),
          ("attention (sdpa / flash)", ("flash", "fmha", "attention", "softmax")),
          ("GEMMs", ("gemm", "nvjet", "cutlass", "xmma", "sm90", "cublas")),
          ("NCCL", ("nccl",)))
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaMemcpyAsync", "aten::item",
         "aten::_local_scalar_dense", "cudaEventSynchronize")


def group_of(name: str) -> str:
    low = name.lower()
    for group, keys in GROUPS:
        if any(k.lower() in low for k in keys):
            return group
    return "other (elementwise, copies, loss, optimizer)"


def sync_sources(fn) -> collections.Counter:
    """Run ``fn`` with CUDA sync debugging on; count each synchronising call by its Python call site
    (the innermost frames outside torch)."""
    counts = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [fr for fr in traceback.extract_stack()[:-1]
                  if "/torch/" not in fr.filename and "warnings.py" not in fr.filename]
        counts[" <- ".join(f"{os.path.basename(fr.filename)}:{fr.lineno} {fr.name}" for fr in frames[::-1][:4])] += 1

    with warnings.catch_warnings():           # restores showwarning and the filters afterwards
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return counts


def main(argv=None):
    mine, rest = finetune.own_and_finetune_args(__doc__, lambda p: p.add_argument(
        "--profile-steps", type=int, default=5, help="steps recorded after 3 warm-up steps"), argv)
    if mine.profile_steps < 1:
        raise ValueError(f"--profile-steps must be >= 1, got {mine.profile_steps}")
    steps = mine.profile_steps
    args = finetune.parse_args(rest)
    ctx = finetune.setup_distributed(args.sp, args.device, args.cp)
    model, params, _, train, _, _, summary = finetune.build(args, ctx)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    if ctx.rank == 0:
        print(summary, flush=True)

    static = None   # --cuda-graphs: the step replays its CUDA graph (captured in the first warm-up step)
    if args.cuda_graphs:
        static = graph_step.StaticStep(model, optimizer, args.seq_len, graph_step.max_documents(train), ctx.device,
                                       capture=ctx.device.type == "cuda")

    def step(i):
        return finetune.train_step(model, params, optimizer,
                                   text_data.batch_for_step(train, i, ctx.dp_rank, ctx.dp, args.seed), ctx, static)

    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    for i in range(3):
        step(i)
    sync()
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            t0 = time.perf_counter()
            with record_function(f"gdn_step{i}"):
                step(3 + i)
                sync()
            walls.append(time.perf_counter() - t0)
    sources = sync_sources(lambda: step(3 + steps)) if ctx.device.type == "cuda" else collections.Counter()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    med, top = analyse(path)
    groups = {}
    for name, us in top:
        groups[group_of(name)] = groups.get(group_of(name), 0.0) + us
    waits = {e.key: e.count / steps for e in prof.key_averages() if e.key in WAITS}
    if ctx.rank == 0:
        print(f"\nstep wall {statistics.median(walls) * 1e3:.1f} ms ({args.seq_len / statistics.median(walls):.0f} "
              f"tokens/s); kernels: span {med['span']:.1f}, busy {med['busy']:.1f}, idle inside the span "
              f"{med['idle']:.1f} ms (median of {steps} steps)")
        print("| ms/step | group |\n|---|---|")
        for g, us in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"| {us / 1e3:.2f} | {g} |")
        print("\n| ms/step | kernel |\n|---|---|")
        for name, us in top[:25]:
            print(f"| {us / 1e3:.3f} | {name[:110]} |")
        print("\nhost calls that wait for the GPU, per step: "
              + (", ".join(f"{k} {v:.0f}" for k, v in sorted(waits.items())) or "none"))
        print("\nwhere one step's syncs come from (torch.cuda.set_sync_debug_mode('warn'); count <- innermost "
              "frames outside torch):" + ("" if sources else " not counted (CUDA only)"))
        for where, n in sources.most_common(15):
            print(f"- {n} x {where}")
        cpu = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
        print("\n| self CPU ms/step | calls/step | op |\n|---|---|---|")
        for e in cpu:
            print(f"| {e.self_cpu_time_total / steps / 1e3:.2f} | {e.count / steps:.0f} | {e.key[:90]} |")


if __name__ == "__main__":
    main()
