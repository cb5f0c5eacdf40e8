"""The stride rule (docs/kernels.md, "Strides"): every public op takes inputs of any strides, on every
backend that runs on this machine, and returns what it returns for contiguous copies of them.

Each input is laid out transposed (every dim reversed in memory, so no dim but the first is
unit-stride: a ``[B, H, T]`` buffer read as ``[B, T, H]``) or, for ``[H]`` vectors, with stride 2. The
oracle is the torch backend in float64 on contiguous copies (itself checked against the token-by-token
loop in tests/oracle.py by the kernel tests); outputs and the gradients of every input are compared.
"""
import pytest
import torch

from gdn_layer.kernels import (causal_conv1d, chunk_gated_delta_rule, gated_rms_norm, gdn_gate,
                               recurrent_gated_delta_rule)
from oracle import rel_err


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a layout whose last dim is not unit-stride (and no dim is contiguous)."""
    if t.dim() == 1:
        buf = torch.empty(t.shape[0], 2, dtype=t.dtype)
        buf[:, 0], buf[:, 1] = t, float("nan")
        return buf[:, 0]
    order = list(range(t.dim()))[::-1]
    return t.permute(order).contiguous().permute(order)


def _inputs(op, gen):
    """(function, {name: tensor}) for one public op: random inputs, non-zero, slow decay."""
    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale
    cu = torch.tensor([0, 5, 5, 19, 30])
    N, T, Hk, Hv, D = 4, 30, 2, 4, 8
    if op in ("chunk", "recurrent"):
        T = T if op == "chunk" else N
        cu = cu if op == "chunk" else torch.arange(N + 1)
        fn = chunk_gated_delta_rule if op == "chunk" else recurrent_gated_delta_rule
        ins = dict(q=r(1, T, Hk, D), k=r(1, T, Hk, D), v=r(1, T, Hv, D),
                   g=-torch.rand(1, T, Hv, generator=gen) * 0.1, beta=torch.rand(1, T, Hv, generator=gen),
                   initial_state=r(N, Hv, D, D, scale=0.1))
        return (lambda backend, **t: fn(**t, cu_seqlens=cu, output_final_state=True, use_qk_l2norm=True,
                                        backend=backend)), ins
    if op == "conv":
        C = 12
        ins = dict(x=r(1, T, C), weight=r(C, 4, scale=0.5), bias=r(C), initial_state=r(N, C, 3))
        return (lambda backend, **t: causal_conv1d(**t, cu_seqlens=cu, output_final_state=True,
                                                   backend=backend)), ins
    if op == "norm":
        ins = dict(x=r(2, T, Hv, D), z=r(2, T, Hv, D), weight=r(D))
        return (lambda backend, **t: (gated_rms_norm(**t, backend=backend),)), ins
    if op == "gate":
        ins = dict(a=r(2, T, Hv, scale=3.0), b=r(2, T, Hv, scale=3.0), A_log=r(Hv), dt_bias=r(Hv))
        return (lambda backend, **t: gdn_gate(**t, backend=backend)), ins
    raise AssertionError(op)


def _run(fn, backend, ins, cot_gen):
    """Outputs and the gradient of a random projection of them w.r.t. every input."""
    ins = {k: v.detach().requires_grad_() for k, v in ins.items()}
    outs = [o for o in fn(backend, **ins) if o is not None]
    loss = sum((o.double() * torch.randn(o.shape, generator=cot_gen, dtype=torch.float64)).sum() for o in outs)
    grads = torch.autograd.grad(loss, list(ins.values()))
    return outs, dict(zip(ins, grads))


@pytest.mark.parametrize("backend", ["torch", "triton_cpu"])
@pytest.mark.parametrize("op", ["chunk", "recurrent", "conv", "norm", "gate"])
def test_every_public_op_takes_any_strides_on_every_cpu_backend(op, backend, request):
    if backend == "triton_cpu":
        backend = request.getfixturevalue("triton_cpu_backend")
    fn, ins = _inputs(op, torch.Generator().manual_seed(3))
    want_out, want_grad = _run(fn, "torch", {k: v.double() for k, v in ins.items()}, torch.Generator().manual_seed(9))
    strided = {k: _strided(v) for k, v in ins.items()}
    assert all(v.dim() == 1 or v.stride(-1) != 1 for v in strided.values())
    got_out, got_grad = _run(fn, backend, strided, torch.Generator().manual_seed(9))
    for got, want in zip(got_out, want_out):
        assert rel_err(got, want) < 1e-5, op
    for name in ins:
        assert rel_err(got_grad[name], want_grad[name]) < 1e-5, (op, name)
