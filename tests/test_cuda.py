"""CUDA tensors through the layer and kernels equal the CPU results (run on the GPU machine).

Marked ``cuda``; skipped where no GPU is present (CI is CPU-only; these ran on the device, see
docs/finetune.md for the command).
"""
import pytest
import torch

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import chunk_gated_delta_rule, recurrent_gated_delta_rule

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def rel_err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_chunk_kernel_on_cuda_matches_the_float64_recurrence_on_cpu():
    torch.manual_seed(0)
    T, cu = 300, torch.tensor([0, 100, 100, 300])
    q, k = torch.randn(1, T, 2, 32), torch.randn(1, T, 2, 32)
    v, g, beta = torch.randn(1, T, 6, 16), -torch.rand(1, T, 6) * 0.2, torch.rand(1, T, 6)
    o_ref, s_ref = recurrent_gated_delta_rule(*(x.double() for x in (q, k, v, g, beta)), cu_seqlens=cu,
                                              output_final_state=True, use_qk_l2norm=True)
    # fp32 on the GPU may use TF32 in matmuls; keep it off to compare at fp32 precision
    torch.backends.cuda.matmul.allow_tf32 = False
    o, s = chunk_gated_delta_rule(*(x.cuda() for x in (q, k, v, g, beta)), cu_seqlens=cu.cuda(),
                                  output_final_state=True, use_qk_l2norm=True)
    assert o.is_cuda and rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5


def test_layer_on_cuda_equals_cpu_forward_backward_and_decode():
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    layer = GatedDeltaNet(64, 2, 4, 16, 16)
    gpu = GatedDeltaNet(64, 2, 4, 16, 16, device="cuda")
    gpu.load_state_dict(layer.state_dict())
    cu = torch.tensor([0, 70, 130], dtype=torch.int32)
    x = torch.randn(1, 130, 64, requires_grad=True)
    xg = x.detach().cuda().requires_grad_(True)
    y, st = layer(x, cu_seqlens=cu, output_state=True)
    yg, stg = gpu(xg, cu_seqlens=cu.cuda(), output_state=True)
    y.square().sum().backward()
    yg.square().sum().backward()
    assert rel_err(yg, y) <= 1e-5 and rel_err(xg.grad, x.grad) <= 1e-5
    assert rel_err(stg.recurrent_state, st.recurrent_state) <= 1e-5
    for (name, p), pg in zip(layer.named_parameters(), gpu.parameters()):
        assert rel_err(pg.grad, p.grad) <= 1e-5, name
    step = torch.randn(1, 2, 64)
    y1 = layer(step, cu_seqlens=torch.tensor([0, 1, 2]), state=st)
    y1g = gpu(step.cuda(), cu_seqlens=torch.tensor([0, 1, 2]).cuda(), state=stg)
    assert rel_err(y1g, y1) <= 1e-5


def test_bf16_layer_on_cuda_is_close_to_fp32():
    torch.manual_seed(0)
    layer = GatedDeltaNet(128, 4, 8, 32, 32, device="cuda")
    half = GatedDeltaNet(128, 4, 8, 32, 32, device="cuda", dtype=torch.bfloat16)
    half.load_state_dict(layer.state_dict())
    x = torch.randn(1, 1000, 128, device="cuda")
    y, y16 = layer(x), half(x.bfloat16())
    assert torch.isfinite(y16).all() and rel_err(y16, y) <= 2e-2
