"""The layer's own work around the kernels in a training step: the launches on the hot path.

A backend whose functions only allocate their outputs stands in for the kernels, and a dispatch mode
records every aten op the layer itself issues (the custom ops count as one op each; what runs inside
them is the backend's). Rule: with one rank (no SP) the backward builds no zero-filled gradient of a
slice or select of a parameter (``weight[s:s + w]``, ``A_log[a:b]``, ``conv.weight[:, 0, :]``): each would
cost a fill, a copy and an add per call on the device for nothing.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gdn_layer import GatedDeltaNet, GDNState
from gdn_layer.kernels import registry
from gdn_layer.kernels.validation import skip_value_checks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

ZERO_FILLS = {f"aten::{op}" for op in ("zeros", "zeros_like", "zero_", "fill_", "new_zeros", "slice_backward",
                                        "select_backward", "index_put", "index_put_")}


@pytest.fixture(scope="module", params=[False, True], ids=["per_part", "conv_splits"])
def alloc_only_backend(request):
    """The benchmark's stand-in, with and without ``conv_splits`` (the layer's two conv paths)."""
    from bench_null_backend import alloc_only_backend as make   # (benchmarks/: the benchmark's stand-in)
    b = make("alloc_only", conv_splits=request.param)
    registry.register_backend(b)
    yield b.name
    registry._BACKENDS.pop(b.name)


def conv_ops(backend: str) -> list[str]:
    """The conv's and the gate's custom ops in one layer forward+backward: one ``conv_gate`` op each way, with
    or without ``conv_splits`` (what differs is inside it)."""
    return ["gdn_layer::conv_gate", "gdn_layer::conv_gate_bwd"]


@pytest.mark.parametrize("with_state", [False, True])
def test_backward_builds_no_zero_filled_parameter_gradients(alloc_only_backend, with_state):
    torch.manual_seed(0)
    layer = GatedDeltaNet(64, 2, 4, 16, 16, backend=alloc_only_backend)
    T, cu = 24, torch.tensor([0, 10, 24])
    x = torch.randn(1, T, 64, requires_grad=True)
    state = None
    if with_state:
        state = GDNState(torch.randn(2, layer.conv_dim, 3, requires_grad=True),
                         torch.randn(2, 4, 16, 16, requires_grad=True))
    from bench_null_backend import OpLog
    forward, backward = OpLog(skip_empty=True), OpLog(skip_empty=True)   # (an empty result launches nothing)
    with skip_value_checks(), forward:   # (the stand-in kernels' outputs are uninitialised memory)
        out = layer(x, cu_seqlens=cu, state=state, output_state=with_state)
        # (the final state in the loss too: an unused output's gradient is zeros that torch makes)
        loss = out[0].sum() + out[1].conv_state.sum() + out[1].recurrent_state.sum() if with_state else out.sum()
    with skip_value_checks(), backward:
        loss.backward()
    assert layer.conv1d.weight.grad is not None and layer.A_log.grad is not None   # the backward did run
    assert conv_ops(alloc_only_backend)[1] in backward.names
    assert not ZERO_FILLS & set(forward.names), sorted(ZERO_FILLS & set(forward.names))
    assert not ZERO_FILLS & set(backward.names), sorted(ZERO_FILLS & set(backward.names))
    # x feeds two projections: its gradient is summed inside their backward's GEMMs, not by an extra add
    assert "aten::add" not in backward.names and "aten::addmm_" in backward.names, backward.names


def test_one_layer_call_is_its_custom_ops_and_counted_by_the_benchmark(alloc_only_backend, monkeypatch, capsys):
    """Forward + backward of a packed training call: one custom op each for the conv and gate
    (``conv_gate``), the chunk rule and the norm, and their backwards: 6 in all, with or without
    ``conv_splits`` (before ``conv_gate``: 8 with the flag, 12 without, as the CUDA backends ship); the
    benchmark's ``--count-ops`` reports the same."""
    import bench_null_backend
    monkeypatch.setattr(registry, "_BACKENDS", dict(registry._BACKENDS))   # (main() registers "null": undone after)
    monkeypatch.setattr(sys, "argv", ["bench_null_backend.py", "--T", "24", "--count-ops"])
    bench_null_backend.main()
    out = capsys.readouterr().out
    assert "(custom ops 6: [" in out and f"'{conv_ops('null')[1]}'" in out, out
    layer = GatedDeltaNet(64, 2, 4, 16, 16, backend=alloc_only_backend)
    x = torch.randn(1, 24, 64, requires_grad=True)
    names = bench_null_backend.dispatched_ops(lambda: layer(x, cu_seqlens=torch.tensor([0, 10, 24])).sum().backward())
    assert sorted(n for n in names if n.startswith("gdn_layer::")) == sorted(conv_ops(alloc_only_backend) + [
        f"gdn_layer::{op}{suffix}" for op in ("chunk_gated_delta_rule", "gated_rms_norm")
        for suffix in ("", "_bwd")])


def test_ops_skip_the_custom_op_wrappers(alloc_only_backend):
    """The kernels are plain ``torch.library`` operators with a ``torch.autograd.Function`` each
    (``kernels/ops_library.py``): no Python of ``torch.library.custom_op``'s per-call wrappers (defaults, aliasing
    checks, generated autograd) runs in a training step; it cost the layer a third of its own host time.
    The operators themselves still run (by name, in the dispatcher)."""
    layer = GatedDeltaNet(64, 2, 4, 16, 16, backend=alloc_only_backend)
    x, cu = torch.randn(1, 24, 64, requires_grad=True), torch.tensor([0, 10, 24])
    wrapper_files = ("custom_ops.py", "autograd.py", "infer_schema.py")
    seen = []

    def spy(frame, event, arg):
        path = frame.f_code.co_filename.replace("\\", "/")
        if event == "call" and "/torch/_library/" in path and path.endswith(wrapper_files):
            seen.append(f"{path.split('/torch/')[1]}:{frame.f_code.co_name}")
    from bench_null_backend import OpLog
    log = OpLog(skip_empty=True)
    with skip_value_checks(), log:
        sys.setprofile(spy)
        try:
            layer(x, cu_seqlens=cu).sum().backward()
        finally:
            sys.setprofile(None)
    assert not seen, sorted(set(seen))
    assert "gdn_layer::conv_gate" in log.names and "gdn_layer::conv_gate_bwd" in log.names


def test_launchers_do_not_call_tritons_constexpr_helpers_on_the_host(monkeypatch):
    """``triton.cdiv`` / ``triton.next_power_of_2`` are ``constexpr_function`` wrappers (Triton >= 3.5, about 3 µs
    per host call; ~45 calls per layer step on the conv alone): our launchers size their grids and blocks with
    ``kernels/triton/_grid.py``'s plain ``cdiv`` / ``next_power_of_2`` instead. Every launcher runs here (the
    interpreter) with both wrappers made to raise."""
    import triton

    from gdn_layer.kernels import triton_ops

    def refuse(*a, **k):
        raise AssertionError("a launcher called triton's host-side constexpr helper")
    monkeypatch.setattr(triton, "cdiv", refuse)
    monkeypatch.setattr(triton, "next_power_of_2", refuse)
    torch.manual_seed(5)
    B, T, Hk, Hv, D, W = 1, 12, 2, 4, 16, 4
    cu = torch.tensor([0, 5, 12])
    x = torch.randn(B, T, Hk * D)
    w = torch.randn(Hk * D, W)
    y, fin, rstd = triton_ops.conv_fwd(x, w, None, "silu", cu, None, True, l2norm_dim=D)
    triton_ops.conv_bwd(torch.randn_like(y), torch.randn_like(fin), x, w, None, "silu", cu, None,
                        l2norm_out=(y, rstd))
    h0 = torch.randn(2, Hk * D, W - 1)
    y, fin = triton_ops.conv_fwd(x, w, torch.randn(Hk * D), "silu", cu, h0, True)
    triton_ops.conv_bwd(torch.randn_like(y), torch.randn_like(fin), x, w, torch.randn(Hk * D), "silu", cu, h0)
    a, b, A_log, dt_bias = torch.randn(B, T, Hv), torch.randn(B, T, Hv), torch.randn(Hv), torch.randn(Hv)
    g, beta = triton_ops.gate_fwd(a, b, A_log, dt_bias)
    triton_ops.gate_bwd(torch.randn_like(g), torch.randn_like(beta), a, b, A_log, dt_bias)
    o, z, nw = torch.randn(B, T, Hv, D), torch.randn(B, T, Hv, D), torch.randn(D)
    triton_ops.norm_fwd(o, z, nw)
    triton_ops.norm_bwd(torch.randn_like(o), o, z, nw)
    q, k = torch.randn(B, T, Hk, D), torch.randn(B, T, Hk, D)
    triton_ops.l2norm_qk_bwd(q, k, *triton_ops.l2norm_qk_fwd(q, k))
