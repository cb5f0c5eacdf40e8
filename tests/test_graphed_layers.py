"""gdn_layer.make_graphed_layers on CPU: the wrapping around the capture, with torch.cuda.make_graphed_callables
replaced by a stand-in that keeps its semantics (static input, output and gradient buffers, returned as they are,
parameters read live) but runs the layer eagerly. The real capture runs in tests/test_cuda_graphs.py (GPU).

The oracle is a deep copy of the model taken before graphing (a copy is never graphed), run eagerly in float64."""
import contextlib
import copy
import io
import pickle

import pytest
import torch
from torch import nn

import gdn_layer.graphed as graphed
from graph_standin import Replays
from gdn_layer import GatedDeltaNet, GDNState, count_replays, make_graphed_layers, release_graphed_layers

H, T, N_MAX = 32, 24, 6
PACKS = [[0, 5, 12, 24], [0, 24], [0, 1, 2, 3, 10, 17, 24], [0, 0, 9, 24]]


@pytest.fixture
def replays(monkeypatch):
    r = Replays()
    monkeypatch.setattr(graphed, "_capture", r)
    return r


class Model(nn.Module):
    """Two GDN layers with residuals and a linear between them, as a decoder stacks them."""

    def __init__(self):
        super().__init__()
        self.gdn0 = GatedDeltaNet(H, 2, 4, 8, 8, dtype=torch.float64)
        self.mid = nn.Linear(H, H, dtype=torch.float64)
        self.gdn1 = GatedDeltaNet(H, 2, 4, 8, 8, dtype=torch.float64)

    def forward(self, x, cu=None):
        h = x + self.gdn0(x, cu_seqlens=cu)
        h = self.mid(h)
        return h + self.gdn1(h, cu_seqlens=cu)


def fresh_model(seed=0):
    torch.manual_seed(seed)
    m = Model()
    with torch.no_grad():    # non-default values everywhere, so a parameter's gradient path shows
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def step(model, x, cu, weight):
    x = x.clone().requires_grad_()
    y = model(x, None if cu is None else torch.tensor(cu))
    (y * weight).sum().backward()
    return y.detach(), x.grad


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_replays_equal_eager_over_packings_of_one_capacity(replays):
    model = fresh_model()
    oracle = copy.deepcopy(model)
    assert make_graphed_layers(model, T, N_MAX) == [model.gdn0, model.gdn1]
    for i, cu in enumerate(PACKS + [None]):
        x, w = torch.randn(1, T, H, dtype=torch.float64), torch.randn(1, T, H, dtype=torch.float64)
        for m in (model, oracle):
            m.zero_grad(set_to_none=True)
        y, gx = step(model, x, cu, w)
        y0, gx0 = step(oracle, x, cu, w)
        close(y, y0)
        close(gx, gx0)
        for a, b in zip(grads(model), grads(oracle)):
            close(a, b)
        assert (replays.forwards, replays.backwards) == (2 * (i + 1), 2 * (i + 1))
        assert count_replays(model) == 2 * (i + 1) and count_replays(model.gdn1) == i + 1


def test_gradients_accumulate_over_micro_batches_like_eager(replays):
    """The stand-in returns static gradient buffers, as torch's does: without the copies, the second micro-batch's
    replay overwrites the first one's gradients kept as .grad (PyTorch issue #181723)."""
    model = fresh_model()
    oracle = copy.deepcopy(model)
    make_graphed_layers(model, T, N_MAX)
    for set_to_none in (True, False):
        for m in (model, oracle):
            m.zero_grad(set_to_none=set_to_none)
        xs = []
        for cu in PACKS[:3]:
            x, w = torch.randn(1, T, H, dtype=torch.float64), torch.randn(1, T, H, dtype=torch.float64)
            xs.append(x)
            step(model, x, cu, w)
            step(oracle, x, cu, w)
        for a, b in zip(grads(model), grads(oracle)):
            close(a, b)
    assert replays.backwards == 12


def test_autograd_grad_over_parameters_returns_gradients_the_next_replay_leaves_alone(replays):
    """torch.autograd.grad hands back what the parameters' hooks return: with .grad already set (so no
    accumulation would copy it) the static buffer itself, unless the hook copies."""
    model = fresh_model()
    oracle = copy.deepcopy(model)
    make_graphed_layers(model, T, N_MAX)
    for m in (model, oracle):
        m.zero_grad(set_to_none=False)
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    kept = {}
    for m in (model, oracle):
        kept[m] = []
        for cu in PACKS[:2]:
            x = torch.randn(1, T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(len(cu)))
            kept[m].append(torch.autograd.grad(m(x, torch.tensor(cu)).square().sum(), list(m.gdn0.parameters())))
    for got, want in zip(kept[model], kept[oracle]):
        for a, b in zip(got, want):
            close(a, b)


def test_a_leaf_input_accumulates_its_gradient_like_eager(replays):
    model = fresh_model()
    oracle = copy.deepcopy(model)
    make_graphed_layers(model.gdn0, T, N_MAX)
    x = torch.randn(1, T, H, dtype=torch.float64)
    got, want = x.clone().requires_grad_(), x.clone().requires_grad_()
    for cu in PACKS[:2]:
        w = torch.randn(1, T, H, dtype=torch.float64)
        (model.gdn0(got, cu_seqlens=torch.tensor(cu)) * w).sum().backward()
        (oracle.gdn0(want, cu_seqlens=torch.tensor(cu)) * w).sum().backward()
    close(got.grad, want.grad)
    assert replays.backwards == 2


def test_an_output_kept_by_the_caller_is_not_overwritten_by_the_next_replay(replays):
    model = fresh_model()
    make_graphed_layers(model, T, N_MAX)
    x1, x2 = torch.randn(2, 1, T, H, dtype=torch.float64)
    y1 = model.gdn0(x1, cu_seqlens=torch.tensor(PACKS[0]))
    kept = y1.detach().clone()
    model.gdn0(x2, cu_seqlens=torch.tensor(PACKS[1]))
    close(y1.detach(), kept)
    assert replays.forwards == 2


def test_a_backward_whose_activations_were_overwritten_raises(replays):
    model = fresh_model()
    make_graphed_layers(model, T, N_MAX)
    cu = torch.tensor(PACKS[0])
    x = torch.randn(1, T, H, dtype=torch.float64, requires_grad=True)
    first = model.gdn0(x, cu_seqlens=cu).sum()
    model.gdn0(x, cu_seqlens=cu).sum().backward()          # the second forward's backward: fine
    with pytest.raises(RuntimeError, match="overwritten by a later replay"):
        first.backward()
    # a layer captured before it runs forward while gdn1 waits for its backward
    h = model.gdn1(x, cu_seqlens=cu).sum()
    model.gdn0(x, cu_seqlens=cu)
    with pytest.raises(RuntimeError, match="capture index 1"):
        h.backward()
    # a second backward through the same forward
    y = model.gdn0(x, cu_seqlens=cu).sum()
    y.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already ran"):
        y.backward()


def test_capture_order_forward_then_reverse_backward_passes_and_abandoned_forwards_are_harmless(replays):
    model = fresh_model()
    oracle = copy.deepcopy(model)
    make_graphed_layers(model, T, N_MAX)
    x, w = torch.randn(1, T, H, dtype=torch.float64), torch.randn(1, T, H, dtype=torch.float64)
    model(x.requires_grad_(), torch.tensor(PACKS[2]))      # a forward whose backward never runs
    model.zero_grad(set_to_none=True)
    y, gx = step(model, x.detach(), PACKS[0], w)
    y0, gx0 = step(oracle, x.detach(), PACKS[0], w)
    close(y, y0)
    close(gx, gx0)
    for a, b in zip(grads(model), grads(oracle)):
        close(a, b)


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("block", ["gdn0", "gdn0_mid_gdn1", "mid_gdn0_gdn1"])
def test_activation_checkpointing_recomputes_graphed_layers_like_eager(replays, reentrant, block):
    """torch.utils.checkpoint around graphed layers. Non-reentrant: the first forward replays and its backward
    comes after the recompute replayed the layer again on the same inputs (a forward inside a backward pass
    keeps its token). Reentrant: the first forward runs under no_grad (eagerly), the recompute replays. The
    stand-in clobbers the activations a replay may overwrite in the shared pool: wrong order shows as NaN."""
    from torch.utils.checkpoint import checkpoint
    model = fresh_model()
    oracle = copy.deepcopy(model)
    make_graphed_layers(model, T, N_MAX)
    cu = torch.tensor(PACKS[2])

    def run(m, x):
        def f(h):
            if block == "gdn0":
                return (h + m.gdn0(h, cu_seqlens=cu)).tanh()
            if block == "gdn0_mid_gdn1":
                h = m.mid(h + m.gdn0(h, cu_seqlens=cu)).tanh()
                return h + m.gdn1(h, cu_seqlens=cu)
            h = m.gdn0(m.mid(h).tanh(), cu_seqlens=cu)
            return m.gdn1(h, cu_seqlens=cu)       # graphed layers last: early stop may skip their recompute
        y = checkpoint(f, x, use_reentrant=reentrant)
        if block == "gdn0":
            y = y + m.gdn1(y, cu_seqlens=cu)
        return (y.square() * torch.arange(T, dtype=y.dtype)[:, None]).sum()

    for step in range(2):
        x = torch.randn(1, T, H, dtype=torch.float64)
        got = []
        for m in (model, oracle):
            m.zero_grad(set_to_none=True)
            xi = x.clone().requires_grad_()
            run(m, xi).backward()
            got.append([xi.grad] + [p.grad for p in m.parameters()])
        for a, b in zip(*got):
            close(a, b)
    assert replays.backwards == 4


def _weights():
    return torch.arange(T, dtype=torch.float64)[:, None]


@pytest.mark.parametrize("case", ["two_losses", "shared_layer", "hook_calls_layer"])
def test_replays_that_overwrite_pending_activations_make_the_backward_raise(replays, case):
    """Sequences where a later replay overwrites activations a pending backward needs (the stand-in would
    return NaN or another forward's gradients): each raises instead. two_losses: a first backward that
    recomputes a checkpointed block holding gdn0 overwrites what gdn1 saved, whose backward comes in a second
    call. shared_layer: gdn0 runs twice, the first time checkpointed; recomputing the first forward overwrites
    the second's activations. hook_calls_layer: a backward hook runs gdn0 with grad enabled (a new replay)
    before gdn0's pending backward."""
    from torch.utils.checkpoint import checkpoint
    model = fresh_model()
    make_graphed_layers(model, T, N_MAX)
    cu = torch.tensor(PACKS[0])
    x = torch.randn(1, T, H, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="overwritten by a later replay"):
        if case == "two_losses":
            h, s = checkpoint(lambda x: (model.gdn0(x, cu_seqlens=cu), x.sin()), x, use_reentrant=False)
            y = model.gdn1(h, cu_seqlens=cu)
            s.square().sum().backward(retain_graph=True)
            (y * _weights()).sum().backward()
        elif case == "shared_layer":
            kept = {}

            def block(x):
                kept["h"] = model.gdn0(x, cu_seqlens=cu)
                return kept["h"].tanh()
            a = checkpoint(block, x, use_reentrant=False)
            a2 = a.detach().requires_grad_()
            b = model.gdn0(a2, cu_seqlens=cu)
            torch.autograd.grad(a.square().sum(), [kept["h"]])   # recomputes the first forward of gdn0
            torch.autograd.grad(b.square().sum(), [a2])
        else:
            side = torch.randn(1, T, H, dtype=torch.float64)

            def hook(module, grad_in, grad_out):
                with torch.enable_grad():
                    model.gdn0(side, cu_seqlens=cu)
            model.mid.register_full_backward_hook(hook)
            (model(x, cu) * _weights()).sum().backward()


def test_a_parameter_hook_registered_before_the_capture_is_refused(replays):
    """The capture's backward runs the parameter's hooks once, baked in, and autograd again at every call."""
    model = fresh_model()
    model.gdn1.out_proj.weight.register_hook(lambda g: 0.5 * g)
    with pytest.raises(ValueError, match="layer 1 of module: parameter out_proj.weight has a gradient hook"):
        make_graphed_layers(model, T, N_MAX)
    assert replays.forwards == 0


@pytest.mark.parametrize("case", ["eval", "no_grad", "inference_mode", "other_length", "batch_of_two",
                                  "too_many_sequences", "float32", "output_state", "state", "autocast"])
def test_calls_outside_the_capacity_run_eagerly_with_eager_results(replays, case):
    model = fresh_model()
    oracle = copy.deepcopy(model)
    make_graphed_layers(model, T, N_MAX)
    shape, cu, kw = (1, T, H), torch.tensor(PACKS[0]), {}
    if case == "other_length":
        shape, cu = (1, T + 3, H), torch.tensor([0, 7, T + 3])
    elif case == "batch_of_two":
        shape, cu = (2, T, H), None
    elif case == "too_many_sequences":
        cu = torch.tensor([0, 1, 2, 3, 4, 5, 6, T])
    elif case == "output_state":
        kw = {"output_state": True}
    elif case == "state":
        kw = {"state": GDNState(torch.randn(3, 64, 3, dtype=torch.float64),
                                torch.randn(3, 4, 8, 8, dtype=torch.float64))}
    dtype = torch.float32 if case == "float32" else torch.float64
    if case == "float32":      # the layers were captured in float64: a float32 model runs them eagerly
        for m in (model, oracle):
            for layer in (m.gdn0, m.gdn1):
                layer.float()
            m.mid.float()
    x = torch.randn(*shape, dtype=dtype)
    ctx = {"no_grad": torch.no_grad(), "inference_mode": torch.inference_mode(),
           "autocast": torch.autocast("cpu", dtype=torch.bfloat16)}.get(case)
    if case == "eval":
        model.eval()
        oracle.eval()
    warns = pytest.warns(UserWarning, match="use_cache") if case == "state" else contextlib.nullcontext()
    with ctx or torch.enable_grad():
        with warns:                  # (a training call with a state says it runs eagerly)
            got = model.gdn0(x, cu_seqlens=cu, **kw)
        want = oracle.gdn0(x, cu_seqlens=cu, **kw)
    if case == "output_state":
        close(got[1].recurrent_state, want[1].recurrent_state)
        got, want = got[0], want[0]
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=1e-6)
    assert replays.forwards == 0 and count_replays(model) == 0


def test_a_training_call_with_a_state_warns_that_it_runs_eagerly(replays):
    """A transformers model trained with use_cache=True hands the layers its cache: every step would run
    eagerly without a word. The training call warns (once per process: Python's default filter); an eval or
    no-grad call with a state (decoding) does not."""
    import warnings
    model = fresh_model()
    make_graphed_layers(model, T, N_MAX)
    state = GDNState(torch.randn(3, 64, 3, dtype=torch.float64), torch.randn(3, 4, 8, 8, dtype=torch.float64))
    x, cu = torch.randn(1, T, H, dtype=torch.float64), torch.tensor(PACKS[0])
    with pytest.warns(UserWarning, match="use_cache=True.*model.config.use_cache = False"):
        model.gdn0(x, cu_seqlens=cu, state=state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model.gdn0(x, cu_seqlens=cu, state=state)
        model.eval()
        model.gdn0(x, cu_seqlens=cu, state=state)
        model.train()
        model.gdn0(x, cu_seqlens=cu)                 # a call of the capacity replays, silently
    assert replays.forwards == 1


def test_bad_packs_of_the_capacity_get_the_eager_errors(replays):
    model = fresh_model()
    make_graphed_layers(model, T, N_MAX)
    x = torch.randn(1, T, H, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError, match="cu_seqlens"):
        model.gdn0(x, cu_seqlens=torch.tensor([0, 5, T - 1]))
    with pytest.raises(ValueError, match="cu_seqlens must have dtype int32 or int64"):
        model.gdn0(x, cu_seqlens=torch.tensor([0.0, 5.0, T]))
    with pytest.raises(TypeError, match="output_state must be a bool"):
        model.gdn0(x, cu_seqlens=torch.tensor(PACKS[0]), output_state=0)
    assert replays.forwards == 0


def test_replaced_parameters_raise_and_in_place_loads_replay_the_new_values(replays):
    model = fresh_model()
    oracle = fresh_model(seed=1)
    make_graphed_layers(model, T, N_MAX)
    model.load_state_dict(oracle.state_dict())                # copies in place: the graphs see the new values
    x = torch.randn(1, T, H, dtype=torch.float64)
    cu = torch.tensor(PACKS[0])
    close(model(x, cu), oracle(x, cu))
    assert replays.forwards == 2
    model.load_state_dict(oracle.state_dict(), assign=True)   # new tensors: the graphs would read the old ones
    with pytest.raises(RuntimeError, match="make_graphed_layers again"):
        model(x, cu)
    make_graphed_layers(model, T, N_MAX)                      # re-capture: fine again
    model.gdn1.dt_bias = nn.Parameter(model.gdn1.dt_bias.data)  # a new object over the same memory
    with pytest.raises(RuntimeError, match="make_graphed_layers again"):
        model(x, cu)
    model.gdn0.A_log.requires_grad_(False)
    make_graphed_layers(model, T, N_MAX)
    model.gdn0.A_log.requires_grad_(True)
    with pytest.raises(RuntimeError, match="requires_grad changed"):
        model(x, cu)


def test_a_parameter_changed_between_a_forward_and_its_backward_raises(replays):
    """Eager autograd refuses it (version counter); the replayed backward would read the new weights against
    the old activations. Stepping between a backward and the next forward is fine."""
    model = fresh_model()
    make_graphed_layers(model, T, N_MAX)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, cu = torch.randn(1, T, H, dtype=torch.float64), torch.tensor(PACKS[0])
    model(x, cu).square().sum().backward()
    opt.step()
    loss = model(x, cu).square().sum()
    opt.step()
    with pytest.raises(RuntimeError, match="modified in place between this forward and its backward"):
        loss.backward()


def test_copies_and_pickles_of_a_graphed_model_are_eager_and_release_restores_eager(replays):
    model = fresh_model()
    make_graphed_layers(model, T, N_MAX)
    x, cu = torch.randn(1, T, H, dtype=torch.float64), torch.tensor(PACKS[0])
    want = model(x, cu).detach()
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert other.gdn0._graphed is None and other.gdn1._graphed is None
        close(other(x, cu), want)
    buf = io.BytesIO()
    torch.save(model, buf)
    assert torch.load(io.BytesIO(buf.getvalue()), weights_only=False).gdn0._graphed is None
    n = replays.forwards
    assert release_graphed_layers(model) == 2 and release_graphed_layers(model) == 0
    assert all(not p._backward_hooks for p in model.parameters())
    close(model(x, cu), want)
    assert replays.forwards == n


def test_bad_arguments_are_refused_before_any_capture(replays):
    model = fresh_model()
    with pytest.raises(TypeError, match="module must be an nn.Module"):
        make_graphed_layers("model", T, N_MAX)
    with pytest.raises(TypeError, match="tokens must be an int"):
        make_graphed_layers(model, 24.0, N_MAX)
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        make_graphed_layers(model, T, 0)
    with pytest.raises(ValueError, match="max_num_seqs must be at most tokens \\(24\\)"):
        make_graphed_layers(model, T, 10**9)
    with pytest.raises(TypeError, match="tokens must be an int, got bool"):
        make_graphed_layers(model, True, N_MAX)
    with pytest.raises(ValueError, match="no GatedDeltaNet"):
        make_graphed_layers(nn.Linear(2, 2), T, N_MAX)
    model.gdn1.sp_size = 2
    with pytest.raises(ValueError, match="layer 1 of module runs under sp_group"):
        make_graphed_layers(model, T, N_MAX)
    assert replays.forwards == 0 and model.gdn0._graphed is None


def test_layers_off_cuda_are_refused_by_the_real_capture():
    with pytest.raises(ValueError, match="one CUDA device, got \\['cpu'\\]"):
        make_graphed_layers(fresh_model(), T, N_MAX)
