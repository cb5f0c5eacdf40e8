"""The ``ascend`` backend on an Ascend NPU against the torch reference (run on a machine with an NPU).

Marked ``npu``; skipped where torch_npu or an NPU is missing (CI is CPU-only: what can be checked there
is in tests/test_ascend_compile.py). Not yet run by this project: no NPU is reachable from its
machines. On an NPU machine, with the ``npu`` extra installed (``pip install -e ".[test,npu]"``)::

    python -m pytest -q -m npu tests/test_npu.py

Compares bf16 on the NPU with the fp32 torch layer on the CPU (rel <= 2e-2, as the CUDA backends are
checked): a packed batch with an empty segment and initial states, forward and backward (outputs,
returned states, the input's and every parameter's gradient), then one decode step for 130 sequences
(fla's decode kernel launched in two slices of at most 65 535 programs).
"""
import importlib.util

import pytest
import torch

from gdn_layer import GatedDeltaNet, GDNState


def _npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    try:
        import torch_npu  # noqa: F401
        return torch.npu.is_available()
    except Exception:
        return False


pytestmark = [pytest.mark.npu, pytest.mark.skipif(not _npu_available(), reason="needs an Ascend NPU with torch_npu")]


def rel_err(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_ascend_layer_matches_the_torch_layer_forward_backward_and_decode():
    torch.manual_seed(0)
    hidden, Hk, Hv, D = 256, 2, 4, 128
    ref = GatedDeltaNet(hidden, Hk, Hv, D, D, backend="torch")
    npu = GatedDeltaNet(hidden, Hk, Hv, D, D, backend="ascend", device="npu", dtype=torch.bfloat16)
    npu.load_state_dict(ref.state_dict())
    assert npu.resolved_backend == "ascend"
    cu = torch.tensor([0, 700, 700, 1500, 2049])
    N = cu.numel() - 1
    conv_dim = 2 * Hk * D + Hv * D
    st = GDNState(torch.randn(N, conv_dim, 3), torch.randn(N, Hv, D, D) * 0.1)
    x = torch.randn(1, 2049, hidden, requires_grad=True)
    xn = x.detach().to("npu", torch.bfloat16).requires_grad_(True)
    st_n = GDNState(st.conv_state.to("npu"), st.recurrent_state.to("npu"))
    y, out = ref(x, cu_seqlens=cu, state=st, output_state=True)
    yn, out_n = npu(xn, cu_seqlens=cu.to("npu"), state=st_n, output_state=True)
    y.square().sum().backward()
    yn.float().square().sum().backward()
    assert rel_err(yn, y) <= 2e-2 and rel_err(xn.grad, x.grad) <= 2e-2
    assert rel_err(out_n.recurrent_state, out.recurrent_state) <= 2e-2
    assert rel_err(out_n.conv_state, out.conv_state) <= 2e-2
    for (name, p), pn in zip(ref.named_parameters(), npu.parameters()):
        assert rel_err(pn.grad, p.grad) <= 2e-2, name
    # decode: one token for each of 130 sequences (> 127: fla's kernel in two launches)
    M = 130
    dec = GDNState(torch.randn(M, conv_dim, 3), torch.randn(M, Hv, D, D) * 0.1)
    step = torch.randn(1, M, hidden)
    dcu = torch.arange(M + 1)
    y1 = ref(step, cu_seqlens=dcu, state=dec)
    y1n = npu(step.to("npu", torch.bfloat16), cu_seqlens=dcu.to("npu"),
              state=GDNState(dec.conv_state.to("npu"), dec.recurrent_state.to("npu")))
    assert rel_err(y1n, y1) <= 2e-2
