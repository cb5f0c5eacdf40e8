"""The layer on our Triton kernels (conv, gate, gated norm, as the CUDA backends bind them through
``kernels/triton_ops.py``), run on CPU under Triton's interpreter, equals the layer on the torch
backend: outputs, states, every parameter gradient, decode. fla's chunk kernels do not run under the
interpreter, so this backend keeps the torch chunk/recurrent ops; they are checked on the GPU
(tests/test_cuda_backends.py)."""
import dataclasses

import pytest
import torch

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import registry


# one conv per part (as shipped), and the split kernels; the gradient of the pre-conv buffer written in place by
# the kernels (as shipped), and concatenated
@pytest.mark.parametrize("conv_splits", [False, True])
@pytest.mark.parametrize("grads_into", [True, False])
def test_the_triton_kernels_bound_as_the_cuda_backends_bind_them_match_the_torch_layer(triton_cpu_backend,
                                                                                        conv_splits, grads_into,
                                                                                        monkeypatch):
    b = registry.backend_by_name(triton_cpu_backend)
    monkeypatch.setitem(registry._BACKENDS, triton_cpu_backend,
                        dataclasses.replace(b, conv_splits=conv_splits, grads_into=grads_into))
    torch.manual_seed(0)
    ref = GatedDeltaNet(32, 1, 2, 8, 8, backend="torch")
    with torch.no_grad():
        ref.A_log.uniform_(-4, -2)
        ref.conv1d.weight.normal_(0, 0.3)
    fast = GatedDeltaNet(32, 1, 2, 8, 8, backend=triton_cpu_backend)
    fast.load_state_dict(ref.state_dict())
    cu = torch.tensor([0, 2, 2, 40, 70])
    x = torch.randn(1, 70, 32)
    outs = []
    for layer in (ref, fast):
        xi = x.clone().requires_grad_(True)
        y, st = layer(xi, cu_seqlens=cu, output_state=True)
        (y.square().sum() + st.recurrent_state.sum() + st.conv_state.square().sum()).backward()
        step = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(1))
        y1 = layer(step, cu_seqlens=torch.arange(5), state=st.detach())
        outs.append((y, st, xi.grad, [p.grad for p in layer.parameters()], y1))
    (y_r, st_r, gx_r, gp_r, y1_r), (y_f, st_f, gx_f, gp_f, y1_f) = outs
    close = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(y_f, y_r, **close)
    torch.testing.assert_close(st_f.conv_state, st_r.conv_state, **close)
    torch.testing.assert_close(st_f.recurrent_state, st_r.recurrent_state, **close)
    torch.testing.assert_close(gx_f, gx_r, **close)
    for (name, _), a, b in zip(ref.named_parameters(), gp_f, gp_r):
        torch.testing.assert_close(a, b, **close, msg=name)
    torch.testing.assert_close(y1_f, y1_r, **close)
