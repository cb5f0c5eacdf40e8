"""The token mixing replayed from per-signature CUDA graphs (gdn_layer/mix_graphs.py) on the GPU (run on the GPU
machine; skipped elsewhere): replays over new packings of one capacity and over layers sharing a capture, in any
order of forwards and backwards, give the op-by-op results and gradients; a replayed call reads nothing back to
the host. The CPU semantics (signatures, fallbacks, errors): tests/test_mix_graphs.py."""
import pytest
import torch

import gdn_layer.mix_graphs as mg
from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import available_backends

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = [b for b in ("fla", "auto", "flash_qla") if torch.cuda.is_available()
            and (b == "auto" or b in available_backends("cuda"))]


@pytest.fixture
def graphs():
    before = mg.set_enabled(True)
    mg.clear()
    yield mg
    mg.clear()
    mg.set_enabled(before)


def layer(backend, seed, D):
    torch.manual_seed(seed)
    m = GatedDeltaNet(256, 2, 4, D, D, backend=backend, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        m.A_log.uniform_(-4, -2)
        m.dt_bias.normal_(0, 0.5)
        m.norm.weight.normal_(1, 0.2)
    return m.to(torch.bfloat16)


def packs(T=640):
    g = torch.Generator().manual_seed(3)
    out = []
    for n in (1, 3, 7, 5):
        cuts = sorted(torch.randperm(T - 1, generator=g)[:n - 1].add(1).tolist())
        cu = torch.tensor([0, *cuts, T], dtype=torch.int32, device="cuda")
        out.append((torch.randn(1, T, 256, generator=g).to("cuda", torch.bfloat16), cu))
    return out


def step(models, x, cu):
    """Two layers, a third forward of the first before any backward: y = b(a(x)) and a(x / 2)."""
    a, b = models
    h = x.clone().requires_grad_(True)
    y = b(a(h, cu_seqlens=cu), cu_seqlens=cu)
    y2 = a(h * 0.5, cu_seqlens=cu)
    (y.float().pow(2).sum() + y2.float().sum()).backward()
    out = [y.detach(), h.grad] + [p.grad.clone() for m in models for p in m.parameters()]
    for m in models:
        m.zero_grad(set_to_none=True)
    return out


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def flash_qla_runs(backend, D):
    from gdn_layer.kernels.registry import backend_name
    return backend_name(backend, torch.device("cuda")) == "flash_qla" and D == 128


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("D", [64, 128])
def test_replays_give_the_op_by_op_results_over_packings_and_shared_layers(graphs, backend, D):
    """Where FlashQLA runs the chunk op the calls stay op by op (no capture); elsewhere they replay."""
    if backend == "flash_qla" and D != 128:
        pytest.skip("FlashQLA takes D = 128 only")
    models = (layer(backend, 0, D), layer(backend, 1, D))
    for x, cu in packs()[:1] * 2:                       # the signature's first two calls run op by op
        step(models, x, cu)
    for x, cu in packs():
        got = step(models, x, cu)
        graphs.set_enabled(False)
        want = step(models, x, cu)
        graphs.set_enabled(True)
        for i, (g, w) in enumerate(zip(got, want)):
            assert rel(g, w) < 2e-2, (i, rel(g, w))
    if flash_qla_runs(backend, D):
        assert graphs.stats() == {"captures": 0, "replays": 0, "kept": 0}
    else:
        assert graphs.stats()["captures"] == 1 and graphs.stats()["replays"] >= 12


def test_a_replayed_call_reads_nothing_back_to_the_host(graphs):
    models = (layer("auto", 0, 64), layer("auto", 1, 64))
    x, cu = packs()[0]
    for _ in range(3):
        step(models, x, cu)
    torch.cuda.synchronize()
    before = graphs.stats()["replays"]
    for x, cu in packs():
        cu_host = cu.cpu()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            h = x.clone().requires_grad_(True)
            y = models[1](models[0](h, cu_seqlens=cu_host), cu_seqlens=cu_host)
            y.float().pow(2).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert graphs.stats()["replays"] == before + 8
