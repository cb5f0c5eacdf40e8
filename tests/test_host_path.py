"""The layer's own work around the kernels in a training step (issue 23, item 1: launches on the hot path).

A backend whose functions only allocate their outputs stands in for the kernels, and a dispatch mode
records every aten op the layer itself issues (the custom ops count as one op each; what runs inside
them is the backend's). Rule: with one rank (no SP) the backward builds no zero-filled gradient of a
slice or select of a parameter (``weight[s:s + w]``, ``A_log[a:b]``, ``conv.weight[:, 0, :]``): each would
cost a fill, a copy and an add per call on the device for nothing.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gdn_layer import GatedDeltaNet, GDNState
from gdn_layer.kernels import registry
from gdn_layer.kernels.validation import skip_value_checks

E = torch.empty_like
ZERO_FILLS = {"zeros", "zeros_like", "zero_", "fill_", "new_zeros", "slice_backward", "select_backward",
              "index_put", "index_put_"}


@pytest.fixture(scope="module")
def alloc_only_backend():
    def chunk(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu=None,
              use_qk_l2norm=False):
        N = cu.numel() - 1
        return E(v), (q.new_empty(N, v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32)
                      if output_final_state else None)

    def chunk_bwd(do, dfinal, q, k, v, g, beta, scale=None, initial_state=None, cu=None, use_qk_l2norm=False):
        return E(q), E(k), E(v), E(g), E(beta), (None if initial_state is None else E(initial_state))

    def conv(x, weight, bias=None, activation="silu", cu=None, initial_state=None, output_final_state=False):
        N = cu.numel() - 1
        return E(x, memory_format=torch.contiguous_format), (
            x.new_empty(N, x.shape[2], weight.shape[1] - 1, dtype=torch.float32) if output_final_state else None)

    def conv_bwd(dy, dfinal, x, weight, bias=None, activation="silu", cu=None, initial_state=None):
        return E(x), E(weight), None, (None if initial_state is None else E(initial_state))

    base = registry.backend_by_name("torch")
    b = dataclasses.replace(
        base, name="alloc_only", priority=-9, dense_as_packed=True,
        chunk_gated_delta_rule=chunk, chunk_gated_delta_rule_bwd=chunk_bwd, causal_conv1d=conv,
        causal_conv1d_bwd=conv_bwd, gdn_gate=lambda a, b, A_log, dt_bias: (E(a, dtype=torch.float32), E(b)),
        gdn_gate_bwd=lambda dg, dbeta, a, b, A_log, dt_bias: (E(a), E(b), E(A_log), E(dt_bias)),
        gated_rms_norm=lambda x, z, weight, eps=1e-6: E(x),
        gated_rms_norm_bwd=lambda dy, x, z, weight, eps=1e-6: (E(x), E(z), E(weight)))
    registry.register_backend(b)
    yield b.name
    registry._BACKENDS.pop(b.name)


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (isinstance(out, torch.Tensor) and out.numel() == 0):   # (an empty result launches nothing)
            self.names.append(func.overloadpacket.__name__)
        return out


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
    forward, backward = OpLog(), OpLog()
    with skip_value_checks(), forward:   # (the stand-in kernels' outputs are uninitialised memory)
        out = layer(x, cu_seqlens=cu, state=state, output_state=with_state)
        # (the final state in the loss too: an unused output's gradient is zeros that torch makes)
        loss = out[0].sum() + out[1].conv_state.sum() + out[1].recurrent_state.sum() if with_state else out.sum()
    with skip_value_checks(), backward:
        loss.backward()
    assert layer.conv1d.weight.grad is not None and layer.A_log.grad is not None   # the backward did run
    assert "causal_conv1d_bwd" in backward.names and "gdn_gate_bwd" in backward.names
    assert not ZERO_FILLS & set(forward.names), sorted(ZERO_FILLS & set(forward.names))
    assert not ZERO_FILLS & set(backward.names), sorted(ZERO_FILLS & set(backward.names))
