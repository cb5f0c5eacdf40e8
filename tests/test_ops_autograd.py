"""The kernel ops' autograd (``kernels/ops_*.py``: plain operators with a ``torch.autograd.Function`` each).

- Their gradients are first order only: differentiating them again raises (it returned partial or zero
  second derivatives, with a warning, before the ops refused it).
- Under ``torch.inference_mode()`` autograd records nothing, even with ``enable_grad`` inside it, as for
  torch's own ops (a Function would try to save inference tensors).
- ``importlib.reload`` of an ops module replaces its previous definitions.
"""
import importlib

import pytest
import torch

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import causal_conv1d, causal_conv1d_split, chunk_gated_delta_rule, gated_rms_norm, gdn_gate


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _conv(x):
    w = torch.randn(6, 4, generator=_gen(1))
    return causal_conv1d(x, w, backend="torch")[0]


def _conv_split(x):
    w = torch.randn(6, 4, generator=_gen(1))
    return torch.cat(causal_conv1d_split(x, w, [2, 1, 3], backend="torch")[0], -1)


def _gate(x):
    A_log, dt_bias = torch.randn(6, generator=_gen(2)), torch.randn(6, generator=_gen(3))
    g, beta = gdn_gate(x, x * 0.5, A_log, dt_bias, backend="torch")
    return g + beta


def _norm(x):
    z, w = torch.randn(x.shape, generator=_gen(4)), torch.rand(6, generator=_gen(5)) + 0.5
    return gated_rms_norm(x, z, w, backend="torch")


def _chunk(x):
    B, T, _ = x.shape
    q = x.reshape(B, T, 2, 3)
    k = torch.nn.functional.normalize(torch.randn(B, T, 2, 3, generator=_gen(6)), dim=-1)
    v = torch.randn(B, T, 2, 3, generator=_gen(7))
    g = -torch.rand(B, T, 2, generator=_gen(8)) * 0.1          # slow decay
    beta = torch.rand(B, T, 2, generator=_gen(9))
    return chunk_gated_delta_rule(q, k, v, g, beta, backend="torch")[0]


OPS = {"causal_conv1d": _conv, "causal_conv1d_split": _conv_split, "gdn_gate": _gate,
       "gated_rms_norm": _norm, "chunk_gated_delta_rule": _chunk}


@pytest.mark.parametrize("name", list(OPS))
def test_first_order_gradients_match_and_a_double_backward_raises(name):
    f = OPS[name]
    x = torch.randn(1, 9, 6, generator=_gen(0), dtype=torch.float64).float().requires_grad_()
    (g,) = torch.autograd.grad(f(x).pow(2).sum(), x, create_graph=True)
    (plain,) = torch.autograd.grad(f(x).pow(2).sum(), x)
    assert g.requires_grad and torch.allclose(g.detach(), plain, rtol=1e-6, atol=1e-6)   # (first order intact)
    with pytest.raises(RuntimeError, match=f"gdn_layer::{name} is not twice differentiable"):
        g.pow(2).sum().backward()


def test_inference_mode_records_nothing_even_under_enable_grad():
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 8, 8, backend="torch")
    x, cu = torch.randn(1, 12, 32), torch.tensor([0, 5, 12])
    with torch.no_grad():
        want = layer(x, cu_seqlens=cu)
    with torch.inference_mode(), torch.enable_grad():
        got = layer(x, cu_seqlens=cu)
    assert not got.requires_grad and torch.equal(got, want)


def test_reloading_the_ops_modules_replaces_their_definitions():
    from gdn_layer.kernels import ops_conv, ops_conv_gate, ops_delta_rule, ops_gate, ops_library, ops_norm
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2, 4, 8, 8, backend="torch")
    x, cu = torch.randn(1, 12, 32, requires_grad=True), torch.tensor([0, 5, 12])
    layer(x, cu_seqlens=cu).pow(2).sum().backward()
    before, x.grad = x.grad.clone(), None
    for module in (ops_library, ops_delta_rule, ops_conv, ops_gate, ops_conv_gate, ops_norm):
        importlib.reload(module)
    layer(x, cu_seqlens=cu).pow(2).sum().backward()
    assert torch.equal(x.grad, before)
