"""Compile and launch every kernel of the ``ascend`` backend through triton-ascend on a CPU machine.

Run with ``.venv-ascend/bin/python`` (triton-ascend replaces the ``triton`` package; tests/test_ascend_compile.py
does this in a subprocess). It drops TRITON_INTERPRET, points Triton at a fresh cache, installs
``fake_npu_driver`` (triton-ascend's JIT and its ttir -> ttadapter lowering for real, the CANN-only
``npubin`` stage stubbed, launches recorded) and makes fla-core see an NPU: fla decides from Triton's
active target (``backend == "npu"``), so its inner calls dispatch to its ``triton_ascend`` kernels
as on a 910B. Then, for each packed layout, it calls the ``ascend`` backend's ops the way the layer does
(conv, gate, L2 norm, chunk forward/backward, fused recurrent decode, gated RMSNorm; with initial
states; Qwen3-Next head shapes; bf16). Prints one JSON line, ``RESULT {...}``.

Two things a CPU machine cannot provide are stood in for, and reported in the output:

- fla's ``recompute_w_u_fwd`` / ``chunk_scaled_dot_kkt_fwd`` verifiers also ask ``k.device.type == "npu"``;
  tensors here are CPU tensors, so that one reason ("input device is not NPU") is ignored; every
  other verifier check runs.
- launch options that this triton-ascend lacks (3.2.0: ``enable_ubuf_saving``, which fla-core 0.6's
  ``chunk_gated_delta_rule_h_fwd`` kernel passes for triton-ascend >= 3.6) are dropped and listed.

``--grid-check T N``: the same calls at that size with ``meta`` tensors (no data; ``cu`` on the host),
recording every launch's grid; triton-ascend raises above 65 535 programs. ``--negative-control``: a kernel
whose length is a ``tl.constexpr`` instead (must recompile per T).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import traceback

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="gdn_ascend_probe_")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fake_npu_driver  # noqa: E402

RECORD = fake_npu_driver.install()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# Qwen3-Next-80B-A3B linear attention: 16 q/k heads, 32 v heads, head dims 128, conv width 4
HK, HV, D, W = 16, 32, 128, 4
# packed layouts (T, N, an empty segment?); the first compiles, the rest must not
# (N = 260: the decode launches in three slices of sequences)
LAYOUTS = [(1000, 1, False), (1025, 3, False), (2047, 5, True), (3001, 2, False), (4096, 17, False),
           (5000, 9, True), (7777, 64, False), (8192, 260, False)]

ROUTINGS: list[str] = []
DROPPED: set[str] = set()


class _Routes(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("[FLA Backend]") and "rejected" not in msg:
            ROUTINGS.append(msg[len("[FLA Backend] "):])


def stand_in_npu_tensors_and_options():
    """The two stand-ins described in the module docstring."""
    from fla.backends import BaseBackend
    from triton.backends.ascend.compiler import NPUOptions
    from triton.runtime.jit import JITFunction
    logging.getLogger("fla.backends").setLevel(logging.INFO)
    logging.getLogger("fla.backends").addHandler(_Routes())
    verify = BaseBackend.verify

    def verify_on_cpu_tensors(self, function_name, *args, **kwargs):
        ok, why = verify(self, function_name, *args, **kwargs)
        if not ok and self.backend_type == "triton_ascend" and why == "input device is not NPU":
            return True, None
        return ok, why

    BaseBackend.verify = verify_on_cpu_tensors
    fields = set(NPUOptions.__dataclass_fields__)
    run = JITFunction.run

    def run_without_unknown_options(self, *args, grid, warmup, **kwargs):
        for k in [k for k in kwargs if k not in self.arg_names and k not in fields]:
            DROPPED.add(k)
            kwargs.pop(k)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    JITFunction.run = run_without_unknown_options


def packed_cu(T, N, empty):
    cu = torch.linspace(0, T, N + 1).round().long()
    if empty and N >= 2:
        cu[1] = cu[2]            # sequence 1 has no tokens
    return cu


SPLIT_CONV = False   # --split-conv


def layer_calls(T, N, empty=False, device="cpu", dtype=torch.bfloat16):
    """Every kernel launch of one layer forward+backward (and a decode step of N sequences) on the
    ``ascend`` backend: the Backend object's callables with the shapes the layer gives them. Data is
    uninitialised: nothing runs, only compiles and grids are looked at. ``cu`` stays on the host (with
    ``device="meta"``, the tensors have no values; fla sizes its chunk grids from ``cu``'s values)."""
    from gdn_layer.kernels import ascend_backend
    be = ascend_backend.make_backend()
    cu = packed_cu(T, N, empty)
    C = 2 * HK * D + HV * D
    e = dict(device=device, dtype=dtype)
    mixed = torch.empty(1, T, C + 2 * HV, **e)            # the all-to-all receive buffer
    weight = torch.empty(C, W, **e)
    conv_h0 = torch.empty(N, C, W - 1, device=device)
    y, fin = be.causal_conv1d(mixed[..., :C], weight, None, "silu", cu, conv_h0, True)
    be.causal_conv1d_bwd(y, fin, mixed[..., :C], weight, None, "silu", cu, conv_h0)
    # the layer in training (the conv_gate op): neither initial nor final state (the plain tiles of the forward and
    # the dx pass), the dx pass writing its columns of the pre-conv buffer's gradient, the gate's its last 2 HV
    dmixed = torch.empty_like(mixed)
    y_plain, _ = be.causal_conv1d(mixed[..., :C], weight, None, "silu", cu, None, False)
    be.causal_conv1d_bwd(y_plain, None, mixed[..., :C], weight, None, "silu", cu, None, dx=dmixed[..., :C])
    if SPLIT_CONV:   # the split conv's kernels (PARTS == 3), whatever the backend's conv_splits flag
        parts, fin = be.causal_conv1d(mixed[..., :C], weight, None, "silu", cu, conv_h0, True,
                                      split_sizes=[HK * D, HK * D, HV * D])
        be.causal_conv1d_bwd(parts, fin, mixed[..., :C], weight, None, "silu", cu, conv_h0)
    a, b = mixed[..., C:C + HV], mixed[..., C + HV:]
    A_log, dt_bias = torch.empty(HV, device=device), torch.empty(HV, device=device)
    gate, beta = be.gdn_gate(a, b, A_log, dt_bias)
    be.gdn_gate_bwd(gate, beta, a, b, A_log, dt_bias, da=dmixed[..., C:C + HV], db=dmixed[..., C + HV:])
    q = y[..., :HK * D].unflatten(-1, (HK, D))
    k = y[..., HK * D:2 * HK * D].unflatten(-1, (HK, D))
    v = y[..., 2 * HK * D:].unflatten(-1, (HV, D))
    state = torch.empty(N, HV, D, D, device=device)
    o, s = be.chunk_gated_delta_rule(q, k, v, gate, beta, D ** -0.5, state, True, cu, True)
    be.chunk_gated_delta_rule_bwd(o, s, q, k, v, gate, beta, D ** -0.5, state, cu, True)
    z = torch.empty(1, T, HV, D, **e)
    norm_w = torch.empty(D, **e)
    be.gated_rms_norm(o, z, norm_w, 1e-6)
    be.gated_rms_norm_bwd(o, o, z, norm_w, 1e-6)
    # decode: one token for each of the N sequences, continuing from their states
    dcu = torch.arange(N + 1)
    qd, kd, vd = (torch.empty(1, N, h, D, **e) for h in (HK, HK, HV))
    gd, bd = torch.empty(1, N, HV, device=device), torch.empty(1, N, HV, **e)
    be.recurrent_gated_delta_rule(qd, kd, vd, gd, bd, D ** -0.5, state, True, dcu, True)


def negative_control(T, device="cpu"):
    """A kernel that takes its length as a ``tl.constexpr``: one compile per T, and ``cdiv(T, 128)``
    programs in one launch."""

    @triton.jit
    def scale_kernel(x, T: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x + i, tl.load(x + i, mask=i < T) * 2, mask=i < T)

    scale_kernel[(triton.cdiv(T, 128),)](torch.empty(T, device=device), T, BLOCK=128)


def compile_run(args):
    per_layout = []
    layouts = LAYOUTS[:args.layouts]
    for T, N, empty in layouts:
        before = len(RECORD.compiles)
        if args.negative_control:
            negative_control(T)
        else:
            layer_calls(T, N, empty)
        per_layout.append({"T": T, "N": N, "empty_segment": empty, "compiles": len(RECORD.compiles) - before,
                           "new": [c["kernel"] for c in RECORD.compiles[before:]]})
    return {"first": per_layout[0]["compiles"], "after_first": sum(r["compiles"] for r in per_layout[1:]),
            "layouts": per_layout, "kernels": sorted({c["kernel"] for c in RECORD.compiles})}


def _max_programs(launches):
    """kernel name -> the most programs one of its launches had."""
    most: dict[str, int] = {}
    for x in launches:
        g = x["grid"]
        most[x["kernel"]] = max(most.get(x["kernel"], 0), g[0] * g[1] * g[2])
    return most


def grid_run(args):
    # record every launch's grid instead of stopping at the first the JIT refuses: the test asserts the
    # same 65 535 limit on each recorded grid (this switch only lifts the JIT's check and adds a compile
    # option of the stubbed npubin stage)
    os.environ["TRITON_ALL_BLOCKS_PARALLEL"] = "1"
    out = []
    for T, N in args.grid_check:
        before = len(RECORD.launches)
        err = None
        try:
            if args.negative_control:
                negative_control(T, device="meta")
            else:
                layer_calls(T, N, device="meta")
        except Exception as e:  # the JIT's "grid should be less than 65536", or anything else
            err = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            traceback.print_exc()
        launches = RECORD.launches[before:]
        out.append({"T": T, "N": N, "error": err,
                    "programs": _max_programs(launches)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", type=int, default=len(LAYOUTS), help="how many of LAYOUTS to run (0: none)")
    ap.add_argument("--negative-control", action="store_true")
    ap.add_argument("--grid-check", type=int, nargs=2, action="append", metavar=("T", "N"))
    ap.add_argument("--kill-adapter-on", metavar="KERNEL",
                    help="make triton-adapter-opt die by SIGSEGV whenever it lowers KERNEL (the retry's test)")
    ap.add_argument("--split-conv", action="store_true",
                    help="also lower the split conv (q, k, v written as three parts: PARTS == 3)")
    args = ap.parse_args(argv)
    global SPLIT_CONV
    SPLIT_CONV = args.split_conv
    if args.kill_adapter_on:
        fake_npu_driver.kill_adapter_on(args.kill_adapter_on)
    stand_in_npu_tensors_and_options()
    import fla.utils
    from importlib.metadata import version
    res = {"triton_ascend": version("triton-ascend"), "fla_is_npu": bool(fla.utils.IS_NPU),
           "grid_limit": fake_npu_driver.GRID_LIMIT}
    if args.layouts:
        res.update(compile_run(args))
        res["routings"] = sorted(set(ROUTINGS))
        res["dropped_options"] = sorted(DROPPED)
        res["lowered"] = RECORD.lowered
        from gdn_layer.kernels import ascend_backend
        res["conv_splits"] = ascend_backend.make_backend().conv_splits   # (one conv per part; --split-conv lowers the split)
    if args.grid_check:
        res["grids"] = grid_run(args)
    res["adapter_crashes"] = RECORD.adapter_crashes     # lowerings run again (fake_npu_driver.retry_on_signal)
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
