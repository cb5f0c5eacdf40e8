"""Side-by-side speed and memory of one GatedDeltaNet layer: gdn-layer vs transformers' own block.

Both run the same weights on the same packed batch, forward + backward, in one process, one after the
other, so the ratio is measured under the same conditions. transformers' block is Qwen3-Next's
``Qwen3NextGatedDeltaNet`` (it uses fla's kernels when fla is importable, else its torch fallback;
the line printed says which). Packed input: transformers cannot take ``cu_seqlens`` in its torch
fallback, so for it the pack is run as one sequence (the same token count and cost).

    python benchmarks/bench_vs_transformers.py --device cuda --dtype bfloat16 --seq-lens 4096 16384
    python benchmarks/bench_vs_transformers.py --device cpu --dtype float32 --seq-lens 1024 --hidden 256 --k-heads 2 --v-heads 4 --head-dim 64
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch
from timing import add_shape_args

from gdn_layer import GatedDeltaNet


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 16384], help="packed T per step")
    p.add_argument("--docs", type=int, default=8, help="documents per pack (equal lengths)")
    add_shape_args(p)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def hf_block(args, device, dtype):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as m
    cfg = Qwen3NextConfig(hidden_size=args.hidden, linear_num_key_heads=args.k_heads,
                          linear_num_value_heads=args.v_heads, linear_key_head_dim=args.head_dim,
                          linear_value_head_dim=args.head_dim, num_hidden_layers=1,
                          layer_types=["linear_attention"])
    block = m.Qwen3NextGatedDeltaNet(cfg, 0).to(device=device, dtype=dtype)
    # transformers takes fla's kernels when fla is importable, else its torch fallback
    return block, ("fla" if importlib.util.find_spec("fla") else "torch fallback")


def timed(fn, device, repeats):
    """Median seconds of fn() over ``repeats`` runs after one warm-up, and peak memory (CUDA) in GiB."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return sorted(times)[len(times) // 2], peak


def main(argv=None):
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    theirs, their_path = hf_block(args, device, dtype)
    ours = GatedDeltaNet.from_hf(theirs)
    print(f"device={device} dtype={dtype} ours backend={ours.resolved_backend} transformers={their_path}")
    rows = []
    for T in args.seq_lens:
        x = torch.randn(1, T, args.hidden, device=device, dtype=dtype, requires_grad=True)
        bounds = torch.linspace(0, T, args.docs + 1).round().to(torch.int32)
        cu = bounds.to(device)

        def step(module, **kw):
            def run():
                module.zero_grad(set_to_none=True)
                x.grad = None
                module(x, **kw).float().square().mean().backward()
            return run

        t_ours, m_ours = timed(step(ours, cu_seqlens=cu), device, args.repeats)
        t_hf, m_hf = timed(step(theirs), device, args.repeats)
        row = dict(T=T, ours_s=t_ours, hf_s=t_hf, ours_tok_s=T / t_ours, hf_tok_s=T / t_hf,
                   speedup=t_hf / t_ours, ours_peak_gib=m_ours, hf_peak_gib=m_hf)
        rows.append(row)
        gib = lambda m: "-" if m != m else f"{m:.2f}"      # no peak memory on CPU
        print(f"T={T:6d}  ours {t_ours * 1e3:9.1f} ms ({T / t_ours:10.0f} tok/s, peak {gib(m_ours)} GiB)  "
              f"transformers {t_hf * 1e3:9.1f} ms ({T / t_hf:10.0f} tok/s, peak {gib(m_hf)} GiB)  "
              f"speedup x{t_hf / t_ours:.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), transformers_path=their_path, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
