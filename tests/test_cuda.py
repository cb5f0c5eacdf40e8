"""CUDA tensors through the layer and kernels equal the CPU results (run on the GPU machine).

The fp32 comparisons at 1e-5 use ``backend="torch"`` (the oracle on CUDA, TF32 off); the compiled
backends (fla's kernels use TF32 dots in fp32) are compared against it in bf16 in
``test_cuda_backends.py``, and here under Ulysses over NCCL.

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
                                  output_final_state=True, use_qk_l2norm=True, backend="torch")
    assert o.is_cuda and rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5


def test_layer_on_cuda_equals_cpu_forward_backward_and_decode():
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    layer = GatedDeltaNet(64, 2, 4, 16, 16)
    gpu = GatedDeltaNet(64, 2, 4, 16, 16, device="cuda", backend="torch")
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


def _nccl_worker(rank, world, port, validate, backend, out):
    import os

    import torch.distributed as dist

    from gdn_layer.kernels import set_validation
    from gdn_layer.parallel import gather_sequence, reduce_sp_grads, shard_sequence
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    set_validation(validate)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    # torch: fp32 against one GPU; a compiled backend: bf16 (Dk = Dv = 128: FlashQLA's shapes) against
    # the fp32 torch reference on one GPU
    dims = (64, 2, 4, 16, 16) if backend == "torch" else (256, 2, 4, 128, 128)
    dtype = torch.float32 if backend == "torch" else torch.bfloat16
    ref = GatedDeltaNet(*dims, device="cuda", backend="torch")
    with torch.no_grad():
        ref.A_log.uniform_(-4, -2)                      # slow decay: a wrong hand-off would show
    layer = GatedDeltaNet(*dims, sp_group=dist.group.WORLD, device="cuda", dtype=dtype, backend=backend)
    layer.load_state_dict({k: v.to(dtype) for k, v in ref.state_dict().items()})
    cu = torch.tensor([0, 37, 88, 128], device="cuda")
    x = torch.randn(1, 128, dims[0], device="cuda")
    y_ref, st_ref = ref(x, cu_seqlens=cu, output_state=True)
    (y_ref.square().sum() + st_ref.recurrent_state.sum()).backward()
    y, st = layer(shard_sequence(x.to(dtype), dist.group.WORLD), cu_seqlens=cu, output_state=True)
    # each rank: its tokens' loss plus 1/P of the state term (the full state is on every rank, and its
    # backward is a collective that every rank must join), so the sum over ranks is the loss
    (y.float().square().sum() + st.recurrent_state.sum() / world).backward()
    reduce_sp_grads(layer, dist.group.WORLD)
    errs = [rel_err(gather_sequence(y.detach(), dist.group.WORLD), y_ref), rel_err(st.recurrent_state, st_ref.recurrent_state)]
    errs += [rel_err(p.grad, q.grad) for p, q in zip(layer.parameters(), ref.parameters())]
    torch.save((layer.resolved_backend, errs), os.path.join(out, f"errs{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("backend, validate", [("torch", False), ("torch", True), ("auto", False)])
def test_sp2_over_nccl_matches_one_gpu(tmp_path, backend, validate):
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_nccl_worker, args=(2, port, validate, backend, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        resolved, errs = torch.load(tmp_path / f"errs{rank}.pt")
        print(f"rank {rank} backend {resolved}: max rel err {max(errs):.2e}")
        assert max(errs) <= (1e-5 if backend == "torch" else 3e-2), errs
