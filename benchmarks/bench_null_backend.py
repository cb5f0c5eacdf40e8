"""The layer's own host cost per call, without kernels: a backend ("null") whose functions only allocate
their outputs, so what is timed is the layer's Python, the validation, the custom ops' dispatch and
autograd, and the aten ops around them (projections, casts, gradient sums), on the CPU (or, with
``--device cuda``, the host side of the same on a GPU machine).

    python benchmarks/bench_null_backend.py [--T 16] [--device cpu|cuda] [--count-ops]

The layer is tiny (hidden 64, Hk 2, Hv 4, D 16) so that on the CPU the aten ops' compute is negligible.

Prints the median host ms of one forward+backward and of one no-grad forward (value checks off).
``--count-ops``: instead, the ops the layer dispatches in one forward+backward (a ``TorchDispatchMode``;
the custom ops count one each, what runs inside them is the backend's), and how many are custom ops.
Compare with ``bench_host_cost.py --breakdown``'s "rest" on a GPU (docs/performance.md).
"""
import argparse
import os
import statistics
import sys
import time

import torch
from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import registry
from gdn_layer.kernels.registry import Backend
from gdn_layer.kernels.validation import skip_value_checks
from torch.utils._python_dispatch import TorchDispatchMode
E = torch.empty_like


def alloc_only_backend(name: str = "null", conv_splits: bool | None = None) -> Backend:
    """A backend whose functions only allocate their outputs (final states and initial-state gradients
    too, when asked for): what runs is the layer's own work around the kernels. Also the stand-in of
    ``tests/test_host_path.py``. Not registered: ``registry.register_backend(alloc_only_backend())``.
    ``conv_splits``: as the backend field; None: as the CUDA backends ship (``fla_backend.CONV_SPLITS``)."""
    if conv_splits is None:
        from gdn_layer.kernels.fla_backend import CONV_SPLITS as conv_splits
    def chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu=None,
              use_qk_l2norm=False):
        N = q.shape[0] if cu is None else cu.numel() - 1
        return E(v), (q.new_empty(N, v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
                      if output_final_state else None)

    def chunk_bwd(do, dfinal, q, k, v, g, beta, scale=None, initial_state=None, cu=None, use_qk_l2norm=False):
        return E(q), E(k), E(v), E(g, dtype=torch.float32), E(beta), (None if initial_state is None else E(initial_state))

    def conv(x, weight, bias=None, activation="silu", cu=None, initial_state=None, output_final_state=False,
             split_sizes=None):
        N = x.shape[0] if cu is None else cu.numel() - 1
        y = (E(x, memory_format=torch.contiguous_format) if split_sizes is None else
             [x.new_empty(*x.shape[:2], w) for w in split_sizes])
        return y, (x.new_empty(N, x.shape[2], weight.shape[1] - 1, dtype=torch.float32) if output_final_state else None)

    def conv_bwd(dy, dfinal, x, weight, bias=None, activation="silu", cu=None, initial_state=None, dx=None):
        return (E(x) if dx is None else dx), E(weight), None, (None if initial_state is None else E(initial_state))

    def gate_bwd(dg, dbeta, a, b, A_log, dt_bias, da=None, db=None):
        return (E(a) if da is None else da), (E(b) if db is None else db), E(A_log), E(dt_bias)

    return Backend(
        name=name, chunk_gated_delta_rule=chunk, recurrent_gated_delta_rule=chunk, causal_conv1d=conv,
        gated_rms_norm=lambda x, z, weight, eps=1e-6: E(x), available=lambda d: (True, ""), priority=-1,
        gdn_gate=lambda a, b, A_log, dt_bias: (E(a, dtype=torch.float32), E(b)), chunk_gated_delta_rule_bwd=chunk_bwd,
        causal_conv1d_bwd=conv_bwd,
        gdn_gate_bwd=gate_bwd,
        gated_rms_norm_bwd=lambda dy, x, z, weight, eps=1e-6: (E(x), E(z), E(weight)), dense_as_packed=True,
        conv_splits=conv_splits, grads_into=True)


class OpLog(TorchDispatchMode):
    """Records ``namespace::name`` of each op dispatched under it (``names``); with ``skip_empty``, not
    those whose result is an empty tensor (they launch nothing). Also used by tests/test_host_path.py."""

    def __init__(self, skip_empty: bool = False):
        super().__init__()
        self.names, self.skip_empty = [], skip_empty

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (self.skip_empty and isinstance(out, torch.Tensor) and out.numel() == 0):
            self.names.append(f"{func.namespace}::{func.overloadpacket.__name__}")
        return out


def dispatched_ops(fn) -> list[str]:
    """``namespace::name`` of every op ``fn()`` dispatches (value checks off)."""
    with skip_value_checks(), OpLog() as log:
        fn()
    return log.names


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=16, help="tokens, packed as two sequences of T/2 (default: 16)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the GPU host's cost) (default: cpu)")
    ap.add_argument("--count-ops", action="store_true", help="count the dispatched ops of one fwd+bwd instead")
    args = ap.parse_args()
    if args.device.startswith("cuda"):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
        from requires import require_cuda
        require_cuda("bench_null_backend.py --device cuda")
    registry.register_backend(alloc_only_backend())
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

    if args.count_ops:
        names = dispatched_ops(fb)
        custom = [n for n in names if n.startswith("gdn_layer::")]
        print(f"ops dispatched in one fwd+bwd: {len(names)} (custom ops {len(custom)}: {sorted(set(custom))})")
        return
    print(f"GatedDeltaNet(hidden 64, Hk 2, Hv 4, D 16) on the alloc-only backend, {args.device}, T = {args.T} "
          f"in 2 sequences, conv_splits={registry.backend_by_name('null').conv_splits}; 200 timed calls after 20:")
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
