"""The fixed-capacity contract of packed training (docs/performance.md, "Fixed capacity"): a pack of T
tokens whose cu_seqlens is padded to N_max + 1 entries with empty segments gives the unpadded results,
and a layer step with value checks off reads nothing on the host and builds no tensor there, alone and
under SP and CP (gloo): what a CUDA graph replayed over new packings needs from the code outside the
kernels."""
import pytest
import torch
import torch.distributed as dist

from host_read_spy import HostReadSpy, backward
from oracle import rel_err
from gdn_layer import GatedDeltaNet, GDNState
from gdn_layer.kernels.validation import skip_value_checks
from gdn_layer.parallel import pad_cu_seqlens, shard_sequence

HIDDEN, HK, HV, DK, DV = 24, 2, 4, 8, 4
T = 48
PACKINGS = ([0, 5, 30, 48], [0, 48], [0, 1, 2, 3, 40, 48])   # different N and lengths, one capacity T
N_MAX = 6


def _layer(sp_group=None, cp_group=None, layout="split"):
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, sp_group=sp_group, cp_group=cp_group, backend="torch",
                          projection_layout=layout)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
        layer.A_log.copy_(torch.empty(HV).uniform_(0.01, 0.05).log())   # slow decay
    return layer


# ------------------------------------------------------------------------------- pad_cu_seqlens
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_pad_cu_seqlens_appends_empty_segments_up_to_the_capacity(dtype):
    cu = torch.tensor([0, 5, 30, 48], dtype=dtype)
    padded = pad_cu_seqlens(cu, N_MAX)
    assert padded.dtype == dtype and padded.device == cu.device
    assert padded.tolist() == [0, 5, 30, 48, 48, 48, 48]
    assert pad_cu_seqlens(padded, N_MAX) is padded          # already at capacity: unchanged


def test_padded_pack_gives_the_unpadded_outputs_states_and_gradients():
    layer = _layer()
    gen = torch.Generator().manual_seed(1)
    x, cot = torch.randn(1, T, HIDDEN, generator=gen), torch.randn(1, T, HIDDEN, generator=gen)
    cu = torch.tensor(PACKINGS[0])
    results = []
    for c in (cu, pad_cu_seqlens(cu, N_MAX)):
        xi = x.clone().requires_grad_(True)
        y, st = layer(xi, cu_seqlens=c, output_state=True)
        (y * cot).sum().backward()
        results.append((y, st, xi.grad))
    (y0, st0, g0), (y1, st1, g1) = results
    assert rel_err(y1, y0) < 1e-6 and rel_err(g1, g0) < 1e-6
    assert rel_err(st1.recurrent_state[:3], st0.recurrent_state) < 1e-6
    assert rel_err(st1.conv_state[:3], st0.conv_state) < 1e-6
    # the empty segments' final states are their (zero) initial states
    assert st1.recurrent_state.shape[0] == N_MAX and not st1.recurrent_state[3:].any()
    assert not st1.conv_state[3:].any()


@pytest.mark.parametrize("cu, n_max, error, match", [
    ([0, 5, 30, 48], 2, ValueError, "max_num_seqs = 2"),
    ([0, 5, 30, 48], 0, ValueError, "max_num_seqs must be at least 1"),
    ([0, 5, 30, 48], 3.0, TypeError, "max_num_seqs must be an int"),
    ([0, 30, 5, 48], 6, ValueError, "cu_seqlens must be non-decreasing"),
    ([1, 30, 48], 6, ValueError, "cu_seqlens must start at 0"),
    ([[0, 48]], 6, ValueError, "cu_seqlens must be 1-D"),
])
def test_pad_cu_seqlens_names_the_broken_rule(cu, n_max, error, match):
    with pytest.raises(error, match=match):
        pad_cu_seqlens(torch.tensor(cu), n_max)


def test_pad_cu_seqlens_reads_nothing_on_the_host():
    cu = torch.tensor(PACKINGS[0])
    with skip_value_checks(), HostReadSpy() as spy:
        pad_cu_seqlens(cu, N_MAX)
    assert spy.found == []


# ------------------------------------------------------------------------------------- the spy
def test_the_spy_sees_host_reads_and_host_built_tensors():
    t = torch.arange(4)
    with HostReadSpy() as spy:
        t.tolist()
        int(t[1])
        t.cpu()
        torch.nonzero(t)
        torch.tensor([1, 2])
        torch.arange(3)
        torch.arange(3, device=t.device)        # on the device given: not host-built
        torch.zeros_like(t)
    assert [w for _, w in spy.found] == ["tolist", "__int__", "cpu", "nonzero", "tensor", "arange"]


# ------------------------------------------------------- no host reads in a step, alone, SP, CP
def _step(layer, x, cu, state):
    """One forward + backward of ``layer`` under the spy (value checks off); what the spy found."""
    xi = x.detach().clone().requires_grad_(True)
    with skip_value_checks(), HostReadSpy() as spy:
        y, st = layer(xi, cu_seqlens=cu, state=state, output_state=True)
        backward((y.float().pow(2)).sum() + st.recurrent_state.sum() + st.conv_state.sum())
    return spy.found


def _state(n, layer, gen):
    return GDNState(torch.randn(n, layer.conv_dim, layer.conv_kernel_size - 1, generator=gen).requires_grad_(),
                    torch.randn(n, HV, DK, DV, generator=gen).requires_grad_())


@pytest.mark.parametrize("layout", ["split", "fused"])
def test_a_packed_step_reads_nothing_on_the_host_over_new_packings_of_one_capacity(layout):
    """Every call gets a NEW cu_seqlens tensor (nothing derived from an earlier one can be reused)."""
    layer = _layer(layout=layout)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, T, HIDDEN, generator=gen)
    _step(layer, x, pad_cu_seqlens(torch.tensor(PACKINGS[0]), N_MAX), _state(N_MAX, layer, gen))  # first call
    for packing in PACKINGS:
        cu = pad_cu_seqlens(torch.tensor(packing), N_MAX)
        assert _step(layer, x, cu, _state(N_MAX, layer, gen)) == [], packing


def _distributed_steps(rank, world, mode):
    """SP: every call a new cu. CP: the slice plan reads cu on the host once per tensor (cached, shared
    by every layer of a step and its backward): a second call on the same cu reads nothing."""
    group = dist.group.WORLD
    layer = _layer(sp_group=group) if mode == "sp" else _layer(cp_group=group)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, T, HIDDEN, generator=gen)
    # first call: builds what is derived from the sizes alone (the feature index), once per layer
    _step(layer, shard_sequence(x, group), pad_cu_seqlens(torch.tensor(PACKINGS[0]), N_MAX), _state(N_MAX, layer, gen))
    found = {}
    for packing in PACKINGS:
        cu = pad_cu_seqlens(torch.tensor(packing), N_MAX)
        first = _step(layer, shard_sequence(x, group), cu, _state(N_MAX, layer, gen))
        again = _step(layer, shard_sequence(x, group), cu, _state(N_MAX, layer, gen))
        found[str(packing)] = first if mode == "sp" else again
    return found


@pytest.mark.parametrize("mode", ["sp", "cp"])
def test_sp2_and_cp2_steps_read_nothing_on_the_host(pool2, mode):
    for found in pool2.run(_distributed_steps, mode):
        assert found == {str(p): [] for p in PACKINGS}


def test_the_spy_sees_value_shaped_ops_and_passes_shape_only_ones():
    """The spy the contract's tests rely on: ops whose output shape depends on tensor values are host reads
    on a GPU (each a sync); their fixed-size forms are not."""
    counts, x, mask = torch.tensor([2, 0, 3]), torch.arange(5.0), torch.tensor([True, False, True, True, False])
    value_shaped = [lambda: torch.repeat_interleave(counts), lambda: torch.repeat_interleave(x[:3], counts),
                    lambda: x[:3].repeat_interleave(counts), lambda: torch.where(mask), lambda: torch.bincount(counts),
                    lambda: x[mask], lambda: counts.tolist()]
    for i, op in enumerate(value_shaped):
        with HostReadSpy() as spy:
            op()
        assert spy.found, i
    fixed = [lambda: torch.repeat_interleave(x[:3], counts, output_size=5), lambda: x.repeat_interleave(2),
             lambda: torch.where(mask, x, 0.0), lambda: x[counts], lambda: x[1:3]]
    for i, op in enumerate(fixed):
        with HostReadSpy() as spy:
            op()
        assert spy.found == [], (i, spy.found)
