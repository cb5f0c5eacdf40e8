"""The layer's q / k conv with its L2 norm fused (``l2norm_dim``) against the conv and the separate norm
kernels it replaces, on the GPU: times and agreement. Needs CUDA.

    python3 benchmarks/bench_conv_l2norm.py [--T 32768] [--docs 9]

Qwen3-Next's q and k (Hk 16 heads of 128 channels each, W = 4, bf16), x channel slices of the layer's
``[T, C + 2 Hv]`` pre-conv buffer, T tokens packed in --docs documents. Per step, as the layer runs them:

- separate (before): forward two convs and ``l2norm_pair_fwd``; backward ``l2norm_pair_fwd`` again (the chunk
  backward recomputes the norm from the saved unnormalised q and k), ``l2norm_pair_bwd``, two conv backwards;
- fused: forward two convs with ``l2norm_dim=128`` (the norm and its factor rstd in the conv kernel);
  backward two conv backwards with ``l2norm_out=(y, rstd)`` (``l2norm_bwd_from_output`` + the conv's passes).

Prints ms (median of ``triton.testing.do_bench``) of the forward and of the backward of each, and the fused
results' largest relative difference from the separate ones (y, dx, dweight; bf16).
"""
import argparse
import random

import torch
from triton.testing import do_bench

from gdn_layer.kernels.triton import conv, l2norm


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--docs", type=int, default=9)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_conv_l2norm.py needs a CUDA GPU")
    Hk, Hv, D, W, T = 16, 32, 128, 4, args.T
    C = 2 * Hk * D + Hv * D
    rnd = random.Random(0)
    cu = torch.tensor([0, *sorted(rnd.sample(range(1, T), args.docs - 1)), T], device="cuda")
    mixed = torch.randn(1, T, C + 2 * Hv, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(C, W, device="cuda", dtype=torch.bfloat16) / 2
    xs = [mixed[..., i * Hk * D:(i + 1) * Hk * D] for i in (0, 1)]
    ws = [weight[i * Hk * D:(i + 1) * Hk * D] for i in (0, 1)]
    dys = [torch.randn(1, T, Hk * D, device="cuda", dtype=torch.bfloat16) for _ in (0, 1)]
    dmixed = torch.empty_like(mixed)
    dxs = [dmixed[..., i * Hk * D:(i + 1) * Hk * D] for i in (0, 1)]
    heads = lambda t: t.unflatten(-1, (Hk, D))  # noqa: E731
    # what each backward reads: the unnormalised q and k (separate), the normalised ones and rstd (fused)
    qk = [conv.causal_conv1d_fwd(x, w, None, cu, None, "silu", False)[0] for x, w in zip(xs, ws)]
    saved = [conv.causal_conv1d_fwd(x, w, None, cu, None, "silu", False, l2norm_dim=D) for x, w in zip(xs, ws)]

    def sep_fwd():
        q, k = (conv.causal_conv1d_fwd(x, w, None, cu, None, "silu", False)[0] for x, w in zip(xs, ws))
        return l2norm.l2norm_pair_fwd(heads(q), heads(k))

    def sep_bwd():
        l2norm.l2norm_pair_fwd(heads(qk[0]), heads(qk[1]))            # the chunk backward's recompute
        dq, dk = l2norm.l2norm_pair_bwd(heads(qk[0]), heads(dys[0]), heads(qk[1]), heads(dys[1]))
        return [conv.causal_conv1d_bwd(d.flatten(-2), None, x, w, None, cu, None, "silu", dx=dx)[:2]
                for d, x, w, dx in zip((dq, dk), xs, ws, dxs)]

    def fused_fwd():
        return [conv.causal_conv1d_fwd(x, w, None, cu, None, "silu", False, l2norm_dim=D)[0] for x, w in zip(xs, ws)]

    def fused_bwd():
        return [conv.causal_conv1d_bwd(dy, None, x, w, None, cu, None, "silu", dx=dx, l2norm_out=(y, r))[:2]
                for dy, x, w, dx, (y, _, r) in zip(dys, xs, ws, dxs, saved)]

    def err(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    want_y = [t.flatten(-2) for t in sep_fwd()]
    want_g = [[t.clone() for t in pair] for pair in sep_bwd()]
    got_y, got_g = fused_fwd(), [[t.clone() for t in pair] for pair in fused_bwd()]
    errors = [err(a, b) for a, b in zip(got_y, want_y)] + [err(a, b) for p, q in zip(got_g, want_g)
                                                           for a, b in zip(p, q)]
    print(f"T={T} docs={args.docs} q/k: {Hk} heads x {D}, bf16; fused vs separate: max rel. difference "
          f"{max(errors):.2e} (y, dx, dweight)")
    t = {name: do_bench(fn, warmup=25, rep=200) for name, fn in
         (("separate fwd", sep_fwd), ("separate bwd", sep_bwd), ("fused fwd", fused_fwd), ("fused bwd", fused_bwd))}
    print(f"forward : separate {t['separate fwd']:.3f} ms (2 convs + norm), fused {t['fused fwd']:.3f} ms")
    print(f"backward: separate {t['separate bwd']:.3f} ms (norm recompute + norm bwd + 2 conv bwd), "
          f"fused {t['fused bwd']:.3f} ms (norm bwd from y, rstd + 2 conv bwd)")


if __name__ == "__main__":
    main()
