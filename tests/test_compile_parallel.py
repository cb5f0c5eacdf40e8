"""torch.compile over the layer under Ulysses SP and state-passing CP (2 gloo ranks): the host-side plans
(the feature plan of the all-to-all, the cp slice plan, the cp token-order plan) are never traced, so
their caches work as in eager mode: the feature plan, the slice plan and the token-order plan of a pack
are built once (one host read), not at every compiled call. Outputs equal the eager layer's. And the
all-to-all pair under ``torch.compile(dynamic=True)``. (The layer without SP / CP, one graph: tests/test_compile.py.)"""
import contextlib

import pytest
import torch
import torch.distributed as dist

from gdn_layer import GatedDeltaNet
from gdn_layer.parallel import feature_plan, head_to_seq, seq_to_head, shard_sequence
from dist_utils import run_distributed

HIDDEN, HK, HV, DK, DV, T = 24, 2, 4, 8, 4, 48


def _layer(**groups):
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, dtype=torch.float64, **groups)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
        layer.A_log.copy_(torch.empty(HV, dtype=torch.float64).uniform_(0.01, 0.05).log())
    return layer


def _rand(seed, *shape):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _all_to_all_pair_dynamic(rank, P):
    """The pair under ``torch.compile(dynamic=True)`` (inductor), over two lengths:
    equal to eager up to inductor's fusion (float64 rounding), values and grads. The exchange's wait is a graph break; the graph resumed after it
    must not take the output buffer and a view of it that it then writes (AOT autograd's aliasing path
    fails on such inputs with dynamic shapes: "Expected !size_bytes_is_heap_allocated_")."""
    F = 3 * P
    perm = torch.randperm(F, generator=torch.Generator().manual_seed(4)).view(P, F // P)
    w = _rand(30, 1, 1, F)

    def f(x):
        return head_to_seq(seq_to_head(x, perm, dist.group.WORLD).sin() * 2, dist.group.WORLD) * w

    compiled = torch.compile(f, dynamic=True)     # inductor: aot_eager does not reach that path
    for TL in (4, 6):
        x = _rand(40 + rank + TL, 1, TL, F)
        xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
        ye, yc = f(xe), compiled(xc)
        torch.testing.assert_close(yc, ye, rtol=1e-12, atol=1e-14)
        g = _rand(50 + rank + TL, 1, TL, F)
        (ye * g).sum().backward()
        (yc * g).sum().backward()
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-12, atol=1e-14)


def _step(f, x, cu):
    x = x.clone().requires_grad_()
    y = f(x, cu_seqlens=cu)
    y.square().sum().backward()
    return y.detach(), x.grad


@contextlib.contextmanager
def _counting_calls(module, name):
    """``module.name`` replaced, for the block, by a never-traced wrapper that counts its calls; yields the
    one-element count list. (Traced, a Python counter would not count the compiled calls.)"""
    real, builds = getattr(module, name), [0]

    @torch.compiler.disable
    def counting(*args, **kwargs):
        builds[0] += 1
        return real(*args, **kwargs)

    setattr(module, name, counting)
    try:
        yield builds
    finally:
        setattr(module, name, real)


def _sp_plans_once(rank, world):
    """SP: the feature plan is built by the first (eager) call and never again by compiled calls."""
    torch._dynamo.reset()
    layer = _layer(sp_group=dist.group.WORLD)
    with _counting_calls(feature_plan, "build_plan") as builds:
        compiled = torch.compile(layer, backend="aot_eager", dynamic=True)
        g = torch.Generator().manual_seed(1)
        for i, cu in enumerate([[0, 10, 30, T], [0, 20, T], [0, 5, 6, 40, T]]):
            x = shard_sequence(torch.randn(1, T, HIDDEN, dtype=torch.float64, generator=g), dist.group.WORLD)
            cu = torch.tensor(cu, dtype=torch.int32)
            want = _step(layer, x, cu)
            if i == 0:
                assert builds[0] == 1, builds        # the eager call planned the index once
            got = _step(compiled, x, cu)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    return builds[0]


def _cp_plans_once_per_pack(rank, world, token_order):
    """CP: 4 packs of one length and sequence count, the documents straddling the slice boundary at
    different places, each run twice by the compiled layer: the slice plan (and with ``token_order`` the
    order's plan) is built once per pack, as in eager mode. Returns the number of builds."""
    from gdn_layer import context_parallel, token_order as token_order_mod
    torch._dynamo.reset()
    layer = _layer(cp_group=dist.group.WORLD)
    planner = (token_order_mod, "_plan") if token_order else (context_parallel, "plan_slice")
    with _counting_calls(*planner) as builds:
        compiled = torch.compile(layer, backend="aot_eager", dynamic=True)
        g = torch.Generator().manual_seed(2)
        q = T // 4           # head-tail: slice c holds the c-th and the (2C-1-c)-th quarter
        order = torch.cat([torch.arange(0, q), torch.arange(3 * q, T), torch.arange(q, 3 * q)])
        for j in range(4):
            lengths = [4] * j + [28] + [4] * (5 - j)
            cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
            x = torch.randn(1, T, HIDDEN, dtype=torch.float64, generator=g)
            mine = (x[:, order] if token_order else x)[:, rank * T // 2:(rank + 1) * T // 2]
            kw = {"token_order": order} if token_order else {}
            with torch.no_grad():
                want = layer(mine, cu_seqlens=cu, **kw)       # eager: builds this pack's plan
            before = builds[0]
            for _ in range(2):
                torch.testing.assert_close(compiled(mine, cu_seqlens=cu, **kw), want, rtol=1e-10, atol=1e-12)
            assert builds[0] == before, (j, before, builds[0])   # the compiled calls reuse it
    return builds[0]


def _no_graph_while_an_exchange_is_in_flight(rank, world):
    """Under torch.compile no compiled graph runs between posting an all-to-all exchange and waiting for it:
    a graph writing the own row of a receive buffer copies the whole buffer back (functionalization) over
    the rows still arriving from the peer, which lost rows of the layer's output on a loaded machine. Every
    graph call of the compiled SP layer and of the three exchanges (forward and backward) is checked; the
    outputs equal eager's. Returns the number of graph calls."""
    from gdn_layer.parallel import all_to_all, project_seq_to_head
    torch._dynamo.reset()
    pending, graph_calls = [0], [0]
    aot_eager, real_post = torch._dynamo.lookup_backend("aot_eager"), all_to_all._post

    class _Tracked:
        def __init__(self, work):
            self.work = work

        def wait(self):
            pending[0] -= 1
            return self.work.wait()

    @torch.compiler.disable
    def post(*args):
        works = real_post(*args)
        pending[0] += len(works)
        return [_Tracked(w) for w in works]

    def checking(gm, example_inputs):
        compiled = aot_eager(gm, example_inputs)

        def run(*args):
            graph_calls[0] += 1
            assert pending[0] == 0, "a compiled graph ran while an exchange was in flight"
            return compiled(*args)
        return run

    layer = _layer(sp_group=dist.group.WORLD)
    idx = torch.tensor([[0, 2, 3], [1, 3, 0]])
    w = _rand(7, 4, HIDDEN)

    def exchanges(x, w):
        h = seq_to_head(x[..., :4], idx, dist.group.WORLD) + project_seq_to_head(x, w, idx, dist.group.WORLD)
        return head_to_seq(h.sin(), dist.group.WORLD)

    all_to_all._post = post
    try:
        g = torch.Generator().manual_seed(3)
        for fn, extra in ((layer, {"cu_seqlens": torch.tensor([0, 10, 30, T], dtype=torch.int32)}), (exchanges, {})):
            compiled = torch.compile(fn, backend=checking, dynamic=True)
            x = torch.randn(1, T // world, HIDDEN, dtype=torch.float64, generator=g)
            args = (w,) if fn is exchanges else ()
            outs = []
            for f in (fn, compiled):
                xi = x.clone().requires_grad_()
                y = f(xi, *args, **extra)
                y.square().sum().backward()
                outs.append((y.detach(), xi.grad))
            for a, b in zip(*outs):
                torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    finally:
        all_to_all._post = real_post
    return graph_calls[0] > 0


def test_compiled_sp_layer_runs_no_graph_while_an_exchange_is_in_flight(pool2):
    assert pool2.run(_no_graph_while_an_exchange_is_in_flight) == [True, True]


def test_compiled_sp_layer_plans_the_feature_index_once(pool2):
    assert pool2.run(_sp_plans_once) == [1, 1]


@pytest.mark.parametrize("token_order", [False, True], ids=["contiguous", "head_tail"])
def test_compiled_cp_layer_reuses_the_eager_plan_of_a_pack(pool2, token_order):
    assert pool2.run(_cp_plans_once_per_pack, token_order) == [4, 4]


def test_compiled_all_to_all_pair_with_dynamic_shapes_equals_eager():
    """(Its own 2 processes with a long limit: inductor compiling cold on 2 busy cores takes minutes.)"""
    run_distributed(_all_to_all_pair_dynamic, 2, timeout=900)
