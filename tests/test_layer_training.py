"""The layer inside the PyTorch training stack, one process: saved states, deep copies, both checkpoint
layouts, float64 end to end (gradcheck)."""
import copy
import io

import pytest
import torch
from torch.func import functional_call

from gdn_layer import GatedDeltaNet, GDNState

SIZES = (64, 2, 4, 16, 16)   # hidden, Hk, Hv, Dk, Dv


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_layer(layout="split", seed=0, sizes=SIZES, dtype=None):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(*sizes, projection_layout=layout, dtype=dtype)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
        layer.A_log.copy_(torch.linspace(-3, 0, sizes[2]))
        layer.norm.weight.uniform_(0.5, 1.5)
    return layer


def test_state_round_trips_through_torch_save_and_the_default_weights_only_load():
    layer = make_layer()
    _, state = layer(torch.randn(1, 70, SIZES[0]), cu_seqlens=torch.tensor([0, 30, 70]), output_state=True)
    buf = io.BytesIO()
    torch.save({"step": 3, "cache": [state, state.detach()]}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    for got in loaded["cache"]:
        assert type(got) is GDNState
        assert torch.equal(got.conv_state, state.conv_state)
        assert torch.equal(got.recurrent_state, state.recurrent_state)


def test_deepcopy_gives_an_independent_layer_with_the_same_outputs():
    layer = make_layer()
    twin = copy.deepcopy(layer)
    x = torch.randn(1, 50, SIZES[0])
    assert torch.equal(twin(x), layer(x))
    with torch.no_grad():
        twin.A_log.add_(1.0)
    assert not torch.equal(twin.A_log, layer.A_log)
    # the copy's load_state_dict hook works on the copy, not on the original
    before = layer.in_proj_qkv.weight.clone()
    twin.load_state_dict(make_layer("fused", seed=5).state_dict())
    assert torch.equal(layer.in_proj_qkv.weight, before)
    assert not torch.equal(twin.in_proj_qkv.weight, before)


# --------------------------------------------------------------------------------------------------
# both checkpoint layouts


def test_split_checkpoint_into_fused_layer_and_back_is_exact():
    split = make_layer("split")
    fused = make_layer("fused", seed=1)
    fused.load_state_dict(split.state_dict())      # strict by default: every key converted, nothing left
    back = make_layer("split", seed=2)
    back.load_state_dict(fused.state_dict())
    for name, t in split.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name
    x = torch.randn(2, 33, SIZES[0])
    y = split(x)
    assert torch.equal(back(x), y)
    assert rel_err(fused(x), y) <= 1e-6


def test_fused_checkpoint_into_split_layer_matches_the_fused_layer_with_grouped_heads():
    sizes = (48, 2, 6, 8, 4)                        # r = 3 value heads per k head
    fused = make_layer("fused", sizes=sizes)
    split = make_layer("split", sizes=sizes, seed=3)
    split.load_state_dict(fused.state_dict())
    x = torch.randn(1, 70, sizes[0])
    cu = torch.tensor([0, 25, 70])
    assert rel_err(split(x, cu_seqlens=cu), fused(x, cu_seqlens=cu)) <= 1e-6


def test_a_checkpoint_of_another_shape_is_not_converted_and_load_state_dict_reports_it():
    small = make_layer("split", sizes=(64, 2, 4, 16, 8))
    fused = make_layer("fused")
    with pytest.raises(RuntimeError, match="in_proj_qkvz"):
        fused.load_state_dict(small.state_dict())


def test_a_checkpoint_under_a_prefix_converts_too():
    outer = torch.nn.ModuleDict({"mixer": make_layer("fused", seed=4)})
    src = torch.nn.ModuleDict({"mixer": make_layer("split")})
    outer.load_state_dict(src.state_dict())
    x = torch.randn(1, 20, SIZES[0])
    assert rel_err(outer["mixer"](x), src["mixer"](x)) <= 1e-6


# --------------------------------------------------------------------------------------------------
# float64 end to end


@pytest.mark.parametrize("cu, T", [([0, 5, 70], 70), ([0, 1, 2], 2)], ids=["chunk", "decode"])
def test_float64_layer_passes_gradcheck_for_input_state_and_every_parameter(cu, T):
    """Any fp32 step inside (gate, conv, norm, state) would cost ~1e-7 relative: gradcheck sees it."""
    layer = make_layer(sizes=(8, 1, 2, 4, 4), dtype=torch.float64)
    names = [n for n, _ in layer.named_parameters()]
    params = [p.detach().clone().requires_grad_(True) for p in layer.parameters()]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, T, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    conv = torch.randn(2, layer.conv_dim, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    rec = torch.randn(2, 2, 4, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    cu = torch.tensor(cu)

    def f(x, conv, rec, *ps):
        y, st = functional_call(layer, dict(zip(names, ps)), (x,),
                                dict(cu_seqlens=cu, state=GDNState(conv, rec), output_state=True))
        assert y.dtype == st.conv_state.dtype == st.recurrent_state.dtype == torch.float64
        return y, st.conv_state, st.recurrent_state

    assert torch.autograd.gradcheck(f, (x, conv, rec, *params), fast_mode=True)
