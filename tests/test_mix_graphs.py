"""The layer's token mixing replayed from per-signature graphs (gdn_layer/mix_graphs.py), on CPU.

The capture is a stand-in with a real graph's semantics for what the module relies on: a "replay" of the forward
recomputes from the static inputs and writes the static output and every buffer the capture saved for the
backward (as the real forward graph rewrites its memory); a "replay" of the backward reads the saved buffers as
they are then (the unpack hook hands autograd the buffers, not fresh values) and writes the static gradients.
So a call whose saved tensors were not kept and put back gets another call's gradients, as on the GPU.

Oracle: the same layer with the graphs switched off (its eager path; that path's own oracle is the fp64
token-by-token recurrence in test_layer.py), fp64, to 1e-12.
"""
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import gdn_layer.mix_capture as mix_capture
import gdn_layer.mix_graphs as mg
from gdn_layer import GatedDeltaNet


class StandInCapture:
    """``gdn_layer.mix_capture._CudaCapture`` on the CPU (module docstring)."""

    def __init__(self, static):
        pass

    def warm(self, run, leaves, grad):
        out = run()
        if grad:
            torch.autograd.grad(out, leaves, torch.zeros_like(out), allow_unused=True)

    def forward(self, run):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = run()
        self.run, self.saved = run, saved
        grad = torch.is_grad_enabled()

        class Graph:
            def replay(_):
                fresh = []
                with torch.set_grad_enabled(grad), torch.autograd.graph.saved_tensors_hooks(
                        lambda t: fresh.append(t) or t, lambda t: t):
                    o = run()
                with torch.no_grad():
                    out.copy_(o)
                    for buffer, value in zip(saved, fresh):
                        buffer.copy_(value)
        return Graph(), out, saved

    def backward(self, out, leaves, grad_out):
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
        run, saved = self.run, self.saved

        class Graph:
            def replay(_):
                count = iter(range(len(saved)))
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                        lambda t: next(count), lambda i: saved[i]):
                    o = run()
                new = torch.autograd.grad(o, leaves, grad_out, allow_unused=True)
                with torch.no_grad():
                    for g, n in zip(grads, new):
                        if g is not None:
                            g.copy_(n)
        return Graph(), grads


@pytest.fixture
def graphs(monkeypatch):
    monkeypatch.setattr(mix_capture, "_capturer", StandInCapture)
    monkeypatch.setattr(mg, "_DEVICES", ("cuda", "cpu"))
    before = mg.set_enabled(True)
    mg.clear()
    yield mg
    mg.clear()
    mg.set_enabled(before)


def layer(seed=0, **kw):
    torch.manual_seed(seed)
    m = GatedDeltaNet(32, 2, 4, 8, 8, backend="torch", dtype=torch.float64, **kw)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))   # norm weight, dt_bias off their constant init
    return m


def pack(T=40, cuts=(0, 7, 7, 23, 40), seed=1):
    torch.manual_seed(seed)
    return torch.randn(1, T, 32, dtype=torch.float64), torch.tensor(cuts, dtype=torch.int32)


def run(m, x, cu, w=None):
    x = x.clone().requires_grad_(True)
    y = m(x, cu_seqlens=cu)
    w = torch.randn_like(y) if w is None else w
    (y * w).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}


def eager(m, x, cu, w):
    before = mg.set_enabled(False)
    try:
        m.zero_grad(set_to_none=True)
        return run(m, x, cu, w)
    finally:
        mg.set_enabled(before)
        m.zero_grad(set_to_none=True)


def replayed(m, x, cu, w, calls=3):
    """``(got, want)``: the last of ``calls`` calls with the graphs on, and one op by op."""
    want = eager(m, x, cu, w)
    for _ in range(calls):
        m.zero_grad(set_to_none=True)
        got = run(m, x, cu, w)
    return got, want


def assert_same(a, b):
    ya, gxa, gpa = a
    yb, gxb, gpb = b
    assert torch.allclose(ya, yb, atol=1e-12, rtol=0)
    assert (gxa is None) == (gxb is None) and (gxa is None or torch.allclose(gxa, gxb, atol=1e-12, rtol=0))
    assert gpa.keys() == gpb.keys()
    for n in gpa:
        assert torch.allclose(gpa[n], gpb[n], atol=1e-12, rtol=0), n


def test_the_third_call_of_a_signature_replays_with_eager_results(graphs):
    m = layer()
    x, cu = pack()
    w = torch.randn(1, 40, 32, dtype=torch.float64)
    want = eager(m, x, cu, w)
    for call in range(4):
        m.zero_grad(set_to_none=True)
        got = run(m, x, cu, w)
        assert graphs.stats()["replays"] == max(0, call - 1), call   # calls 0, 1 eager; 2 captures and replays
        assert_same(got, want)
    assert graphs.stats()["captures"] == 1


def test_new_packings_of_one_capacity_replay_one_capture_with_their_own_results(graphs):
    m = layer()
    w = torch.randn(1, 40, 32, dtype=torch.float64)
    packs = [pack(cuts=c, seed=s) for s, c in enumerate([(0, 40), (0, 3, 40), (0, 10, 20, 30, 40),
                                                          (0, 1, 2, 3, 4, 5, 6, 40), (0, 0, 40, 40)])]
    for x, cu in packs[:2]:
        run(m, x, cu, w)
    for x, cu in packs:
        want = eager(m, x, cu, w)
        m.zero_grad(set_to_none=True)
        assert_same(run(m, x, cu, w), want)
    assert graphs.stats() == {"captures": 1, "replays": 5, "kept": 1}


def test_layers_sharing_a_capture_get_their_own_gradients_in_any_order(graphs):
    a, b = layer(0), layer(1)
    x, cu = pack()
    for _ in range(3):
        run(a, x, cu)
    a.zero_grad(set_to_none=True)
    assert graphs.stats()["captures"] == 1

    def model(x):
        return b(a(x, cu_seqlens=cu), cu_seqlens=cu)

    def step():
        h = x.clone().requires_grad_(True)
        y1 = model(h)
        y2 = a(h * 0.5, cu_seqlens=cu)   # a third forward, of a, before any backward
        (y1.pow(2).sum() + (y2 * 3).sum()).backward()
        return h.grad, {n: p.grad.clone() for n, p in [*a.named_parameters("a"), *b.named_parameters("b")]}

    before = graphs.stats()["replays"]
    got = step()
    assert graphs.stats()["replays"] == before + 3
    for m in (a, b):
        m.zero_grad(set_to_none=True)
    graphs.set_enabled(False)
    want = step()
    assert torch.allclose(got[0], want[0], atol=1e-12, rtol=0)
    for n in want[1]:
        assert torch.allclose(got[1][n], want[1][n], atol=1e-12, rtol=0), n


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_replays_like_eager(graphs, reentrant):
    a, b = layer(0), layer(1)
    x, cu = pack()
    for _ in range(3):
        run(a, x, cu)
    a.zero_grad(set_to_none=True)

    def step():
        h = x.clone().requires_grad_(True)
        y = checkpoint(lambda t: b(a(t, cu_seqlens=cu), cu_seqlens=cu), h, use_reentrant=reentrant)
        y.pow(2).sum().backward()
        return h.grad, [p.grad.clone() for p in [*a.parameters(), *b.parameters()]]

    before = graphs.stats()["replays"]
    got = step()
    # reentrant: the first forwards run without grad (a signature of its own, still op by op at its first
    # sightings), the recomputation replays; non-reentrant: under checkpoint's saved-tensor hooks, op by op
    assert graphs.stats()["replays"] == before + (2 if reentrant else 0)
    for m in (a, b):
        m.zero_grad(set_to_none=True)
    graphs.set_enabled(False)
    want = step()
    assert torch.allclose(got[0], want[0], atol=1e-12, rtol=0)
    for g, h in zip(got[1], want[1]):
        assert torch.allclose(g, h, atol=1e-12, rtol=0)


def test_frozen_parameters_and_no_grad_calls_have_their_own_captures(graphs):
    m = layer()
    x, cu = pack()
    with torch.no_grad():
        graphs.set_enabled(False)
        want = m(x, cu_seqlens=cu)
        graphs.set_enabled(True)
        for _ in range(3):
            got = m(x, cu_seqlens=cu)
            assert not got.requires_grad
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    assert graphs.stats()["replays"] == 1
    for name in ("A_log", "dt_bias", "norm.weight"):   # LoRA-style: the mix's parameters frozen
        m.get_parameter(name).requires_grad_(False)
    w = torch.randn(1, 40, 32, dtype=torch.float64)
    got, want = replayed(m, x, cu, w)
    assert graphs.stats()["captures"] == 2
    assert got[2].keys() == want[2].keys() and "A_log" not in got[2]
    assert_same(got, want)


@pytest.mark.parametrize("trainable", ["in_proj_qkv.weight", "in_proj_z.weight", "conv1d.weight", "out_proj.weight"])
def test_one_trainable_parameter_and_an_input_without_grad_replay_with_its_eager_gradient(graphs, trainable):
    """Every input but ``cu_seqlens`` counts for the signature and for whether the replay records autograd: the
    first projection weight too (it sits where the mix's ``cu_seqlens`` does)."""
    m = layer()
    for name, p in m.named_parameters():
        p.requires_grad_(name == trainable)
    x, cu = pack()
    w = torch.randn(1, 40, 32, dtype=torch.float64)
    want = None
    for enabled in (False, True, True, True):
        graphs.set_enabled(enabled)
        m.zero_grad(set_to_none=True)
        y = m(x, cu_seqlens=cu)
        (y * w).sum().backward()
        got = (y.detach(), m.get_parameter(trainable).grad.clone())
        want = want or got
    assert graphs.stats()["replays"] == 1
    assert torch.allclose(got[0], want[0], atol=1e-12, rtol=0)
    assert torch.allclose(got[1], want[1], atol=1e-12, rtol=0)


def test_inference_mode_calls_replay_and_training_follows(graphs):
    m = layer()
    x, cu = pack()
    graphs.set_enabled(False)
    with torch.inference_mode():
        want = m(x, cu_seqlens=cu)
    graphs.set_enabled(True)
    with torch.inference_mode():
        outs = [m(x, cu_seqlens=cu) for _ in range(4)]
    assert graphs.stats()["replays"] == 2
    for o in outs:
        assert torch.allclose(o, want, atol=1e-12, rtol=0)
    w = torch.randn(1, 40, 32, dtype=torch.float64)
    got, want = replayed(m, x, cu, w)
    assert_same(got, want)


@pytest.mark.parametrize("change", ["T", "N_capacity", "dtype", "config"])
def test_another_signature_takes_another_capture(graphs, change):
    m = layer()
    x, cu = pack()
    for _ in range(3):
        run(m, x, cu)
    if change == "T":
        x, cu = pack(T=41, cuts=(0, 7, 41))
    elif change == "N_capacity":
        cu = torch.tensor([0] + list(range(4, 40, 4)) + [40], dtype=torch.int32)   # 10 sequences: capacity 16
    elif change == "dtype":
        m, x = m.float(), x.float()
    else:
        m = GatedDeltaNet(32, 2, 4, 8, 8, backend="torch", dtype=torch.float64, norm_eps=1e-5)
    w = torch.randn(1, x.shape[1], 32, dtype=x.dtype)
    got, want = replayed(m, x, cu, w)
    assert graphs.stats()["captures"] == 2
    if change == "dtype":
        assert torch.allclose(got[0], want[0], atol=1e-5, rtol=1e-5)
    else:
        assert_same(got, want)


@pytest.mark.parametrize("case", ["state", "output_state", "decode", "disabled", "autocast"])
def test_calls_outside_the_graphs_run_eagerly(graphs, case):
    m = layer()
    x, cu = pack()
    for _ in range(3):
        run(m, x, cu)
    before = graphs.stats()["replays"]
    if case == "state":
        out = m(x, cu_seqlens=cu, state=m(x, cu_seqlens=cu, output_state=True)[1])
    elif case == "output_state":
        out = m(x, cu_seqlens=cu, output_state=True)[0]
    elif case == "decode":
        out = m(x[:, :4], cu_seqlens=torch.tensor([0, 1, 2, 3, 4]))
    elif case == "disabled":
        graphs.set_enabled(False)
        out = m(x, cu_seqlens=cu)
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m(x, cu_seqlens=cu)
    assert out is not None and graphs.stats()["replays"] == before


def test_a_failed_capture_warns_once_and_its_signature_runs_eagerly(graphs, monkeypatch):
    class Failing(StandInCapture):
        def forward(self, run):
            raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(mix_capture, "_capturer", Failing)
    m = layer()
    x, cu = pack()
    w = torch.randn(1, 40, 32, dtype=torch.float64)
    want = eager(m, x, cu, w)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(5):
            m.zero_grad(set_to_none=True)
            got = run(m, x, cu, w)
    # once for the whole call, once for the token mixing alone (tried after the projections), then never again
    assert [str(c.message).count("capture failed") for c in caught] == [1, 1]
    assert "token mixing" not in str(caught[0].message) and "token mixing" in str(caught[1].message)
    assert graphs.stats()["replays"] == 0
    assert_same(got, want)


def test_at_most_max_signatures_are_kept(graphs, monkeypatch):
    monkeypatch.setattr(mg, "MAX_SIGNATURES", 2)
    m = layer()
    for T in (20, 21, 22):
        x, cu = pack(T=T, cuts=(0, 5, T))
        for _ in range(3):
            run(m, x, cu)
    assert graphs.stats()["captures"] == 3 and graphs.stats()["kept"] == 2


def test_set_enabled_takes_a_bool():
    with pytest.raises(TypeError, match="on must be a bool"):
        mg.set_enabled(1)


def test_checkpointed_layers_from_the_first_step_train_like_eager(graphs):
    """Non-reentrant checkpointing compares what a forward saved with what its recomputation saves: under its
    hooks every call runs op by op, even when the recomputation is a signature's third sighting."""
    layers = [layer(0), layer(1)]
    x, cu = pack()

    def step():
        h = x.clone().requires_grad_(True)
        y = h
        for m in layers:
            y = checkpoint(m, y, cu, use_reentrant=False)
        y.pow(2).sum().backward()
        out = [h.grad] + [p.grad.clone() for m in layers for p in m.parameters()]
        for m in layers:
            m.zero_grad(set_to_none=True)
        return out

    got = [step() for _ in range(2)]
    graphs.set_enabled(False)
    want = step()
    for g in got:
        for a, b in zip(g, want):
            assert torch.allclose(a, b, atol=1e-12, rtol=0)


def test_a_backward_after_another_signatures_replay_reads_its_own_saved_tensors(graphs):
    """Another signature's replay between a call's forward and its backward leaves that call's gradients alone."""
    m = layer()
    xa, cua = pack(T=40)
    xb, cub = pack(T=48, cuts=(0, 20, 48))
    for x, cu in ((xa, cua), (xb, cub)):
        for _ in range(3):
            run(m, x, cu)
    m.zero_grad(set_to_none=True)

    def step():
        yb = m(xb, cu_seqlens=cub)
        ya = m(xa, cu_seqlens=cua)               # a replay of the capture made before B's
        (yb.pow(2).sum() + ya.pow(2).sum()).backward()
        out = {n: p.grad.clone() for n, p in m.named_parameters()}
        m.zero_grad(set_to_none=True)
        return out

    got = step()
    graphs.set_enabled(False)
    want = step()
    for n in want:
        assert torch.allclose(got[n], want[n], atol=1e-12, rtol=0), n


def test_rows_without_cu_seqlens_replay_as_one_pack(graphs):
    m = layer()
    torch.manual_seed(4)
    x = torch.randn(3, 20, 32, dtype=torch.float64)
    w = torch.randn(3, 20, 32, dtype=torch.float64)
    got, want = replayed(m, x, None, w)
    assert graphs.stats()["replays"] == 1
    assert_same(got, want)


def test_packs_with_no_more_tokens_than_the_capacity_run_op_by_op(graphs):
    """Padded to 8 sequences, a pack of 6 tokens would take the decode path inside the graph."""
    m = layer()
    x, cu = pack(T=8, cuts=(0, 3, 8))
    for _ in range(4):
        run(m, x, cu)
    assert graphs.stats() == {"captures": 0, "replays": 0, "kept": 0}


@pytest.mark.parametrize("hook", ["backward", "backward_pre", "forward_override", "global_forward"])
def test_a_hooked_or_overridden_norm_runs_op_by_op(graphs, hook):
    m = layer()
    x, cu = pack()
    handle = None
    if hook == "backward":
        handle = m.norm.register_full_backward_hook(lambda mod, gi, go: tuple(g * 0.5 for g in gi))
    elif hook == "backward_pre":
        handle = m.norm.register_full_backward_pre_hook(lambda mod, go: tuple(g * 0.5 for g in go))
    elif hook == "forward_override":
        original = m.norm.forward
        m.norm.forward = lambda a, z: original(a, z) * 0.7
    else:
        handle = torch.nn.modules.module.register_module_forward_hook(
            lambda mod, args, out: out * 0.7 if mod is m.norm else None)
    try:
        w = torch.randn(1, 40, 32, dtype=torch.float64)
        got, want = replayed(m, x, cu, w)
    finally:
        if handle is not None:
            handle.remove()
    assert graphs.stats()["replays"] == 0
    assert_same(got, want)


def test_calls_from_several_threads_get_their_own_results(graphs):
    import threading
    layers = [layer(i) for i in range(4)]
    x, cu = pack()
    with torch.no_grad():
        for _ in range(3):
            layers[0](x, cu_seqlens=cu)
        graphs.set_enabled(False)
        want = [m(x, cu_seqlens=cu) for m in layers]
        graphs.set_enabled(True)
    wrong = []

    def work(i):
        with torch.no_grad():
            for _ in range(30):
                if not torch.allclose(layers[i](x, cu_seqlens=cu), want[i], atol=1e-12, rtol=0):
                    wrong.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert graphs.stats()["replays"] >= 120 and wrong == []


def test_make_graphed_layers_warms_up_without_a_mix_capture(graphs, monkeypatch):
    """``make_graphed_callables`` runs each layer three times eagerly before capturing it: those calls must not
    capture the token mixing (its graphs would never replay, their memory wasted)."""
    import gdn_layer.graphed as graphed
    from gdn_layer import make_graphed_layers
    from graph_standin import Replays
    stand_in = Replays()

    def warm_then_capture(wrappers, samples):
        for w, (x, cu) in zip(wrappers, samples):
            for _ in range(3):
                w(x.detach().requires_grad_(x.requires_grad), cu).sum().backward()
        return stand_in(wrappers, samples)
    monkeypatch.setattr(graphed, "_capture", warm_then_capture)
    m = layer()
    make_graphed_layers(m, tokens=40, max_num_seqs=4)
    assert graphs.stats()["captures"] == 0 and graphs.enabled()


def test_paused_blocks_nest_across_threads_and_keep_set_enabled(graphs):
    import threading
    entered, leave = threading.Barrier(2), threading.Event()

    def hold():
        with graphs.paused():
            entered.wait()
            leave.wait()

    other = threading.Thread(target=hold)
    other.start()
    with graphs.paused():
        entered.wait()
        assert not graphs.enabled()
    assert not graphs.enabled()          # the other thread's block is still open
    leave.set()
    other.join()
    assert graphs.enabled()
    with graphs.paused():
        graphs.set_enabled(False)
    assert not graphs.enabled()          # a setting made inside survives the block


@pytest.mark.parametrize("case", ["validation", "conv_gate_override"])
def test_what_a_capture_cannot_see_runs_op_by_op(graphs, case):
    from gdn_layer.kernels.validation import set_validation
    a, b = layer(0), layer(1)
    x, cu = pack()
    for _ in range(3):
        run(a, x, cu)
    before = graphs.stats()
    if case == "validation":
        set_validation(True)
    else:
        original = b._conv_gate
        b._conv_gate = lambda *args, **kw: tuple(t * 0.5 if i == 4 else t for i, t in enumerate(original(*args, **kw)))
    try:
        w = torch.randn(1, 40, 32, dtype=torch.float64)
        got, want = replayed(b, x, cu, w)
        assert_same(got, want)
        assert graphs.stats() == before
    finally:
        set_validation(None)


def test_the_norms_own_backend_is_part_of_the_signature():
    m = layer()
    tensors = (torch.randn(1, 40, 80), torch.randn(1, 40, 4, 8), *mg._params(m))
    key = mg._signature(m, "mix", tensors, 4, torch.int32, True)
    m.norm.backend = "some_other"
    assert mg._signature(m, "mix", tensors, 4, torch.int32, True) != key


def scopes():
    return sorted(key[5] for key, c in mg._kept.items() if c is not None)


def test_plain_projections_put_the_whole_call_in_one_capture(graphs):
    m = layer()
    x, cu = pack()
    w = torch.randn(1, 40, 32, dtype=torch.float64)
    got, want = replayed(m, x, cu, w)
    assert_same(got, want)          # the projections' and out_proj's gradients included
    assert scopes() == ["layer"] and graphs.stats()["replays"] == 1


@pytest.mark.parametrize("which", ["in_proj_z", "out_proj", "in_proj_a"])
def test_a_hooked_projection_keeps_the_projections_eager_and_replays_the_mixing(graphs, which):
    m = layer()
    getattr(m, which).register_forward_hook(lambda mod, args, out: out * 0.5)   # a replay without it would differ
    x, cu = pack()
    w = torch.randn(1, 40, 32, dtype=torch.float64)
    got, want = replayed(m, x, cu, w)
    assert_same(got, want)
    assert scopes() == ["mix"]


@pytest.mark.parametrize("T", [20, 40])   # fewer tokens than hidden (32): per-part GEMMs, as eager takes them
def test_no_grad_calls_of_the_whole_layer_replay_like_eager(graphs, T):
    m = layer()
    x, cu = pack(T=T, cuts=(0, 3, 9, T))
    with torch.no_grad():
        before = mg.set_enabled(False)
        want = m(x, cu_seqlens=cu)
        mg.set_enabled(before)
        for _ in range(3):
            got = m(x, cu_seqlens=cu)
    assert torch.allclose(got, want, atol=1e-12, rtol=0)
    assert scopes() == ["layer"] and graphs.stats()["replays"] == 1



@pytest.mark.parametrize("graphs_on", [True, False])
def test_create_graph_gives_first_order_gradients_and_a_second_backward_raises(graphs, graphs_on):
    """As op by op: create_graph=True gives the gradients (usable as values); differentiating them raises."""
    m = layer()
    x, cu = pack()
    w = torch.randn(1, 40, 32, dtype=torch.float64)
    want = eager(m, x, cu, w)
    graphs.set_enabled(graphs_on)
    for _ in range(3):
        run(m, x, cu, w)
    h = x.clone().requires_grad_(True)
    y = m(h, cu_seqlens=cu)
    assert (graphs.stats()["replays"] >= 1) == graphs_on
    g, = torch.autograd.grad((y * w).sum(), h, create_graph=True)
    assert torch.allclose(g.detach(), want[1], atol=1e-12, rtol=0)
    with pytest.raises(RuntimeError, match="twice differentiable"):
        g.pow(2).sum().backward()


class ScaledBeta(GatedDeltaNet):
    """A user's subclass: its ``_conv_gate`` reads a parameter of its own (no graph input)."""

    def __init__(self, *args, scale=1.0, **kw):
        super().__init__(*args, **kw)
        self.beta_gain = torch.nn.Parameter(torch.tensor(scale, dtype=torch.float64))

    def _conv_gate(self, *args, **kw):
        q, k, v, g, beta, conv_state = super()._conv_gate(*args, **kw)
        return q, k, v, g, beta * self.beta_gain, conv_state


def test_a_subclass_overriding_the_mixing_runs_op_by_op(graphs):
    torch.manual_seed(0)
    a = ScaledBeta(32, 2, 4, 8, 8, backend="torch", dtype=torch.float64, scale=0.9)
    x, cu = pack()
    w = torch.randn(1, 40, 32, dtype=torch.float64)
    got, want = replayed(a, x, cu, w)
    assert_same(got, want)
    assert got[2]["beta_gain"] is not None and scopes() == []


def test_project_overridden_on_the_instance_keeps_the_projections_eager(graphs):
    m = layer()
    original = m._project
    m._project = lambda x: (lambda mz: (mz[0] * 0.5, mz[1]))(original(x))
    x, cu = pack()
    w = torch.randn(1, 40, 32, dtype=torch.float64)
    got, want = replayed(m, x, cu, w)
    assert_same(got, want)
    assert scopes() == ["mix"]


@pytest.mark.parametrize("frozen", ["in_projections", "none"])
@pytest.mark.parametrize("x_grad", [True, False])
def test_in_place_changes_after_the_call_raise_exactly_where_op_by_op_raises(graphs, frozen, x_grad):
    """The replay saves for its backward what the op-by-op call saves (x only for the projections' weight
    gradients, the weights only for x's), so an in-place change of x or of a weight before the backward raises
    in the same cases, and is allowed in the others."""
    m = layer()
    if frozen == "in_projections":
        for name in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"):
            getattr(m, name).weight.requires_grad_(False)
    x, cu = pack()
    w = torch.randn(1, 40, 32, dtype=torch.float64)

    def call(change):
        m.zero_grad(set_to_none=True)
        h = x.clone().requires_grad_(x_grad)
        inner = h * 1.0
        y = m(inner, cu_seqlens=cu)
        with torch.no_grad():
            inner.add_(1.0) if change == "x" else m.in_proj_qkv.weight.mul_(1.0)
        try:
            (y * w).sum().backward()
        except RuntimeError as error:
            assert "modified by an inplace operation" in str(error)
            return "raised"
        return y.detach(), h.grad, {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    for change in ("x", "weight"):
        graphs.clear()
        before = mg.set_enabled(False)
        want = call(change)
        mg.set_enabled(before)
        for _ in range(3):
            got = call(change)
        assert scopes() == ["layer"]
        if want == "raised" or got == "raised":
            assert got == want == "raised", (change, got if got == "raised" else want)
        else:
            assert_same(got, want)
