"""Probe: torch.compile(mode="reduce-overhead") of the layer over several packings (GPU only; issue 23).

Prints dynamo's graph breaks for the layer, then runs the reduce-overhead loop of
tests/test_cuda_graphs.py in variants: as the test does (compiled then eager each packing, parameter grads
set to None before each call), with torch.compiler.cudagraph_mark_step_begin() before each compiled call,
compiled calls only, and ``accumulate``: the grads never cleared, which must fail (the backward would
accumulate into a .grad that CUDA-graph trees own and overwrite).

    python3 scripts/probe_reduce_overhead.py [BACKEND [VARIANT ...]]

BACKEND: fla (default when available) or auto; VARIANT: as_test, mark_step, compiled_only, accumulate (default all).
Run it with TORCH_LOGS=graph_breaks,recompiles,+cudagraphs to see CUDA-graph trees' decisions
(``bash scripts/gpu_session.sh probe_ro``).
"""
import os
import sys

import torch
import torch._dynamo as dynamo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def explain(be):
    layer = make_layer(be, 64)
    x = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ex = dynamo.explain(layer)(x, cu_seqlens=cu_of(packings(2)[0]))
    print("explain: graphs", ex.graph_count, "breaks", ex.graph_break_count, flush=True)
    for b in ex.break_reasons:
        print("--- break:", b.reason[:400])
        for f in b.user_stack[-4:]:
            print("     ", f.filename.split("/")[-1], f.lineno, f.line)
    dynamo.reset()


def run(be, variant):
    dynamo.reset()
    layer = make_layer(be, 64)
    compiled = torch.compile(layer, mode="reduce-overhead")
    steps = compiled_steps(layer, compiled, eager=variant != "compiled_only", mark_step=variant == "mark_step",
                           zero_grad=variant != "accumulate")
    while True:
        try:
            i, outs = next(steps)
        except StopIteration:
            break
        except Exception as e:  # noqa: BLE001 - the failure is what this probe reports
            print(f"[{variant}] failed after the last iteration printed: {type(e).__name__}: {str(e)[:300]}")
            return
        if len(outs) == 2:
            (y_c, g_c, p_c), (y_e, g_e, p_e) = outs
            worst = max(((rel_err(p_c[n], p_e[n]), n) for n in p_e), default=(float("nan"), "-"))
            print(f"[{variant}] iteration {i}: rel err y {rel_err(y_c, y_e):.2e} dx {rel_err(g_c, g_e):.2e}"
                  f" parameter grads {worst[0]:.2e} ({worst[1]})")
        else:
            print(f"[{variant}] iteration {i}: ok")
    print(f"[{variant}] passed")


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from requires import help_if_asked, require_cuda
    help_if_asked(__doc__)
    require_cuda("probe_reduce_overhead.py")
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_cuda_graphs import BACKENDS, T, compiled_steps, cu_of, make_layer, packings, rel_err
    backend = sys.argv[1] if len(sys.argv) > 1 else ("fla" if "fla" in BACKENDS else "auto")
    explain(backend)
    for v in sys.argv[2:] or ["as_test", "mark_step", "compiled_only", "accumulate"]:
        run(backend, v)
