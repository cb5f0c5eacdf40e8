"""The layer's own host cost per call, without kernels: a backend ("null") whose functions only allocate
their outputs, so what is timed is the layer's Python, the validation, the custom ops' dispatch and
autograd, and the aten ops around them (projections, casts, gradient sums), on the CPU.

    python scripts/bench_null_backend.py [--T 16] [--device cpu|cuda]

The layer is tiny (hidden 64, Hk 2, Hv 4, D 16) so that on the CPU the aten ops' compute is negligible.

Prints the median host ms of one forward+backward and of one no-grad forward (value checks off).
Compare with ``bench_host_cost.py --breakdown``'s "rest" on a GPU (docs/performance.md, issue 23).
"""
import argparse
import statistics
import time

import torch
from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import registry
from gdn_layer.kernels.registry import Backend
from gdn_layer.kernels.validation import skip_value_checks
E = torch.empty_like
def chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu=None, use_qk_l2norm=False):
    return E(v), None
def chunk_bwd(do, dfinal, q, k, v, g, beta, scale=None, initial_state=None, cu=None, use_qk_l2norm=False):
    return E(q), E(k), E(v), E(g, dtype=torch.float32), E(beta), None
def conv(x, weight, bias=None, activation="silu", cu=None, initial_state=None, output_final_state=False):
    return E(x), None
def conv_bwd(dy, dfinal, x, weight, bias=None, activation="silu", cu=None, initial_state=None):
    return E(x), E(weight), None, None
def gate(a, b, A_log, dt_bias):
    return E(a, dtype=torch.float32), E(b)
def gate_bwd(dg, dbeta, a, b, A_log, dt_bias):
    return E(a), E(b), E(A_log), E(dt_bias)
def norm(x, z, weight, eps=1e-6):
    return E(x)
def norm_bwd(dy, x, z, weight, eps=1e-6):
    return E(x), E(z), E(weight)
registry.register_backend(Backend(name="null", chunk_gated_delta_rule=chunk, recurrent_gated_delta_rule=chunk,
    causal_conv1d=conv, gated_rms_norm=norm, available=lambda d: (True, ""), priority=-1, gdn_gate=gate,
    chunk_gated_delta_rule_bwd=chunk_bwd, causal_conv1d_bwd=conv_bwd, gdn_gate_bwd=gate_bwd, gated_rms_norm_bwd=norm_bwd,
    dense_as_packed=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    # a tiny layer: on the CPU the aten ops' own compute stays negligible next to the host overhead
    layer = GatedDeltaNet(64, 2, 4, 16, 16, backend="null", device=args.device)
    x = torch.randn(1, args.T, 64, requires_grad=True, device=args.device)
    cu = torch.tensor([0, args.T // 2, args.T], device=args.device)

    def fb():
        layer(x, cu_seqlens=cu).sum().backward()

    def f():
        with torch.no_grad():
            layer(x, cu_seqlens=cu)

    for name, fn in (("fwd+bwd", fb), ("fwd no grad", f)):
        with skip_value_checks():
            for _ in range(20):
                fn()
            ts = []
            for _ in range(200):
                sync()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
        print(name, "median ms", round(statistics.median(ts) * 1e3, 3), "min", round(min(ts) * 1e3, 3))


if __name__ == "__main__":   # (importing this module only registers the "null" backend)
    main()
