"""Probe: why torch.compile(mode="reduce-overhead") fails in the layer's backward (GPU only; issue 23).

Prints dynamo's graph breaks for the layer, then runs the reduce-overhead loop of
tests/test_cuda_graphs.py in variants: as the test does (compiled then eager each packing), with
torch.compiler.cudagraph_mark_step_begin() before each compiled call, and compiled calls only.
"""
import os, sys, traceback
import torch, torch._dynamo as dynamo
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from test_cuda_graphs import make_layer, packings, cu_of, rel_err, T, BACKENDS

be = sys.argv[1] if len(sys.argv) > 1 else ("fla" if "fla" in BACKENDS else "auto")
layer = make_layer(be, 64)
x = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
ex = dynamo.explain(layer)(x, cu_seqlens=cu_of(packings(2)[0]))
print("explain: graphs", ex.graph_count, "breaks", ex.graph_break_count, flush=True)
for b in ex.break_reasons:
    print("--- break:", b.reason[:400])
    for f in b.user_stack[-4:]:
        print("     ", f.filename.split("/")[-1], f.lineno, f.line)
dynamo.reset()


def run(variant):
    dynamo.reset()
    layer = make_layer(be, 64)
    compiled = torch.compile(layer, mode="reduce-overhead")
    packs = packings(5, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(2)
    dy = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    for i, p in enumerate(packs + packs[:2]):
        x = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
        outs = []
        fs = (compiled,) if variant == "compiled_only" else (compiled, layer)
        for f in fs:
            xi = x.clone().requires_grad_(True)
            if f is compiled and variant == "mark_step":
                torch.compiler.cudagraph_mark_step_begin()
            try:
                y = f(xi, cu_seqlens=cu_of(p))
                y.backward(dy)
            except Exception as e:
                print(f"[{variant}] iteration {i} {'compiled' if f is compiled else 'eager'}: {type(e).__name__}: {str(e)[:300]}")
                return
            outs.append((y.detach().clone(), xi.grad.clone()))
        if len(outs) == 2:
            print(f"[{variant}] iteration {i}: rel err y {rel_err(outs[0][0], outs[1][0]):.2e} dx {rel_err(outs[0][1], outs[1][1]):.2e}")
        else:
            print(f"[{variant}] iteration {i}: ok")
    print(f"[{variant}] passed")


for v in sys.argv[2:] or ["as_test", "mark_step", "compiled_only"]:
    run(v)
