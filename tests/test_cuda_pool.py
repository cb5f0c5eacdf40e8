"""The serving state pool on the GPU (run on the GPU machine; skipped elsewhere): every CUDA backend's pool
results against the torch backend in fp32, an eager pooled call with no host sync, plain ``torch.cuda.graph``
captures of a decode step and of a speculative verify call replayed with new inputs and slots giving the eager
results (pool included), ``DecodeGraph`` likewise, and no Triton compile after ``warmup`` for new N and slots."""
import pytest
import torch

from gdn_layer import DecodeGraph, GatedDeltaNet, GDNState
from gdn_layer.kernels import available_backends, warmup

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = [b for b in ("fla", "flash_qla") if torch.cuda.is_available() and b in available_backends("cuda")]
SIZES = (256, 2, 4, 128, 128)       # hidden, Hk, Hv, Dk, Dv (FlashQLA needs D = 128)


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def layer_on(backend, dtype=torch.bfloat16):
    torch.manual_seed(0)
    layer = GatedDeltaNet(*SIZES, backend=backend, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        layer.A_log.uniform_(-4, -2)
        layer.conv1d.weight.normal_(0, 0.3)
    return layer.to(dtype).eval()


def pool_of(layer, rows, seed=1):
    pool = layer.new_state(rows)
    g = torch.Generator(device="cuda").manual_seed(seed)
    pool.conv_state.copy_(torch.randn(pool.conv_state.shape, device="cuda", generator=g))
    pool.recurrent_state.copy_(torch.randn(pool.recurrent_state.shape, device="cuda", generator=g) * 0.1)
    return pool


def clone(pool):
    return GDNState(pool.conv_state.clone(), pool.recurrent_state.clone())


LENS = [70, 1, 3, 0, 1, 130]
SLOTS = [4, 1, -1, 0, 2, 6]


def packed(dtype, lens=LENS, seed=2):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(1, sum(lens), SIZES[0], device="cuda", generator=g).to(dtype), cu


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("every", [None, 1, 64])
def test_pool_on_the_backend_matches_the_torch_layer(backend, every):
    fast, ref = layer_on(backend), layer_on("torch", torch.float32)
    x, cu = packed(torch.bfloat16)
    slots = torch.tensor(SLOTS, device="cuda")
    ck = None if every is None else torch.arange(8, 8 + 12, device="cuda").reshape(6, 2)
    kw = {} if every is None else dict(checkpoint_slots=ck, checkpoint_every=every)
    results = []
    with torch.no_grad():
        for layer, xx in ((fast, x), (ref, x.float())):
            pool = pool_of(layer, 20)
            results.append((layer(xx, cu_seqlens=cu, state=pool, state_slots=slots, **kw), pool))
    (y, p), (y_r, p_r) = results
    assert rel_err(y, y_r) <= 1e-2
    assert rel_err(p.recurrent_state, p_r.recurrent_state) <= 1e-2
    assert rel_err(p.conv_state, p_r.conv_state) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_fused_decode_step_matches_the_torch_layer(backend):
    """One token per sequence without cu_seqlens: the fused kernels (kernels/triton/decode.py) on CUDA, three
    steps, against the torch layer in fp32 from the same pool (a padding entry, rows in a random order)."""
    fast, ref = layer_on(backend), layer_on("torch", torch.float32)
    slots = torch.tensor([6, -1, 2, 9, 0], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    xs = torch.randn(3, 5, 1, SIZES[0], device="cuda", generator=g)
    results = []
    with torch.no_grad():
        for layer, dtype in ((fast, torch.bfloat16), (ref, torch.float32)):
            pool = pool_of(layer, 12)
            ys = torch.stack([layer(xs[t].to(dtype), state=pool, state_slots=slots) for t in range(3)])
            results.append((ys, pool))
    (y, p), (y_r, p_r) = results
    assert y[:, 1].abs().max() == 0
    assert rel_err(y, y_r) <= 1e-2
    assert rel_err(p.recurrent_state, p_r.recurrent_state) <= 1e-2
    assert rel_err(p.conv_state, p_r.conv_state) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_eager_pooled_call_syncs_nothing(backend):
    layer = layer_on(backend)
    warmup(layer)
    pool = pool_of(layer, 20)
    x, cu = packed(torch.bfloat16, lens=[1, 3, 3, 2])
    slots = torch.tensor([0, 3, -1, 5], device="cuda")
    ck = torch.arange(8, 8 + 12, device="cuda").reshape(4, 3)
    step = torch.randn(4, 1, SIZES[0], device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer(step, state=pool, state_slots=slots)       # allocator first use outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer(step, state=pool, state_slots=slots)
            layer(x, cu_seqlens=cu, state=pool, state_slots=slots, checkpoint_slots=ck, checkpoint_every=1)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("backend", BACKENDS)
def test_plain_cuda_graphs_of_a_decode_step_and_a_verify_call_replay_the_eager_results(backend):
    import triton
    layer = layer_on(backend)
    warmup(layer)
    compiles = [0]
    triton.knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiles.__setitem__(0, compiles[0] + 1)
    N, K = 8, 3
    pool = pool_of(layer, 64)
    x = torch.zeros(N, 1, SIZES[0], device="cuda", dtype=torch.bfloat16)
    slots = torch.full((N,), -1, device="cuda", dtype=torch.long)
    xv = torch.zeros(1, N * (K + 1), SIZES[0], device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(0, N * (K + 1) + 1, K + 1, device="cuda")
    ck = torch.full((N, K), -1, device="cuda", dtype=torch.long)
    try:
        with torch.inference_mode():
            step, y = capture(lambda: layer(x, state=pool, state_slots=slots))
            verify, yv = capture(lambda: layer(xv, cu_seqlens=cu, state=pool, state_slots=slots,
                                               checkpoint_slots=ck, checkpoint_every=1))
            for seed in range(3):
                g = torch.Generator(device="cuda").manual_seed(10 + seed)
                x.copy_(torch.randn(x.shape, device="cuda", generator=g))
                xv.copy_(torch.randn(xv.shape, device="cuda", generator=g))
                slots.copy_(torch.randperm(64, device="cuda", generator=g)[:N])
                slots[seed] = -1
                ck.copy_(torch.randperm(64, device="cuda", generator=g)[:N * K].reshape(N, K))
                ck.masked_fill_(ck.unsqueeze(0).eq(slots.view(-1, 1, 1)).any(0), -1)    # never a step's own row
                start = clone(pool)
                want = layer(x.clone(), state=start, state_slots=slots.clone())
                step.replay()
                assert torch.equal(y, want) or rel_err(y, want) <= 1e-6
                assert rel_err(pool.recurrent_state, start.recurrent_state) <= 1e-6
                start = clone(pool)
                want = layer(xv.clone(), cu_seqlens=cu, state=start, state_slots=slots.clone(),
                             checkpoint_slots=ck.clone(), checkpoint_every=1)
                verify.replay()
                assert rel_err(yv, want) <= 1e-6
                assert rel_err(pool.recurrent_state, start.recurrent_state) <= 1e-6
                assert rel_err(pool.conv_state, start.conv_state) <= 1e-6
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert compiles[0] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_graph_replays_the_eager_step_for_any_n_and_slots(backend):
    layer = layer_on(backend)
    warmup(layer)
    pool = pool_of(layer, 32)
    step = DecodeGraph(layer, pool, max_num_seqs=16)
    for n in (16, 5, 1):
        g = torch.Generator(device="cuda").manual_seed(n)
        x = torch.randn(n, 1, SIZES[0], device="cuda", generator=g).to(torch.bfloat16)
        slots = torch.randperm(32, device="cuda", generator=g)[:n]
        start = clone(pool)
        with torch.inference_mode():
            want = layer(x, state=start, state_slots=slots)
        got = step(x, slots)
        assert got.shape == (n, 1, SIZES[0]) and rel_err(got, want) <= 1e-6
        assert rel_err(pool.recurrent_state, start.recurrent_state) <= 1e-6
        assert rel_err(pool.conv_state, start.conv_state) <= 1e-6


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_decode_steps_replay_from_the_third_call_like_eager_and_sync_nothing(backend):
    """gdn_layer/decode_replay.py: eager pool decode steps of N = 5 and 7 (capacity 8) replay one graph from the
    third call on, with the results and pool rows of the same steps with the graphs off."""
    from gdn_layer import decode_replay, mix_graphs
    layer = layer_on(backend)
    pool = pool_of(layer, 16)
    oracle = clone(pool)
    g = torch.Generator(device="cuda").manual_seed(7)
    plan = [torch.randperm(16, device="cuda", generator=g)[:n] for n in (5, 5, 7, 5, 7, 7)]
    xs = [torch.randn(len(s), 1, SIZES[0], device="cuda", generator=g).to(torch.bfloat16) for s in plan]
    decode_replay.clear()
    with torch.inference_mode():
        got = [layer(x, state=pool, state_slots=s) for x, s in zip(xs[:4], plan[:4])]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got += [layer(x, state=pool, state_slots=s) for x, s in zip(xs[4:], plan[4:])]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert decode_replay.stats() == {"captures": 1, "replays": 4}
        before = mix_graphs.set_enabled(False)
        try:
            want = [layer(x, state=oracle, state_slots=s) for x, s in zip(xs, plan)]
        finally:
            mix_graphs.set_enabled(before)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-6
    assert rel_err(pool.recurrent_state, oracle.recurrent_state) <= 1e-6
    assert rel_err(pool.conv_state, oracle.conv_state) <= 1e-6
