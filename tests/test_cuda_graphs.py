"""CUDA-graph capture of packed training at a fixed capacity (run on the GPU machine; skipped elsewhere).

The contract (docs/performance.md, "CUDA graphs"): a pack of exactly T tokens whose device ``cu_seqlens`` is
padded to ``N_max + 1`` entries (``pad_cu_seqlens``) is a capacity. After ``warmup()``, ``torch.cuda.graph``
around a layer's forward and backward captures once; replaying it after ``cu.copy_(...)`` / ``x.copy_(...)``
with any other packing of that capacity gives the eager results. The CPU side of the contract (padding, no
host reads on the path, fla's capacity chunk index) is tested on CPU: test_fixed_capacity.py,
test_fla_chunk_index.py, test_triton_compile.py.
"""
import os
import random
import sys

import pytest
import torch

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import available_backends, warmup
from gdn_layer.parallel import pad_cu_seqlens

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from graph_step import capture  # noqa: E402  (PyTorch's capture recipe: side-stream warm-up, then capture)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = [b for b in ("fla", "flash_qla") if torch.cuda.is_available() and b in available_backends("cuda")]
T, N_MAX = 1024, 8


def packings(count, seed=0):
    """Different N, lengths, empty segments (first, middle) at one capacity; the last one has N_MAX documents."""
    rnd = random.Random(seed)
    out = [[0, 0, 300, 300, 1000, T], [0, T]]
    while len(out) < count - 1:
        n = rnd.randint(2, N_MAX)
        out.append([0] + sorted(rnd.sample(range(1, T), n - 1)) + [T])
    out.append([0] + sorted(rnd.sample(range(1, T), N_MAX - 1)) + [T])
    return out


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_layer(backend, D):
    torch.manual_seed(0)
    layer = GatedDeltaNet(256, 2, 4, D, D, backend=backend, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.A_log.copy_(torch.empty(4).uniform_(0.01, 0.05).log())     # slow decay: a leak would show
    warmup(layer, include_decode=False, include_states=False)
    return layer


def cu_of(p):
    return pad_cu_seqlens(torch.tensor(p, dtype=torch.int32, device="cuda"), N_MAX)


def grads(layer, x):
    return [x.grad] + [p.grad for p in layer.parameters()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("D", [64, 128])
def test_captured_forward_backward_replays_other_packings(backend, D):
    layer = make_layer(backend, D)
    packs = packings(5)
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in packs]
    dy = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16, generator=gen)

    def eager(x, p):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        y = layer(xi, cu_seqlens=cu_of(p))
        y.backward(dy)
        return [y.detach().clone()] + [g.clone() for g in grads(layer, xi)]

    want = [eager(x, p) for x, p in zip(xs, packs)]
    static_x, static_cu = xs[0].clone().requires_grad_(True), cu_of(packs[0])

    def step():
        y = layer(static_x, cu_seqlens=static_cu)
        y.backward(dy)
        return y

    def no_grads():                             # the capture allocates them: static from then on
        layer.zero_grad(set_to_none=True)
        static_x.grad = None
    graph, static_y = capture(step, before_each=no_grads)
    # the same kernels as eager (fla): equal up to reduction order; FlashQLA's eager calls vs fla's kernels
    # in the graph (FlashQLA reads cu_seqlens on the host): bf16 apart, up to 2e-2 on the 4-element A_log grad
    tol = 1e-3 if backend == "fla" else 2e-2
    for i in [1, 2, 3, 4, 0, 2]:               # other packings, then back to the captured one
        with torch.no_grad():
            static_x.copy_(xs[i])
            static_cu.copy_(cu_of(packs[i]))
        graph.replay()
        got = [static_y] + grads(layer, static_x)
        for name, a, b in zip(["y", "x.grad"] + [n for n, _ in layer.named_parameters()], got, want[i]):
            assert rel_err(a, b) <= tol, (i, name, rel_err(a, b))


def compiled_steps(layer, compiled):
    """For 7 packings (5, then the first two again): forward+backward of ``compiled`` and of ``layer`` on the
    same input; yields ``(i, [(y, x.grad, parameter grads) of each])``.

    The parameters' ``.grad`` is set to None before each call, as a training loop's ``optimizer.zero_grad()``
    does. Without it the backward would accumulate into the ``.grad`` that an earlier call's CUDA graph left in
    its memory pool, which CUDA-graph trees overwrite at the next step: the accumulation then raises
    "accessing tensor output of CUDAGraphs that has been overwritten" (torch's documented rule for
    reduce-overhead; its stack trace names the forward op whose gradient it was)."""
    packs = packings(5, seed=3)
    gen = torch.Generator(device="cuda").manual_seed(2)
    dy = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
    for i, p in enumerate(packs + packs[:2]):
        x = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
        outs = []
        for f in (compiled, layer):
            layer.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            y = f(xi, cu_seqlens=cu_of(p))
            y.backward(dy)
            outs.append((y.detach().clone(), xi.grad.clone(),
                         {n: q.grad.clone() for n, q in layer.named_parameters() if q.grad is not None}))
        yield i, outs


def test_reduce_overhead_compile_replays_other_packings():
    """``torch.compile(mode="reduce-overhead")``: its CUDA-graph trees copy each call's inputs (a new padded
    cu_seqlens each call) into the recorded graph's; outputs, input and parameter gradients follow the
    packing. (Each step sets the parameters' grads to None first, as an optimizer's ``zero_grad()`` does.)"""
    layer = make_layer("fla" if "fla" in BACKENDS else "auto", 64)
    compiled = torch.compile(layer, mode="reduce-overhead")
    for i, ((y_c, g_c, p_c), (y_e, g_e, p_e)) in compiled_steps(layer, compiled):
        assert rel_err(y_c, y_e) <= 1e-2 and rel_err(g_c, g_e) <= 1e-2, (i, rel_err(y_c, y_e), rel_err(g_c, g_e))
        assert p_c.keys() == p_e.keys() == {n for n, _ in layer.named_parameters()}, (i, p_c.keys())
        for n in p_e:
            assert rel_err(p_c[n], p_e[n]) <= 2e-2, (i, n, rel_err(p_c[n], p_e[n]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("packing", [0, 3], ids=["empty-segments", "full"])
@pytest.mark.parametrize("cu_on", ["cpu", "cuda"])
def test_eager_step_on_a_new_packing_does_not_sync(backend, packing, cu_on):
    """An eager forward+backward on a cu_seqlens the layer has not seen makes no device sync at all, padded
    with empty segments or not: fla's kernels read nothing on the host; FlashQLA (at D = 128 its own
    kernels run) takes the lengths on the host, known without a read for a cu_seqlens handed in on the
    CPU. A device-only cu_seqlens costs FlashQLA one read per tensor (kept for the later layers and the
    backward): that case reads first, so the check still catches a second read."""
    layer = make_layer(backend, 128)
    x = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x, cu_seqlens=cu_of(packings(3)[2])).sum().backward()       # (first call of this process's shapes)
    torch.cuda.synchronize()
    cu = pad_cu_seqlens(torch.tensor(packings(4, seed=5)[packing], dtype=torch.int32), N_MAX).to(cu_on)
    if backend == "flash_qla" and cu_on == "cuda":
        with torch.no_grad():
            layer(x, cu_seqlens=cu)                                    # its one host read of these lengths
        torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, cu_seqlens=cu).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cpu_cu_seqlens_during_capture_is_refused():
    layer = make_layer("fla" if "fla" in BACKENDS else "auto", 64)
    x = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, T], dtype=torch.int32)
    with torch.no_grad():
        layer(x, cu_seqlens=cu.cuda())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="cu_seqlens must be on cuda.* during a CUDA graph capture"):
        with torch.cuda.graph(graph), torch.no_grad():
            layer(x, cu_seqlens=cu)


class TwoLayers(torch.nn.Module):
    """Two GatedDeltaNet layers with residuals and a linear between them, as a decoder stacks them."""

    def __init__(self, backend, D):
        super().__init__()
        self.gdn0, self.gdn1 = make_layer(backend, D), make_layer(backend, D)
        self.mid = torch.nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16)

    def forward(self, x, cu):
        h = self.mid(x + self.gdn0(x, cu_seqlens=cu))
        return h + self.gdn1(h, cu_seqlens=cu)


@pytest.mark.parametrize("backend", BACKENDS)
def test_graphed_layers_replay_other_packings_and_accumulate_like_eager(backend):
    """gdn_layer.make_graphed_layers (torch.cuda.make_graphed_callables per layer, rest eager): over packings of
    one capacity (unpadded device cu_seqlens; the layer pads), outputs, the input's gradient and every
    parameter's gradient equal the eager model's, also when two micro-batches accumulate into .grad (PyTorch
    issue #181723: without the layer's copies the second replay overwrites the first's gradients); no sync."""
    import copy
    from gdn_layer import make_graphed_layers
    model = TwoLayers(backend, 128)
    oracle = copy.deepcopy(model)
    make_graphed_layers(model, T, N_MAX)
    packs = packings(5, seed=7)
    gen = torch.Generator(device="cuda").manual_seed(4)
    # bf16 (1e-2): cuBLAS may pick other GEMM kernels under capture than eagerly; FlashQLA runs eagerly and fla's
    # kernels in the graph (see above). The accumulation error this guards against is of order 1.
    tol = 1e-2 if backend == "fla" else 2e-2
    for i, accumulate in enumerate([False, False, True, False, True, True]):
        p = packs[i % len(packs)]
        x = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
        dy = torch.randn(1, T, 256, device="cuda", dtype=torch.bfloat16, generator=gen)
        cu = torch.tensor(p, dtype=torch.int32, device="cuda")
        results = []
        for m in (model, oracle):
            if not accumulate:
                m.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_(True)
            if m is model and i > 0:
                torch.cuda.set_sync_debug_mode("error")
            try:
                y = m(xi, cu)
                y.backward(dy)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            results.append([y, xi.grad] + [q.grad for q in m.parameters()])
        names = ["y", "x.grad"] + [n for n, _ in model.named_parameters()]
        for name, a, b in zip(names, *results):
            assert rel_err(a, b) <= tol, (i, accumulate, name, rel_err(a, b))
