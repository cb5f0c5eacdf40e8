"""The gated delta rule ops accept what fla's ops accept: floating inputs of mixed dtypes.

Rule: math in fp32, or fp64 when any input is fp64; o in v's dtype; the final state in the math dtype.
Integer, bool and complex tensors are still refused.
"""
import pytest
import torch

from gdn_layer.kernels import chunk_gated_delta_rule, recurrent_gated_delta_rule
from oracle import naive_gated_delta_rule

KERNELS = [chunk_gated_delta_rule, recurrent_gated_delta_rule]


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def inputs(T=70, Hk=2, Hv=4, Dk=8, Dv=8, N=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, Hk, Dk, generator=gen)
    k = torch.randn(1, T, Hk, Dk, generator=gen)
    v = torch.randn(1, T, Hv, Dv, generator=gen)
    g = -torch.rand(1, T, Hv, generator=gen) * 0.2
    beta = torch.rand(1, T, Hv, generator=gen)
    h0 = torch.randn(N, Hv, Dk, Dv, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("casts", [
    {"v": torch.float16, "beta": torch.float16},                              # fla's usual mix
    {"initial_state": torch.float16},
    {"q": torch.bfloat16, "k": torch.bfloat16, "g": torch.float16},
], ids=["v_beta_fp16", "state_fp16", "qk_bf16_g_fp16"])
def test_mixed_dtypes_compute_in_fp32_and_return_v_dtype_and_an_fp32_state(kernel, casts):
    x = inputs()
    for name, dt in casts.items():
        x[name] = x[name].to(dt)
    cu = torch.tensor([0, 30, 70])
    o, final = kernel(**x, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True)
    assert o.dtype == x["v"].dtype and final.dtype == torch.float32
    # the same values, upcast to fp32 by hand: the mixed call is exactly that computation
    up = {n: t.float() for n, t in x.items()}
    o32, final32 = kernel(**up, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True)
    assert torch.equal(o, o32.to(o.dtype)) and torch.equal(final, final32)
    # and that computation is the gated delta rule (fp64 token loop)
    o_ref, final_ref = naive_gated_delta_rule(*(up[n] for n in "q k v g beta".split()),
                                              initial_state=up["initial_state"], cu_seqlens=cu, use_qk_l2norm=True)
    assert rel_err(o32, o_ref) <= 1e-5 and rel_err(final32, final_ref) <= 1e-5


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["q", "g", "initial_state"])
def test_one_fp64_input_makes_the_math_fp64(kernel, name):
    x = inputs(T=20)
    x[name] = x[name].double()
    o, final = kernel(**x, output_final_state=True, cu_seqlens=torch.tensor([0, 7, 20]))
    assert o.dtype == torch.float32 and final.dtype == torch.float64
    o64, final64 = kernel(**{n: t.double() for n, t in x.items()}, output_final_state=True,
                          cu_seqlens=torch.tensor([0, 7, 20]))
    assert torch.equal(o, o64.float()) and torch.equal(final, final64)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name, dtype", [("v", torch.int32), ("beta", torch.bool), ("k", torch.complex64),
                                         ("initial_state", torch.int64), ("initial_state", torch.complex128)])
def test_integer_bool_and_complex_inputs_are_still_refused(kernel, name, dtype):
    x = inputs(T=10, N=1)
    x[name] = x[name].to(dtype)
    with pytest.raises(TypeError, match=f"{name} must be a floating-point"):
        kernel(**x)


def test_the_reference_ops_compute_in_their_own_dtype_under_autocast():
    """torch.autocast would run the reference's matmuls in bf16: each op switches it off (same result inside)."""
    from gdn_layer.kernels import reference
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, 9, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(1, 9, 4, 8, generator=g)
    gate, beta = -torch.rand(1, 9, 4, generator=g), torch.rand(1, 9, 4, generator=g)
    h0 = torch.randn(2, 4, 8, 8, generator=g)
    cu = torch.tensor([0, 4, 9])
    for op in (reference.recurrent_gated_delta_rule, reference.chunk_gated_delta_rule):
        plain = op(q, k, v, gate, beta, None, h0, True, cu, True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            inside = op(q, k, v, gate, beta, None, h0, True, cu, True)
        assert all(torch.equal(a, b) for a, b in zip(plain, inside)), op.__name__
