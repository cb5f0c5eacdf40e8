"""Every CUDA backend against the torch reference (run on the GPU machine; skipped elsewhere).

bf16 inputs, relative error <= 1e-2 against the torch reference run in fp32 on the same (upcast) inputs:
outputs, final states and the gradients of every input, for the chunk op, the recurrent op and the
layer end to end; plus N*Hv > 65 535 (grid limits), empty segments and decode.
"""
import pytest
import torch

from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import available_backends, chunk_gated_delta_rule, recurrent_gated_delta_rule

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BACKENDS = [b for b in ("fla", "flash_qla") if torch.cuda.is_available() and b in available_backends("cuda")]


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def inputs(T, cu, Hk, Hv, D, dtype, with_state=True, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    N = len(cu) - 1
    q = torch.randn(1, T, Hk, D, device="cuda", generator=g)
    k = torch.randn(1, T, Hk, D, device="cuda", generator=g)
    v = torch.randn(1, T, Hv, D, device="cuda", generator=g)
    gate = -torch.rand(1, T, Hv, device="cuda", generator=g) * 0.1     # slow decay: a leak would show
    beta = torch.rand(1, T, Hv, device="cuda", generator=g)
    h0 = torch.randn(N, Hv, D, D, device="cuda", generator=g) * 0.1 if with_state else None
    cast = [x.to(dtype) for x in (q, k, v)] + [gate, beta.to(dtype)]
    return cast, h0, torch.tensor(cu, device="cuda")


def run_op(op, backend, xs, h0, cu, dtype):
    leaves = [x.detach().clone().requires_grad_(True) for x in xs]
    h = None if h0 is None else h0.detach().clone().requires_grad_(True)
    o, s = op(*leaves, initial_state=h, output_final_state=True, cu_seqlens=cu, use_qk_l2norm=True, backend=backend)
    g = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(o.shape, device="cuda", generator=g)
    ds = torch.randn(s.shape, device="cuda", generator=g)
    ((o.float() * do).sum() + (s * ds).sum()).backward()
    return o, s, [x.grad for x in leaves] + ([h.grad] if h is not None else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cu", [[0, 300], [0, 100, 100, 257, 700], [0, 1, 65, 129, 1000]])
def test_chunk_backend_matches_the_reference_in_bf16(backend, cu):
    xs, h0, cut = inputs(cu[-1], cu, 2, 4, 128, torch.bfloat16)
    o, s, grads = run_op(chunk_gated_delta_rule, backend, xs, h0, cut, torch.bfloat16)
    o_r, s_r, grads_r = run_op(chunk_gated_delta_rule, "torch", [x.float() for x in xs], h0, cut, torch.float32)
    assert rel_err(o, o_r) <= 1e-2 and rel_err(s, s_r) <= 1e-2
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], grads, grads_r):
        assert rel_err(a, b) <= 1e-2, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_cu_seqlens_buffer_refilled_in_place(backend):
    """One cu_seqlens buffer refilled for every batch (a loader's reused buffer), int64 on the device:
    fla's and FlashQLA's caches of chunk offsets are keyed by the tensor's identity, so the backends
    must see a new tensor after the refill (``cu_cache.as_int64``), or batch 2 runs batch 1's layout.
    The layer is called as a model would, twice per layout (the second call hits every cache)."""
    T = 700
    buf = torch.tensor([0, 100, 100, 257, 700], device="cuda")
    for layout in ([0, 100, 100, 257, 700], [0, 450, 451, 699, 700], [0, 64, 64, 64, 700]):
        buf.copy_(torch.tensor(layout))
        xs, h0, _ = inputs(T, layout, 2, 4, 128, torch.bfloat16, seed=len(layout) + layout[1])
        for _ in range(2):
            o, s, grads = run_op(chunk_gated_delta_rule, backend, xs, h0, buf, torch.bfloat16)
        o_r, s_r, grads_r = run_op(chunk_gated_delta_rule, "torch", [x.float() for x in xs], h0,
                                   torch.tensor(layout, device="cuda"), torch.float32)
        assert rel_err(o, o_r) <= 1e-2 and rel_err(s, s_r) <= 1e-2, layout
        for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], grads, grads_r):
            assert rel_err(a, b) <= 1e-2, (layout, name)


def test_fla_chunk_in_fp32_with_dk_64():
    if "fla" not in BACKENDS:
        pytest.skip("fla not importable")
    cu = [0, 90, 90, 333]
    xs, h0, cut = inputs(cu[-1], cu, 2, 6, 64, torch.float32)
    o, s, grads = run_op(chunk_gated_delta_rule, "fla", xs, h0, cut, torch.float32)
    o_r, s_r, grads_r = run_op(chunk_gated_delta_rule, "torch", xs, h0, cut, torch.float32)
    assert rel_err(o, o_r) <= 5e-3 and rel_err(s, s_r) <= 5e-3
    for name, a, b in zip(["q", "k", "v", "g", "beta", "h0"], grads, grads_r):
        assert rel_err(a, b) <= 5e-3, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_recurrent_decode_matches_the_reference(backend):
    cu = list(range(0, 9))        # 8 sequences of one token
    xs, h0, cut = inputs(8, cu, 2, 4, 128, torch.bfloat16)
    o, s, grads = run_op(recurrent_gated_delta_rule, backend, xs, h0, cut, torch.bfloat16)
    o_r, s_r, grads_r = run_op(recurrent_gated_delta_rule, "torch", [x.float() for x in xs], h0, cut, torch.float32)
    assert rel_err(o, o_r) <= 1e-2 and rel_err(s, s_r) <= 1e-2
    for a, b in zip(grads, grads_r):
        assert rel_err(a, b) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_more_than_65535_sequence_heads(backend):
    """2 050 sequences x 16 tokens at Hv = 32: N*Hv = 65 600 programs must fold onto grid axis 0."""
    N, L = 2050, 16
    cu = [i * L for i in range(N + 1)]
    xs, h0, cut = inputs(N * L, cu, 16, 32, 128, torch.bfloat16, with_state=False)
    o, s, grads = run_op(chunk_gated_delta_rule, backend, xs, None, cut, torch.bfloat16)
    o_r, s_r, grads_r = run_op(chunk_gated_delta_rule, "torch", [x.float() for x in xs], None, cut, torch.float32)
    assert rel_err(o, o_r) <= 1e-2 and rel_err(s, s_r) <= 1e-2
    assert rel_err(grads[2], grads_r[2]) <= 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_end_to_end_against_the_torch_backend(backend):
    torch.manual_seed(0)
    ref = GatedDeltaNet(512, 2, 4, 128, 128, backend="torch", device="cuda", dtype=torch.float32)
    with torch.no_grad():
        ref.A_log.uniform_(-4, -2)
    fast = GatedDeltaNet(512, 2, 4, 128, 128, backend=backend, device="cuda", dtype=torch.bfloat16)
    fast.load_state_dict({k: v.to(torch.bfloat16) for k, v in ref.state_dict().items()})
    cu = torch.tensor([0, 70, 70, 300, 517], device="cuda")
    x = torch.randn(1, 517, 512, device="cuda")
    y_r, st_r = ref(x.clone().requires_grad_(True), cu_seqlens=cu, output_state=True)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    y, st = fast(xb, cu_seqlens=cu, output_state=True)
    assert rel_err(y, y_r) <= 2e-2
    assert rel_err(st.recurrent_state, st_r.recurrent_state) <= 2e-2
    assert rel_err(st.conv_state, st_r.conv_state) <= 1e-2
    (y_r.float().square().mean() + st_r.recurrent_state.square().mean()).backward()
    (y.float().square().mean() + st.recurrent_state.square().mean()).backward()
    for (name, p), pf in zip(ref.named_parameters(), fast.parameters()):
        assert rel_err(pf.grad, p.grad) <= 3e-2, name
    # decode continues from the state on both
    step = torch.randn(1, 4, 512, device="cuda")
    dcu = torch.arange(5, device="cuda")
    y1_r = ref(step, cu_seqlens=dcu, state=st_r)
    y1 = fast(step.to(torch.bfloat16), cu_seqlens=dcu, state=st)
    assert rel_err(y1, y1_r) <= 2e-2
