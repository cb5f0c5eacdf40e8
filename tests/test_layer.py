"""GatedDeltaNet, single process: packing, grouped heads, the recurrent-cache fallback, errors."""
import math

import pytest
import torch

from gdn_layer import GatedDeltaNet, GDNState


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def make_layer(Hk=2, Hv=4, Dk=16, Dv=8, hidden=32, slow_decay=False, layout="split", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(hidden, Hk, Hv, Dk, Dv, projection_layout=layout, dtype=dtype)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)  # make the conv matter, so a conv bug shows
        if slow_decay:  # exp(g) close to 1: a leak across sequences would be visible
            layer.A_log.copy_(math.log(0.05) + 0.1 * torch.randn(Hv))
            layer.dt_bias.fill_(-2.0)
    return layer


def test_packed_batch_equals_each_sequence_alone_forward_and_input_grads():
    layer = make_layer(slow_decay=True)
    lens = [37, 70, 21]
    cu = torch.tensor([0, 37, 107, 128])
    x = torch.randn(1, 128, 32, requires_grad=True)
    y = layer(x, cu_seqlens=cu)
    cot = torch.randn_like(y)
    (gx,) = torch.autograd.grad((y * cot).sum(), x)
    for n in range(3):
        sl = slice(int(cu[n]), int(cu[n + 1]))
        xn = x[:, sl].detach().requires_grad_(True)
        yn = layer(xn)
        (gn,) = torch.autograd.grad((yn * cot[:, sl]).sum(), xn)
        assert rel_err(y[:, sl], yn) <= 1e-5
        assert rel_err(gx[:, sl], gn) <= 1e-5


def test_perturbing_the_last_token_of_sequence_0_leaves_the_others_bit_identical():
    layer = make_layer(slow_decay=True)
    cu = torch.tensor([0, 40, 90, 128])
    x = torch.randn(1, 128, 32)
    y = layer(x, cu_seqlens=cu)
    x2 = x.clone()
    x2[0, 39] += 3.0
    y2 = layer(x2, cu_seqlens=cu)
    assert not torch.equal(y[0, 39], y2[0, 39])
    assert torch.equal(y[0, 40:], y2[0, 40:])
    # without the boundary, the change does travel (so the test can see a leak)
    y3, y4 = layer(x), layer(x2)
    assert (y3[0, 40:] - y4[0, 40:]).abs().max() > 1e-4


@pytest.mark.parametrize("T", [1, 2, 5, 63, 64, 65, 128])
def test_prefill_then_decode_one_token_equals_full_forward(T):
    layer = make_layer(Hk=2, Hv=6)
    x = torch.randn(2, T, 32)
    y_full = layer(x)
    y_pre, st = layer(x[:, :T - 1], output_state=True)
    y_dec, st2 = layer(x[:, T - 1:], state=st, output_state=True)
    assert rel_err(torch.cat([y_pre, y_dec], 1), y_full) <= 1e-5
    _, st_full = layer(x, output_state=True)
    assert rel_err(st2.recurrent_state, st_full.recurrent_state) <= 1e-5
    assert rel_err(st2.conv_state, st_full.conv_state) <= 1e-6


def test_chunked_prefill_in_pieces_of_7_equals_one_call_packed():
    layer = make_layer()
    cu = torch.tensor([0, 30, 30, 75])
    x = torch.randn(1, 75, 32)
    y_full, st_full = layer(x, cu_seqlens=cu, output_state=True)
    # each sequence advances in pieces of 7 tokens, all three sequences in one packed call per step
    lens = [30, 0, 45]
    done = [0, 0, 0]
    st = None
    outs = [[] for _ in lens]
    while any(d < n for d, n in zip(done, lens)):
        take = [min(7, n - d) for d, n in zip(done, lens)]
        pieces = [x[:, int(cu[i]) + done[i]: int(cu[i]) + done[i] + take[i]] for i in range(3)]
        step_cu = torch.tensor([0, *torch.tensor(take).cumsum(0).tolist()])
        y, st = layer(torch.cat(pieces, 1), cu_seqlens=step_cu, state=st, output_state=True)
        for i in range(3):
            outs[i].append(y[:, int(step_cu[i]):int(step_cu[i + 1])])
            done[i] += take[i]
    y_steps = torch.cat([torch.cat(o, 1) for o in outs], 1)
    assert rel_err(y_steps, y_full) <= 1e-5
    assert rel_err(st.recurrent_state, st_full.recurrent_state) <= 1e-5


def test_state_is_fp32_and_bf16_decode_stays_close_to_fp32_over_256_steps():
    layer32 = make_layer(hidden=64, Dk=32, Dv=32)
    layer16 = make_layer(hidden=64, Dk=32, Dv=32, dtype=torch.bfloat16)
    layer16.load_state_dict(layer32.state_dict())
    x = torch.randn(1, 8 + 256, 64)
    _, s32 = layer32(x[:, :8], output_state=True)
    _, s16 = layer16(x[:, :8].bfloat16(), output_state=True)
    assert s16.recurrent_state.dtype == torch.float32 and s16.conv_state.dtype == torch.float32
    y32, y16 = [], []
    for t in range(8, 8 + 256):
        a, s32 = layer32(x[:, t:t + 1], state=s32, output_state=True)
        b, s16 = layer16(x[:, t:t + 1].bfloat16(), state=s16, output_state=True)
        y32.append(a)
        y16.append(b)
    assert s16.recurrent_state.dtype == torch.float32
    assert rel_err(torch.cat(y16, 1).float(), torch.cat(y32, 1)) <= 2e-2
    assert rel_err(s16.recurrent_state, s32.recurrent_state) <= 2e-2


def test_grouped_heads_equal_the_repeat_interleave_reference_and_per_head_A_log_matters():
    Hk, Hv, Dk, Dv, hidden = 2, 6, 8, 8, 32
    layer = make_layer(Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, hidden=hidden)
    with torch.no_grad():
        layer.A_log.copy_(torch.linspace(-3, 1, Hv))  # a different decay per value head
    # reference: Hk' = Hv q/k heads, q/k weights (projection and conv rows) of head j copied from head j // 3
    ref = GatedDeltaNet(hidden, Hv, Hv, Dk, Dv)
    src = layer.state_dict()
    heads = torch.arange(Hv) // (Hv // Hk)
    qk_rows = (heads[:, None] * Dk + torch.arange(Dk)).reshape(-1)
    key_dim = Hk * Dk
    rows = torch.cat([qk_rows, key_dim + qk_rows, 2 * key_dim + torch.arange(Hv * Dv)])
    dst = dict(src)
    dst["in_proj_qkv.weight"] = src["in_proj_qkv.weight"][rows]
    dst["conv1d.weight"] = src["conv1d.weight"][rows]
    ref.load_state_dict(dst)
    x = torch.randn(1, 90, hidden)
    assert rel_err(layer(x), ref(x)) <= 1e-5
    with torch.no_grad():  # swap the decays of two value heads inside group 0
        layer.A_log[[0, 1]] = layer.A_log[[1, 0]]
    assert rel_err(layer(x), ref(x)) > 1e-3


def test_fused_layout_equals_split_layout_with_reordered_weights():
    Hk, Hv, Dk, Dv, hidden = 2, 4, 8, 4, 24
    split = make_layer(Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, hidden=hidden)
    fused = GatedDeltaNet(hidden, Hk, Hv, Dk, Dv, projection_layout="fused")
    sd = split.state_dict()
    r = Hv // Hk
    qkv, z = sd["in_proj_qkv.weight"], sd["in_proj_z.weight"]
    q, k, v = qkv.split([Hk * Dk, Hk * Dk, Hv * Dv])
    blocks = []
    for h in range(Hk):  # transformers' per-k-head grouped order [q_h | k_h | v_h (r heads) | z_h (r heads)]
        blocks += [q[h * Dk:(h + 1) * Dk], k[h * Dk:(h + 1) * Dk], v[h * r * Dv:(h + 1) * r * Dv], z[h * r * Dv:(h + 1) * r * Dv]]
    ba = []
    for h in range(Hk):
        ba += [sd["in_proj_b.weight"][h * r:(h + 1) * r], sd["in_proj_a.weight"][h * r:(h + 1) * r]]
    fsd = {k_: v_ for k_, v_ in sd.items() if not k_.startswith("in_proj")}
    fsd["in_proj_qkvz.weight"] = torch.cat(blocks)
    fsd["in_proj_ba.weight"] = torch.cat(ba)
    fused.load_state_dict(fsd)
    x = torch.randn(2, 20, hidden)
    assert rel_err(fused(x), split(x)) <= 1e-6


def test_one_gemm_projection_equals_the_module_calls_and_honours_wrapped_projections():
    """The split layout projects [qkv | a | b] with one GEMM over the concatenated weights; a projection
    that is wrapped (here: a forward hook, as LoRA or FSDP per-module sharding would add) is called."""
    layer = make_layer()
    x = torch.randn(2, 9, 32, requires_grad=True)
    y = layer(x)
    gw = torch.autograd.grad(y.square().sum(), [x, layer.in_proj_qkv.weight, layer.in_proj_a.weight,
                                                layer.in_proj_b.weight])
    mods = (layer.in_proj_qkv, layer.in_proj_a, layer.in_proj_b)
    mixed = torch.cat([m(x) for m in mods], -1)   # what the modules compute, called one by one
    assert torch.allclose(layer._project(x)[0], mixed, rtol=1e-6, atol=1e-6)
    hooks = [m.register_forward_hook(lambda mod, inp, out: out) for m in mods]   # identity: same math
    y2 = layer(x)
    gw2 = torch.autograd.grad(y2.square().sum(), [x, *(m.weight for m in mods)])
    assert rel_err(y2, y) <= 1e-6 and all(rel_err(a, b) <= 1e-6 for a, b in zip(gw2, gw))
    for h in hooks:
        h.remove()
    handle = layer.in_proj_a.register_forward_hook(lambda mod, inp, out: out * 3.0)
    assert rel_err(layer(x), y) > 1e-3       # the hook's change reaches the output
    handle.remove()
    # a backward hook that zeroes the gradient flowing into in_proj_a's output is honoured
    handle = layer.in_proj_a.register_full_backward_pre_hook(lambda mod, gout: (torch.zeros_like(gout[0]),))
    ga = torch.autograd.grad(layer(x).square().sum(), layer.in_proj_a.weight)[0]
    assert float(ga.abs().max()) == 0.0 and float(gw[2].abs().max()) > 0
    handle.remove()
    # a forward replaced on the instance (accelerate-style wrapping) is called
    plain_forward = layer.in_proj_b.forward
    layer.in_proj_b.forward = lambda inp: plain_forward(inp) * 3.0
    assert rel_err(layer(x), y) > 1e-3
    del layer.in_proj_b.forward
    assert rel_err(layer(x), y) <= 1e-6


def test_initialisation_follows_transformers():
    layer = GatedDeltaNet(64, 4, 8, 32, 32)
    assert torch.equal(layer.dt_bias, torch.ones(8)) and torch.equal(layer.norm.weight, torch.ones(32))
    A = layer.A_log.exp()
    assert bool(((A >= 0.01 - 1e-6) & (A <= 16 + 1e-4)).all())
    assert abs(float(layer.in_proj_qkv.weight.detach().std()) - 0.02) < 2e-3
    assert layer.conv1d.weight.shape == (layer.conv_dim, 1, 4) and layer.conv1d.bias is None


@pytest.mark.parametrize("call, exc, match", [
    (lambda l: l(torch.randn(1, 5, 31)), ValueError, "hidden_size"),
    (lambda l: l(torch.randn(2, 5, 32), cu_seqlens=torch.tensor([0, 2, 5])), ValueError, "B == 1"),
    (lambda l: l(torch.randn(1, 5, 32), cu_seqlens=torch.tensor([0, 2, 4])), ValueError, "cu_seqlens"),
    (lambda l: l(torch.randn(1, 5, 32).double()), TypeError, "dtype"),
    (lambda l: l(torch.randn(5, 32)), ValueError, r"\[B, T, hidden\]"),
    (lambda l: l(torch.randn(2, 1, 32), state=GDNState(torch.zeros(3, 96, 3), torch.zeros(3, 4, 16, 8))),
     ValueError, r"state.conv_state must be \[N"),
    (lambda l: l(torch.randn(2, 1, 32), state=GDNState(torch.zeros(2, 96, 3), torch.zeros(2, 4, 8, 8))),
     ValueError, r"state.recurrent_state must be"),
    (lambda l: l(torch.randn(1, 1, 32), state=GDNState(torch.zeros(1, 96, 3), torch.zeros(1, 4, 16, 8).bfloat16())),
     TypeError, "float32"),
    (lambda l: l(torch.randn(1, 1, 32), state=GDNState(torch.zeros(1, 96, 3).double(), torch.zeros(1, 4, 16, 8))),
     TypeError, "conv_state must be torch.float32 with torch.float32 activations"),
    (lambda l: l.double()(torch.randn(1, 1, 32).double(), state=GDNState(torch.zeros(1, 96, 3), torch.zeros(1, 4, 16, 8))),
     TypeError, "conv_state must be torch.float64 with torch.float64 activations"),
    (lambda l: l(torch.randn(1, 1, 32), state=(1, 2)), TypeError, "GDNState"),
    (lambda l: l(torch.randn(1, 1, 32), state=GDNState(torch.zeros(1, 96, 3),
                                                      torch.full((1, 4, 16, 8), float("inf")))),
     ValueError, "state.recurrent_state"),
])
def test_bad_inputs_raise_naming_the_argument(call, exc, match):
    layer = make_layer()
    with pytest.raises(exc, match=match):
        call(layer)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(num_k_heads=3, num_v_heads=4), ValueError, "num_v_heads .*multiple of num_k_heads"),
    (dict(projection_layout="qkv"), ValueError, "projection_layout"),
    (dict(backend="cuda-magic"), ValueError, "backend"),
    (dict(head_k_dim=0), ValueError, "head_k_dim"),
    (dict(hidden_size=32.0), TypeError, "hidden_size"),
    (dict(norm_eps=float("inf")), ValueError, "norm_eps"),
])
def test_bad_construction_raises(kwargs, exc, match):
    args = dict(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8)
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        GatedDeltaNet(**args)


def test_every_parameter_and_buffer_lives_on_the_constructors_device():
    layer = GatedDeltaNet(32, 2, 4, 16, 8, device="meta")
    assert {t.device.type for t in [*layer.parameters(), *layer.buffers()]} == {"meta"}
    y = layer(torch.empty(2, 5, 32, device="meta"))        # shape inference on meta tensors
    assert y.device.type == "meta" and y.shape == (2, 5, 32)
