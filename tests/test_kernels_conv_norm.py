"""causal_conv1d and gated_rms_norm against torch's own ops, per sequence."""
import pytest
import torch
import torch.nn.functional as F

from gdn_layer.kernels import available_backends, causal_conv1d, gated_rms_norm, resolve_backend
from oracle import naive_causal_conv1d


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("cu", [[0, 1, 5, 5, 40], [0, 40], [0, 0, 2, 40]])
def test_packed_conv_equals_each_sequence_alone_with_states(cu):
    C, W = 12, 4
    x = torch.randn(1, 40, C)
    w, bias = torch.randn(C, W), torch.randn(C)
    init = torch.randn(len(cu) - 1, C, W - 1)
    y, fin = causal_conv1d(x, w, bias, cu_seqlens=torch.tensor(cu), initial_state=init, output_final_state=True)
    y_ref, fin_ref = naive_causal_conv1d(x, w, bias, cu_seqlens=cu, initial_state=init)
    assert rel_err(y, y_ref) <= 1e-6 and rel_err(fin, fin_ref) <= 1e-6


def test_conv_no_leak_across_packed_sequences():
    C, W = 6, 4
    x = torch.randn(1, 30, C)
    w = torch.randn(C, W)
    cu = torch.tensor([0, 10, 30])
    y, _ = causal_conv1d(x, w, cu_seqlens=cu)
    x2 = x.clone()
    x2[0, 9] += 5.0  # last token of sequence 0
    y2, _ = causal_conv1d(x2, w, cu_seqlens=cu)
    assert torch.equal(y[0, 10:], y2[0, 10:])
    assert not torch.equal(y[0, 9], y2[0, 9])


def test_conv_in_two_pieces_with_state_equals_one_call():
    C, W = 5, 4
    x = torch.randn(2, 23, C)
    w = torch.randn(C, W)
    y, fin = causal_conv1d(x, w, output_final_state=True)
    for cut in (1, 2, 3, 11):
        y1, s1 = causal_conv1d(x[:, :cut], w, output_final_state=True)
        y2, s2 = causal_conv1d(x[:, cut:], w, initial_state=s1, output_final_state=True)
        assert rel_err(torch.cat([y1, y2], 1), y) <= 1e-6 and rel_err(s2, fin) <= 1e-6


def test_conv_matches_nn_conv1d_and_gradcheck():
    C, W, T = 4, 4, 9
    conv = torch.nn.Conv1d(C, C, W, groups=C, padding=W - 1, bias=True).double()
    x = torch.randn(1, T, C, dtype=torch.float64)
    y, _ = causal_conv1d(x, conv.weight[:, 0], conv.bias)
    y_ref = F.silu(conv(x.transpose(1, 2))[..., :T]).transpose(1, 2)
    assert rel_err(y, y_ref) < 1e-12
    xs = (x.requires_grad_(), torch.randn(C, W, dtype=torch.float64, requires_grad=True),
          torch.randn(C, dtype=torch.float64, requires_grad=True),
          torch.randn(2, C, W - 1, dtype=torch.float64, requires_grad=True))
    cu = torch.tensor([0, 4, 9])
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: causal_conv1d(a, b, c, cu_seqlens=cu, initial_state=d, output_final_state=True), xs)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(weight=torch.randn(6, 1, 4)), ValueError, r"\[C, W\]"),
    (dict(weight=torch.randn(5, 4)), ValueError, "weight must be"),
    (dict(initial_state=torch.randn(1, 6, 4)), ValueError, "initial_state"),
    (dict(activation="relu"), ValueError, "activation"),
    (dict(cu_seqlens=torch.tensor([0, 3, 2, 10])), ValueError, "cu_seqlens"),
    (dict(x=torch.randint(0, 5, (1, 10, 6))), TypeError, "x must be a floating-point"),
    (dict(bias=[0.0] * 6), TypeError, "bias must be a torch.Tensor"),
    (dict(weight=torch.randn(6, 0)), ValueError, "W >= 1"),
    (dict(output_final_state="no"), TypeError, "output_final_state must be a bool"),
])
def test_conv_bad_inputs(kwargs, exc, match):
    args = dict(x=torch.randn(1, 10, 6), weight=torch.randn(6, 4))
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        causal_conv1d(**args)


def test_gated_rms_norm_formula():
    x, z, w = torch.randn(3, 5, 16), torch.randn(3, 5, 16), torch.rand(16) + 0.5
    y = gated_rms_norm(x, z, w, eps=1e-6)
    ref = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * z * torch.sigmoid(z)
    assert rel_err(y, ref) <= 1e-6
    with pytest.raises(ValueError, match="same shape"):
        gated_rms_norm(x, z[..., :8], w)


def test_registry_auto_is_torch_on_cpu_and_unknown_names_raise():
    assert "torch" in available_backends("cpu")
    assert resolve_backend("auto", "cpu").name == "torch"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("no-such-backend", "cpu")
    with pytest.raises(TypeError, match="backend"):
        resolve_backend(3, "cpu")


def test_conv_zero_length_input_hands_state_through():
    init = torch.randn(2, 3, 3)
    y, fin = causal_conv1d(torch.randn(2, 0, 3), torch.randn(3, 4), initial_state=init, output_final_state=True)
    assert y.shape == (2, 0, 3) and torch.equal(fin, init)


@pytest.mark.parametrize("name", ["x", "weight", "bias", "initial_state"])
def test_conv_nan_in_any_input_raises_naming_it(name):
    torch.manual_seed(0)
    args = dict(x=torch.randn(1, 9, 6), weight=torch.randn(6, 4), bias=torch.randn(6),
                initial_state=torch.randn(2, 6, 3))
    args[name].view(-1)[3] = float("nan")
    with pytest.raises(ValueError, match=f"{name} contains NaN"):
        causal_conv1d(**args, cu_seqlens=torch.tensor([0, 4, 9]), output_final_state=True)
