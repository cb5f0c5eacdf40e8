"""Eager decode steps over a state pool replayed from per-(layer, pool, capacity) graphs
(gdn_layer/decode_replay.py), on CPU.

The capture is a stand-in with ``DecodeGraph``'s semantics: its buffers are ``capacity`` rows, a call copies ``x``
and ``slots`` in, pads the rows past N with ``-1`` and runs the step on the whole buffer (the eager pool call, as
the captured kernels would), then returns a copy of rows ``:N``. So what is tested here is the policy: which calls
replay, on which graph, what it keeps alive. The real graph's replay equals the eager step on the GPU
(tests/test_cuda_pool.py). Oracle: the same steps with the graphs switched off on a copy of the pool (whose own
oracle is each sequence alone through the ``GDNState`` path, tests/test_state_pool.py), fp64, to 1e-12.
"""
import contextlib
import gc
import weakref

import pytest
import torch

import gdn_layer.decode_replay as dr
import gdn_layer.mix_graphs as mg
from gdn_layer import GDNState
from test_state_pool import HIDDEN, filled_pool, make_layer   # (slow decay: a lost or leaked state shows)


class StandInStep:
    made = 0

    def __init__(self, layer, pool, capacity):
        StandInStep.made += 1
        self.layer, self.pool = layer, pool
        # (the registry clears .layer and .pool; the graph holds the pool's memory by address, not the tensors)
        self._layer = weakref.ref(layer)
        self._pool = [(weakref.ref(t if t._base is None else t._base), t.storage_offset(), t.shape, t.stride())
                      for t in (pool.conv_state, pool.recurrent_state)]
        self.x = torch.zeros(capacity, 1, layer.hidden_size, dtype=layer.out_proj.weight.dtype)
        self.slots = torch.full((capacity,), -1, dtype=torch.int64)
        with torch.inference_mode():
            layer(self.x, state=pool, state_slots=self.slots)   # as DecodeGraph: eager checks on padding rows

    def __call__(self, x, slots):
        n = x.shape[0]
        self.x[:n].copy_(x)
        self.slots[:n].copy_(slots)
        self.slots[n:].fill_(-1)
        with mg.paused():
            pool = GDNState(*(base().as_strided(shape, stride, offset) for base, offset, shape, stride in self._pool))
            y = self._layer()(self.x, state=pool, state_slots=self.slots)
        return y[:n].clone()


@pytest.fixture
def replay(monkeypatch):
    for module, name, value in ((dr, "_make", StandInStep), (mg, "_DEVICES", ("cuda", "cpu")), (mg, "_enabled", True),
                                (StandInStep, "made", 0)):
        monkeypatch.setattr(module, name, value)     # (each restored after the test)
    dr.clear()
    yield dr
    dr.clear()


def steps(layer, pool, plan, seed=5):
    """Run decode steps ``plan`` (a list of slot lists) under no_grad; the outputs."""
    g = torch.Generator().manual_seed(seed)
    ys = []
    with torch.no_grad():
        for slots in plan:
            x = torch.randn(len(slots), 1, HIDDEN, dtype=torch.float64, generator=g)
            ys.append(layer(x, state=pool, state_slots=torch.tensor(slots)))
    return ys


PLAN = [[0, 3, 5], [3, 0, 5], [5, -1, 0], [1, 2, 4, 6], [6, 4], [0, 1, 2]]   # N = 3, 3, 3, 4, 2, 3


def test_decode_steps_replay_from_the_third_call_with_eager_results_and_rows(replay):
    layer = make_layer()
    pool, oracle = filled_pool(layer, 8), filled_pool(layer, 8)
    got = steps(layer, pool, PLAN)
    mg.set_enabled(False)
    want = steps(layer, oracle, PLAN)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12, rtol=0)
    assert torch.allclose(pool.recurrent_state, oracle.recurrent_state, atol=1e-12, rtol=0)
    assert torch.allclose(pool.conv_state, oracle.conv_state, atol=1e-12, rtol=0)
    # N = 3 and 4 share capacity 4 (captured at the third call); N = 2 is capacity 2, seen once: eager
    assert replay.stats() == {"captures": 1, "replays": 3} and StandInStep.made == 1


def test_a_new_pool_takes_a_new_graph_and_a_dropped_pool_drops_its_graph(replay):
    layer = make_layer()
    a = filled_pool(layer, 4)
    steps(layer, a, [[0, 1]] * 3)
    b = filled_pool(layer, 4, seed=2)
    steps(layer, b, [[0, 1]] * 3)
    assert replay.stats()["captures"] == 2
    ref = weakref.ref(a.recurrent_state)
    del a
    gc.collect()
    assert ref() is None                                   # the registry does not keep a pool alive
    c = filled_pool(layer, 4, seed=3)                       # (may reuse the dropped pool's addresses)
    oracle = GDNState(c.conv_state.clone(), c.recurrent_state.clone())
    got = steps(layer, c, [[1, 0]] * 3)
    mg.set_enabled(False)
    want = steps(layer, oracle, [[1, 0]] * 3)
    assert all(torch.allclose(x, y, atol=1e-12, rtol=0) for x, y in zip(got, want))
    assert torch.allclose(c.recurrent_state, oracle.recurrent_state, atol=1e-12, rtol=0)


def test_the_registry_keeps_no_layer_alive(replay):
    layer = make_layer()
    pool = filled_pool(layer, 4)
    steps(layer, pool, [[0, 1]] * 3)
    ref = weakref.ref(layer)
    del layer
    gc.collect()
    assert ref() is None


def test_replaced_parameters_take_a_new_graph(replay):
    layer = make_layer()
    pool = filled_pool(layer, 4)
    steps(layer, pool, [[0, 1]] * 3)
    layer.out_proj.weight = torch.nn.Parameter(layer.out_proj.weight.detach() * 2)
    steps(layer, pool, [[0, 1]] * 3)
    assert replay.stats()["captures"] == 2


class TaggedParameter(torch.nn.Parameter):
    """A parameter of a subclass (as DTensor is one): a graph would not see what its ops dispatch to."""


@pytest.mark.parametrize("case", ["hook", "disabled", "paused", "validation", "cu_seqlens", "two_tokens",
                                  "checkpoints", "subclass_parameter"])
def test_calls_a_graph_would_not_see_run_eagerly(replay, case):
    from gdn_layer.kernels.validation import set_validation
    layer = make_layer()
    pool = filled_pool(layer, 8)
    x = torch.randn(2, 1, HIDDEN, dtype=torch.float64)
    slots = torch.tensor([0, 1])
    kw = {}
    if case == "hook":
        layer.norm.register_forward_hook(lambda m, a, out: out * 0.5)
    elif case == "disabled":
        mg.set_enabled(False)
    elif case == "validation":
        set_validation(True)
    elif case == "cu_seqlens":
        x, kw = x.reshape(1, 2, HIDDEN), {"cu_seqlens": torch.tensor([0, 1, 2])}
    elif case == "two_tokens":
        x = torch.randn(2, 2, HIDDEN, dtype=torch.float64)
    elif case == "checkpoints":
        kw = {"checkpoint_slots": torch.tensor([[2], [3]])}
    elif case == "subclass_parameter":
        layer.A_log = TaggedParameter(layer.A_log.detach().clone())
    try:
        with torch.no_grad(), (mg.paused() if case == "paused" else contextlib.nullcontext()):
            for _ in range(4):
                layer(x, state=pool, state_slots=slots, **kw)
    finally:
        set_validation(None)
    assert replay.stats() == {"captures": 0, "replays": 0}


def test_autocast_steps_run_eagerly(replay):
    layer = make_layer()
    pool = filled_pool(layer, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        steps(layer, pool, [[0, 1]] * 4)
    assert replay.stats() == {"captures": 0, "replays": 0}


def test_a_changed_norm_eps_takes_a_new_graph(replay):
    layer = make_layer()
    pool = filled_pool(layer, 4)
    steps(layer, pool, [[0, 1]] * 3)
    layer.norm.eps = 0.5
    steps(layer, pool, [[0, 1]] * 3)
    assert replay.stats()["captures"] == 2


def test_views_of_one_pool_made_afresh_each_step_share_one_graph(replay):
    layer = make_layer()
    big = filled_pool(layer, 16)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(12):
            view = GDNState(big.conv_state[4:12], big.recurrent_state[4:12])
            layer(torch.randn(2, 1, HIDDEN, dtype=torch.float64, generator=g), state=view,
                  state_slots=torch.tensor([0, 5]))
    assert replay.stats() == {"captures": 1, "replays": 10}


def test_counts_stay_bounded_and_a_freed_pool_drops_its_graph(replay):
    layer = make_layer()
    for seed in range(40):                 # pools used twice each: counted, never captured
        steps(layer, filled_pool(layer, 2, seed=seed), [[0]] * 2)
    assert len(dr._kept[layer]) <= 4 * dr.MAX_PER_LAYER
    pool = filled_pool(layer, 2)
    steps(layer, pool, [[0]] * 3)
    assert any(k[0] != "seen" for k in dr._kept[layer])
    del pool
    gc.collect()
    assert all(k[0] == "seen" for k in dr._kept[layer])


def test_a_pool_copied_afresh_at_every_step_never_captures(replay, monkeypatch):
    """The transformers adapter's pattern: the states copied out of the cache into a new pool each step. The
    allocator may hand the same addresses back (made certain here: a key without addresses), and counting such
    steps would capture at every third one."""
    monkeypatch.setattr(dr, "_key", lambda layer, x, pool, capacity, params: ("one key", capacity))
    layer = make_layer()
    src = filled_pool(layer, 2)
    for _ in range(6):
        pool = GDNState(src.conv_state.clone(), src.recurrent_state.clone())
        steps(layer, pool, [[0, 1]])
        src = pool
        del pool
    assert replay.stats() == {"captures": 0, "replays": 0}
