"""Count Triton compiles of the CUDA path over many packed layouts, on a CPU machine (no GPU).

Run as a script (tests/test_triton_compile.py does, in a subprocess): it drops TRITON_INTERPRET, points
Triton at a fresh cache, installs ``fake_cuda_driver`` (SM90 target, real compiler, no-op launches),
makes torch.cuda answer fla's import-time questions as an H200 would, and then calls every kernel the
layer's CUDA backends launch -- our Triton kernels (conv, gate, L2 norm, gated RMSNorm) and fla's chunk
forward/backward and fused recurrent forward -- with the shapes the layer gives them, for each
(T, N) layout. Prints one JSON line: compiles at the first layout and after it, per layout.

``--host-reads`` also runs fla's chunk forward and backward of every layout after the first inside
``host_read_spy.HostReadSpy`` and reports what it saw: on a GPU each entry would be a device sync or a
host-built tensor, which a CUDA graph capture cannot hold.

``--negative-control`` runs a kernel whose T is a ``tl.constexpr`` instead: it must recompile per T
(this is what the test's "can fail" check relies on).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gdn_compile_probe_")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fake_cuda_driver  # noqa: E402

COMPILED = fake_cuda_driver.install()

import torch  # noqa: E402


class _H200Props:
    name, major, minor, multi_processor_count = "NVIDIA H200", 9, 0, 132
    shared_memory_per_block_optin, shared_memory_per_block, total_memory = 232448, 49152, 141 << 30


def pretend_h200():
    """fla reads the GPU's name, capability and properties at import; answer as an H200 would."""
    torch.cuda.get_device_name = lambda *a, **k: _H200Props.name
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: _H200Props()
    torch.cuda.current_device = lambda: 0
    torch.cuda.device_count = lambda: 1
    # the CPU tensors stand in for CUDA ones: the launchers' CUDA-only choices follow (the gated norm rounds
    # by the GPU's conversions there, and the conv's plain dz pass pipelines its loop: kernel variants of their own)
    from gdn_layer.kernels.triton import _grid
    _grid.on_cuda = lambda x: True


def layer_calls(T, N, Hk=2, Hv=4, D=128, W=4, dtype=torch.bfloat16, with_fla=True, watch=contextlib.nullcontext):
    """Every kernel launch of one layer forward+backward on the fla backend, at packed length T with N
    sequences (CPU tensors stand in for device memory: nothing is launched)."""
    from gdn_layer.kernels import fla_backend, triton_ops
    g = torch.Generator().manual_seed(T * 131 + N)
    cu = torch.linspace(0, T, N + 1).round().long()
    C = 2 * Hk * D + Hv * D
    mixed = torch.randn(1, T, C + 2 * Hv, dtype=dtype, generator=g)     # the all-to-all receive buffer
    weight = torch.randn(C, W, dtype=dtype, generator=g)
    h0 = torch.randn(N, C, W - 1)
    # the layer's conv: q, k, v as three outputs (causal_conv1d_split), and the whole-output one
    sizes = [Hk * D, Hk * D, Hv * D]
    (q, k, v), fin = triton_ops.conv_fwd(mixed[..., :C], weight, None, "silu", cu, h0, True, split_sizes=sizes)
    triton_ops.conv_bwd([q, k, v], fin, mixed[..., :C], weight, None, "silu", cu, h0)
    y, fin = triton_ops.conv_fwd(mixed[..., :C], weight, None, "silu", cu, h0, True)
    triton_ops.conv_bwd(y, fin, mixed[..., :C], weight, None, "silu", cu, h0)
    # the layer in training (ops_conv_gate.conv_gate): a conv per part, neither initial nor final state (the plain tiles
    # of both passes), each dx pass writing its columns of the pre-conv buffer's gradient, the gate's backward
    # its last 2 Hv columns; q and k L2-normalised per head in the conv (the layer's delta rule then normalises
    # nothing, gdn_layer/layer.py _qk_l2norm_in_conv)
    dmixed = torch.empty_like(mixed)
    for i, (xi, wi, dxi) in enumerate(zip(mixed[..., :C].split(sizes, -1), weight.split(sizes),
                                          dmixed[..., :C].split(sizes, -1))):
        yi, _, *rstd = triton_ops.conv_fwd(xi, wi, None, "silu", cu, None, False, l2norm_dim=D if i < 2 else 0)
        triton_ops.conv_bwd(yi, None, xi, wi, None, "silu", cu, None, dx=dxi,
                            l2norm_out=(yi, *rstd) if rstd else None)
    a, b = mixed[..., C:C + Hv], mixed[..., C + Hv:]
    A_log, dt_bias = torch.randn(Hv), torch.randn(Hv)
    gate, beta = triton_ops.gate_fwd(a, b, A_log, dt_bias)
    triton_ops.gate_bwd(gate, beta, a, b, A_log, dt_bias, da=dmixed[..., C:C + Hv], db=dmixed[..., C + Hv:])
    q, k, v = q.unflatten(-1, (Hk, D)), k.unflatten(-1, (Hk, D)), v.unflatten(-1, (Hv, D))
    state = torch.randn(N, Hv, D, D)
    z = torch.randn(1, T, Hv, D, dtype=dtype, generator=g)
    if with_fla:
        with watch():
            o, s = fla_backend.chunk_fwd(q, k, v, gate, beta, D ** -0.5, state, True, cu, True)
            fla_backend.chunk_bwd(o, s, q, k, v, gate, beta, D ** -0.5, state, cu, True)
        dcu = torch.arange(N + 1)
        fla_backend.recurrent_fwd(q[:, :N], k[:, :N], v[:, :N], gate[:, :N], beta[:, :N], D ** -0.5, state, True,
                                  dcu, True)
    else:
        o = v
        triton_ops.l2norm_qk_bwd(q, k, *triton_ops.l2norm_qk_fwd(q, k))   # (the pair, as the backends launch it)
    # a decode step from a state pool (kernels/triton/decode.py): N sequences, rows through slots
    from gdn_layer.kernels.triton.decode import decode_step
    rows = N + 3
    slots = torch.randperm(rows, generator=g)[:N]
    decode_step(mixed[0, :N], weight, A_log, dt_bias, torch.randn(rows, C, W - 1), torch.randn(rows, Hv, D, D),
                slots, Hk, Hv, D, D)
    triton_ops.norm_bwd(o, o, z, torch.ones(D, dtype=dtype), 1e-6)
    triton_ops.norm_fwd(o, z, torch.ones(D, dtype=dtype), 1e-6)


def negative_control(T):
    import triton
    import triton.language as tl

    @triton.jit
    def scale_kernel(x, T: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x + i, tl.load(x + i, mask=i < T) * 2, mask=i < T)

    x = torch.empty(T)
    scale_kernel[(triton.cdiv(T, 128),)](x, T, BLOCK=128)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 1025, 2047, 3001, 4096, 5000, 7777, 8192])
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 2, 3, 5, 9, 17, 33, 64])
    ap.add_argument("--no-fla", action="store_true", help="only our kernels")
    ap.add_argument("--negative-control", action="store_true")
    ap.add_argument("--host-reads", action="store_true", help="spy on fla's chunk calls after the first layout")
    args = ap.parse_args(argv)
    pretend_h200()
    from host_read_spy import HostReadSpy
    spies = []

    def watch():
        spies.append(HostReadSpy())
        return spies[-1]
    per_layout = []
    for T, N in itertools.product(args.lengths, args.counts):
        if N <= T:
            before = len(COMPILED)
            if args.negative_control:
                negative_control(T)
            else:
                layer_calls(T, N, with_fla=not args.no_fla,
                            watch=watch if args.host_reads and per_layout else contextlib.nullcontext)
            per_layout.append({"T": T, "N": N, "compiles": len(COMPILED) - before})
    print("RESULT " + json.dumps({"first": per_layout[0]["compiles"],
                                  "after_first": sum(r["compiles"] for r in per_layout[1:]),
                                  "layouts": per_layout,
                                  "host_reads": [[str(x) for x in f] for spy in spies for f in spy.found]}), flush=True)


if __name__ == "__main__":
    main()
