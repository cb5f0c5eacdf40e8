"""What a new user met (README-only trial): autocast, warmup's dtype, backend registration, queries."""
import dataclasses

import torch

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import available_backends, registry, warmup


def test_fp32_layer_under_bf16_autocast_after_a_linear_layer():
    torch.manual_seed(0)
    layer, lin = GatedDeltaNet(64, 2, 4, 16, 16), torch.nn.Linear(64, 64)
    x, cu = torch.randn(1, 30, 64), torch.tensor([0, 10, 30])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(x)
        assert h.dtype == torch.bfloat16
        y = layer(h, cu_seqlens=cu)
    y.float().square().mean().backward()
    ref = layer(lin(x).float(), cu_seqlens=cu)
    assert y.dtype == torch.bfloat16 and all(p.grad is not None for p in layer.parameters())
    assert float((y.float() - ref).norm() / ref.norm()) < 3e-2


def test_warmup_builds_for_another_activation_dtype_under_autocast():
    layer = GatedDeltaNet(32, 1, 2, 8, 8)
    assert warmup(layer, dtype=torch.bfloat16) > 0
    assert all(p.grad is None for p in layer.parameters())


def test_available_backends_on_a_device_this_torch_cannot_use_is_a_list():
    names = available_backends("cuda")
    assert "torch" in names and (torch.cuda.is_available() or names == ["torch"])


def test_a_backend_whose_available_returns_a_bool_registers():
    b = dataclasses.replace(registry.backend_by_name("torch"), name="bool_avail", priority=-5,
                            available=lambda device: device.type == "cpu")
    registry.register_backend(b)
    try:
        assert "bool_avail" in available_backends("cpu")
        assert registry.resolve_backend("bool_avail", "cpu").name == "bool_avail"
    finally:
        registry._BACKENDS.pop("bool_avail")
