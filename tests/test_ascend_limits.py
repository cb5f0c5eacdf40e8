"""The launch-limit changes behind the ``ascend`` backend, checked for values on CPU.

- Our Triton kernels are persistent (``kernels/triton/_grid.py``): with the program cap lowered to a
  few programs, every program loops over many tiles (and sequences), and conv, gate, L2 norm and gated
  RMSNorm still match the float64 torch reference, forward and backward (partial sums included).
- fla's fused recurrent decode is launched in slices of sequences (``ascend_backend.recurrent_fwd``):
  with the cap lowered, slicing packed (lengths > 1, an empty segment) and dense batches gives what
  one call gives, outputs and final states. fla's kernel cannot run on this CPU, so the slices call the
  torch reference in its place (the slicing, not fla's kernel, is under test here; the grids of the
  real kernel are checked by tests/test_ascend_compile.py).
"""
import pytest
import torch

from gdn_layer.kernels import ascend_backend, fla_backend, reference
from gdn_layer.kernels.triton import _grid, conv, gate, l2norm, norm

import test_triton_conv as tc
import test_triton_gate_norm as tg


class GridSpy:
    """Stands in for a jitted kernel: records each launch's grid, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid):
        self.grids.append(tuple(grid))
        return self.kernel[grid]


def spy_on(monkeypatch, module, *names):
    spies = {n: GridSpy(getattr(module, n)) for n in names}
    for n, s in spies.items():
        monkeypatch.setattr(module, n, s)
    return spies


def assert_looped(spies, cap):
    for name, s in spies.items():
        assert s.grids, f"{name} was not launched"
        for grid in s.grids:
            total = 1
            for d in grid:
                total *= d
            assert total <= cap, (name, grid)
    # at least one launch had more tiles than programs: its programs looped
    return True


@pytest.mark.parametrize("cu", [[0, 3, 3, 70, 71, 100, 160], None])
def test_conv_with_few_programs_matches_reference(monkeypatch, cu):
    monkeypatch.setattr(_grid, "MAX_PROGRAMS", 4)       # 2 channel blocks -> 2 programs on the token axis
    spies = spy_on(monkeypatch, conv, "_conv_fwd_kernel", "_conv_state_fwd_kernel", "_conv_dz_kernel",
                   "_conv_dx_kernel", "_conv_state_bwd_kernel")
    B, T = (1, 160) if cu else (3, 70)
    tc.assert_matches_reference(tc.make_inputs(B, T, 80, 4, cu=cu, seed=3), "silu")
    assert_looped(spies, 4)
    # 5 (tiles of 32 tokens) x B rows > 2 programs; 6 (3) sequences > 2 programs
    assert spies["_conv_fwd_kernel"].grids[0] == (2, 2) and spies["_conv_state_bwd_kernel"].grids[0] == (2, 2)


def test_gate_forward_with_few_programs_matches_reference(monkeypatch):
    monkeypatch.setattr(_grid, "MAX_PROGRAMS", 3)
    monkeypatch.setattr(gate, "_TILE", 16)          # BLOCK_T = 4 rows for H = 3: 17 tiles
    spies = spy_on(monkeypatch, gate, "_gate_fwd_kernel")
    tg.check_gate(1, 67, 3)
    assert spies["_gate_fwd_kernel"].grids == [(3,)]


def test_norm_forward_with_few_programs_matches_reference(monkeypatch):
    monkeypatch.setattr(_grid, "MAX_PROGRAMS", 3)
    monkeypatch.setattr(norm, "_TILE", 64)          # BLOCK_M = 2 rows for D = 24: 33 tiles
    spies = spy_on(monkeypatch, norm, "_norm_fwd_kernel")
    buf, x, z, w = tg.norm_inputs((65,), 24)
    tg.check_norm(x, z, w, (buf, w))
    assert spies["_norm_fwd_kernel"].grids == [(3,)]


def test_l2norm_with_few_programs_matches_reference(monkeypatch):
    monkeypatch.setattr(_grid, "MAX_PROGRAMS", 3)
    spies = spy_on(monkeypatch, l2norm, "_l2norm_fwd_kernel", "_l2norm_bwd_kernel")
    buf = torch.randn(2, 21, 5, 40, dtype=torch.float64)
    x = buf[..., 3:35].float().requires_grad_()     # 210 rows of D = 32: 14 tiles of 16
    dy = torch.randn(2, 21, 5, 32)
    y = l2norm.l2norm_fwd(x)
    dx = l2norm.l2norm_bwd(x, dy)
    xd = x.detach().double().requires_grad_()
    y_ref = reference.l2norm(xd)
    (dx_ref,) = torch.autograd.grad(y_ref, xd, dy.double())
    assert tg.rel_err(y, y_ref) <= 1e-5 and tg.rel_err(dx, dx_ref) <= 1e-5
    assert [s.grids for s in spies.values()] == [[(3,)], [(3,)]]


def test_grid_helper_caps_the_product_of_axes():
    assert _grid.programs(10, 4) == 10 and _grid.programs(10 ** 6, 128) == 65535 // 128
    assert _grid.programs(0, 7) == 0 and _grid.programs(10 ** 6) == 65535
    # a launcher's own cap over all axes (cdiv over the other axes), at least one program per other-axis block
    assert _grid.programs(10 ** 6, 32, 512) == 16 and _grid.programs(10 ** 6, 3, 512) == 171
    assert _grid.programs(10, 32, 512) == 10 and _grid.programs(10 ** 6, 4, 0) == 1
    assert _grid.programs(10 ** 6, 128, 10 ** 9) == 65535 // 128
    with pytest.raises(ValueError, match="65535"):
        _grid.programs(5, 65536)


def decode_inputs(N, lengths=None, Hk=2, Hv=4, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    if lengths is None:                                 # dense: N sequences of 2 tokens
        B, T, cu = N, 2, None
    else:
        B, T = 1, sum(lengths)
        cu = torch.tensor([0] + lengths).cumsum(0)
    q, k = (torch.randn(B, T, Hk, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, Hv, D, generator=g, dtype=torch.float64)
    gate_ = -torch.rand(B, T, Hv, generator=g, dtype=torch.float64) * 0.1      # slow decay
    beta = torch.rand(B, T, Hv, generator=g, dtype=torch.float64)
    h0 = torch.randn(N, Hv, D, D, generator=g, dtype=torch.float64)
    return (q, k, v, gate_, beta), h0, cu


@pytest.mark.parametrize("lengths", [[1] * 9, [2, 1, 0, 3, 1, 1, 4, 1, 2], None])
def test_decode_slices_give_what_one_call_gives(monkeypatch, lengths):
    calls = []

    def one_launch(q, k, v, g, beta, scale, h0, out_state, cu, l2):
        calls.append(q.shape[0] if cu is None else cu.shape[0] - 1)
        # fla reads cu as offsets into the tensors it is given (the reference only uses its differences)
        assert cu is None or (int(cu[0]) == 0 and int(cu[-1]) == q.shape[1]), (cu, q.shape)
        return reference.recurrent_gated_delta_rule(q, k, v, g, beta, scale, h0, out_state, cu, l2)

    monkeypatch.setattr(fla_backend, "recurrent_fwd", one_launch)
    # 4 value heads x 1 block of 8 columns = 4 programs per sequence: 3 sequences per slice
    assert ascend_backend.decode_programs_per_sequence(4, 8) == 4
    monkeypatch.setattr(ascend_backend, "MAX_PROGRAMS", 12)
    tensors, h0, cu = decode_inputs(9, lengths)
    o, fin = ascend_backend.recurrent_fwd(*tensors, 0.3, h0, True, cu, True)
    assert calls == [3, 3, 3]
    o_ref, fin_ref = reference.recurrent_gated_delta_rule(*tensors, 0.3, h0, True, cu, True)
    assert o.shape == o_ref.shape and fin.shape == fin_ref.shape
    assert tg.rel_err(o, o_ref) <= 1e-12 and tg.rel_err(fin, fin_ref) <= 1e-12
    calls.clear()
    o2, fin2 = ascend_backend.recurrent_fwd(*tensors, 0.3, None, False, cu, False)
    assert calls == [3, 3, 3] and fin2 is None
    assert tg.rel_err(o2, reference.recurrent_gated_delta_rule(*tensors, 0.3, None, False, cu, False)[0]) <= 1e-12


def test_decode_programs_per_sequence_follows_fla_grid():
    # fla-core 0.6 fused recurrent: grid (NV * N * HV,), NV = cdiv(V, min(8, next_power_of_2(V)))
    assert ascend_backend.decode_programs_per_sequence(32, 128) == 512   # Qwen3-Next: 127 sequences per launch
    assert ascend_backend.decode_programs_per_sequence(4, 6) == 4
    assert ascend_backend.decode_programs_per_sequence(1, 1) == 1
