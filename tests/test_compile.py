"""torch.compile over the layer: one graph (fullgraph, dynamic shapes) for packs of any total length
and sequence count, equal to eager in forward and backward (the "no recompilation" promise at the
PyTorch level; each kernel is one torch.library custom op with a fake implementation)."""
import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

from gdn_layer import GatedDeltaNet

PACKS = [(40, 60, 28), (50, 30, 70, 10), (100, 90), (33, 44, 55), (7,)]


class Block(nn.Module):
    """A model holding the layer, as users compile it."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 64)
        self.mixer = GatedDeltaNet(64, 2, 4, 16, 16)

    def forward(self, x, cu_seqlens):
        return self.mixer(self.inp(x), cu_seqlens=cu_seqlens)


def pack(lens):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return torch.randn(1, int(cu[-1]), 64), cu


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_one_graph_for_every_pack_and_equal_to_eager_forward_and_backward():
    torch.manual_seed(0)
    model = Block()
    counter = CompileCounterWithBackend("aot_eager")     # autograd traced too; no codegen (fast on CPU)
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    after_first = None
    for lens in PACKS:
        x, cu = pack(lens)
        y = compiled(x, cu)
        after_first = counter.frame_count if after_first is None else after_first
        gy = torch.randn_like(y)
        grads = torch.autograd.grad(y, list(model.parameters()), gy)
        y_ref = model(x, cu)
        grads_ref = torch.autograd.grad(y_ref, list(model.parameters()), gy)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
        for g, g_ref in zip(grads, grads_ref):
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    # the first call may trace more than once while it settles its guards; no later pack traces again
    assert counter.frame_count == after_first, f"recompiled: {counter.frame_count - after_first} new graphs"


def test_the_counter_sees_a_recompile_when_shapes_are_static():
    """The check above can fail: with dynamic=False every new packed length is a new graph."""
    model = Block()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=False)
    counts = []
    for lens in PACKS[:3]:
        compiled(*pack(lens))
        counts.append(counter.frame_count)
    assert counts[2] > counts[0]


def test_compiled_layer_returns_and_trains_through_states():
    """Outputs of every op have the strides their fake implementations promise (contiguous): a compiled
    layer can return a state and take gradients into a given state (chunked prefill, truncated BPTT)."""
    torch.manual_seed(0)
    layer = GatedDeltaNet(64, 2, 4, 16, 16)
    compiled = torch.compile(layer, backend=CompileCounterWithBackend("aot_eager"), fullgraph=True, dynamic=True)
    x, cu = torch.randn(1, 20, 64), torch.tensor([0, 7, 20])
    _, st0 = layer(x, cu_seqlens=cu, output_state=True)
    results = []
    for f in (compiled, layer):
        st = type(st0)(st0.conv_state.detach().requires_grad_(True), st0.recurrent_state.detach().requires_grad_(True))
        y, new = f(x, cu_seqlens=cu, state=st, output_state=True)
        (y.square().sum() + new.recurrent_state.square().sum() + new.conv_state.sum()).backward()
        results.append((y, new.recurrent_state, new.conv_state, st.conv_state.grad, st.recurrent_state.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
