"""GatedDeltaNet with state-passing context parallelism (cp_group), alone and on a (cp, sp) mesh with
Ulysses, over real gloo process groups == the single-process layer: outputs, the full final state and
every gradient (input, initial state, parameters)."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import error_of as _error_of
from oracle import rel_err
from gdn_layer import GatedDeltaNet, GDNState
from gdn_layer.parallel import gather_sequence, pad_for_sp, plan_slice, reduce_sp_grads, shard_sequence

HIDDEN, HK, HV, DK, DV = 24, 2, 4, 8, 4
TOL = 1e-5


def _layer(cp_group=None, sp_group=None):
    torch.manual_seed(0)
    layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, sp_group=sp_group, cp_group=cp_group)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
        # slow decay (rate 0.01 .. 0.05): a state handed over wrongly still shows slices later
        layer.A_log.copy_(torch.empty(HV).uniform_(0.01, 0.05).log())
    return layer


def _mesh(cp, sp, use_mesh):
    """(cp_group, sp_group) of this rank; rank = c * sp + s, so rank r passes slice r."""
    if use_mesh:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (cp, sp), mesh_dim_names=("cp", "sp"))
        return mesh["cp"], (mesh["sp"] if sp > 1 else None)
    rank, cp_mine, sp_mine = dist.get_rank(), None, None
    for s in range(sp):  # every rank creates every group, in the same order
        g = dist.new_group([c * sp + s for c in range(cp)])
        if rank % sp == s:
            cp_mine = g
    for c in range(cp):
        g = dist.new_group([c * sp + s for s in range(sp)])
        if rank // sp == c:
            sp_mine = g
    return cp_mine, (sp_mine if sp > 1 else None)


def _cp_parity(rank, world, cp, sp, T, cu, with_state, use_mesh=False):
    """The single-process layer and the (cp, sp) run on the same global batch; relative errors."""
    assert world == cp * sp
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(1, T, HIDDEN, generator=gen)
    cot = torch.randn(1, T, HIDDEN, generator=gen)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    N = 1 if cu is None else len(cu) - 1
    ref = _layer()
    conv0 = torch.randn(N, ref.conv_dim, ref.conv_kernel_size - 1, generator=gen)
    rec0 = torch.randn(N, HV, DK, DV, generator=gen)
    w_conv, w_rec = torch.randn(conv0.shape, generator=gen), torch.randn(rec0.shape, generator=gen)

    def loss_of(y, st, cot_, share):  # each rank adds `share` of the state terms
        return (y * cot_).sum() + share * ((st.conv_state[:N] * w_conv).sum() + (st.recurrent_state[:N] * w_rec).sum())

    state_ref = GDNState(conv0.clone().requires_grad_(), rec0.clone().requires_grad_()) if with_state else None
    x_ref = x.clone().requires_grad_(True)
    y_ref, st_ref = ref(x_ref, cu_seqlens=cu_t, state=state_ref, output_state=True)
    loss_of(y_ref, st_ref, cot, 1.0).backward()

    cp_group, sp_group = _mesh(cp, sp, use_mesh)
    layer = _layer(cp_group, sp_group)
    layer.load_state_dict(ref.state_dict())
    xp, cu_p, pad = pad_for_sp(x, cu_t, world)
    cotp, _, _ = pad_for_sp(cot, None, world)
    state = None
    if with_state:  # the pad is a sequence of its own: one more (zero) row
        extra = (cu_p.numel() - 1) - N if cu_p is not None else 0
        state = GDNState(torch.cat([conv0, conv0.new_zeros(extra, *conv0.shape[1:])]).requires_grad_(),
                         torch.cat([rec0, rec0.new_zeros(extra, *rec0.shape[1:])]).requires_grad_())
    world_group = dist.group.WORLD
    x_full = xp.clone().requires_grad_(True)
    y_local, st = layer(shard_sequence(x_full, world_group), cu_seqlens=cu_p, state=state, output_state=True)
    loss_of(y_local, st, shard_sequence(cotp, world_group), 1.0 / world).backward()
    # parameter gradients: summed over the whole mesh, one group after the other
    reduce_sp_grads(layer, cp_group)
    reduce_sp_grads(layer, sp_group)
    y = gather_sequence(y_local.detach(), world_group)[:, :T]
    grads = {"x": x_full.grad}
    if with_state:
        grads.update({"conv0": state.conv_state.grad[:N], "rec0": state.recurrent_state.grad[:N]})
    for g in grads.values():
        dist.all_reduce(g, group=world_group)  # each rank holds its part
    errs = {"y": rel_err(y, y_ref), "x.grad": rel_err(grads["x"][:, :T], x_ref.grad),
            "conv_state": rel_err(st.conv_state[:N], st_ref.conv_state),
            "recurrent_state": rel_err(st.recurrent_state[:N], st_ref.recurrent_state)}
    if with_state:
        errs["conv0.grad"] = rel_err(grads["conv0"], state_ref.conv_state.grad)
        errs["rec0.grad"] = rel_err(grads["rec0"], state_ref.recurrent_state.grad)
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        errs[name] = rel_err(p.grad, ref_params[name].grad)
    return errs


# T = 64: with cp = 4 the cp slices start at 16, 32, 48; with cp = 2 at 32 (sp splits each cp slice)
CASES = {  # (T, cu_seqlens, with_state)
    "one_sequence_through_every_slice": (64, None, True),
    "straddles_three_boundaries": (64, [0, 5, 60, 64], True),
    "straddles_two_boundaries": (64, [0, 10, 42, 45, 64], True),
    "starts_on_boundaries_with_empty_segments": (64, [0, 16, 16, 32, 32, 40, 48, 64, 64], True),
    "straddles_one_boundary_without_state": (64, [0, 7, 23, 40, 64], False),
    "needs_padding": (61, [0, 20, 33, 61], True),
    "slices_shorter_than_the_conv_window": (4, [0, 3, 4], True),  # conv halo from several ranks back
    "last_token_alone": (8, [0, 7, 7, 8], True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cp2_matches_single_process(pool2, case):
    for errs in pool2.run(_cp_parity, 2, 1, *CASES[case], timeout=120):
        assert max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("case", list(CASES))
def test_cp4_matches_single_process(pool4, case):
    for errs in pool4.run(_cp_parity, 4, 1, *CASES[case], timeout=180):
        assert max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("case", list(CASES))
def test_cp2_x_sp2_mesh_matches_single_process(pool4, case):
    for errs in pool4.run(_cp_parity, 2, 2, *CASES[case], timeout=180):
        assert max(errs.values()) <= TOL, errs


def test_cp2_x_sp2_with_device_mesh_dimensions(pool4):
    for errs in pool4.run(_cp_parity, 2, 2, *CASES["straddles_three_boundaries"], True, timeout=180):
        assert max(errs.values()) <= TOL, errs


def test_slice_plan_of_a_pack_straddling_boundaries():
    cu = torch.tensor([0, 5, 60, 60, 64])  # cp = 4, L = 16
    plans = [plan_slice(cu, 4, r) for r in range(4)]
    assert [p.incoming for p in plans] == [-1, 1, 1, 1]
    assert [p.incoming_first_rank for p in plans] == [-1, 0, 0, 0]
    assert [p.incoming_seen for p in plans] == [0, 11, 27, 43]
    assert [p.outgoing for p in plans] == [1, 1, 1, -1]
    assert [p.outgoing_from for p in plans] == [5, 0, 0, 0]
    assert plans[0].owner.tolist() == [0, 3, 3, 3]
    assert plans[3].cu_local.tolist() == [0, 0, 12, 12, 16]
    assert plans[1].cu_local.tolist() == [0, 0, 16, 16, 16]


# --------------------------------------------------------------------------------------------------
# errors: before any collective of the forward, on every rank together


def _errors(rank, world, case):
    cp_group, sp_group = _mesh(2, world // 2, False)
    layer = _layer(cp_group, sp_group)
    x = torch.randn(1, 8, HIDDEN)
    if case == "not_divisible":
        return _error_of(layer, torch.randn(1, 7, HIDDEN), cu_seqlens=torch.tensor([0, 13 * world // 2 + 3]))
    if case == "batch":
        return _error_of(layer, torch.randn(2, 8, HIDDEN))
    if case == "cu_differs_on_last_rank":
        cu = torch.tensor([0, 3, 8 * world]) if rank == world - 1 else torch.tensor([0, 5, 8 * world])
        return _error_of(layer, x, cu_seqlens=cu)
    if case == "nan_on_first_rank":
        if rank == 0:
            x[0, 2, 1] = float("nan")
        return _error_of(layer, x, cu_seqlens=torch.tensor([0, 5, 8 * world]))
    raise AssertionError(case)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", ["not_divisible", "batch", "cu_differs_on_last_rank", "nan_on_first_rank"])
def test_bad_input_raises_on_every_rank_of_the_mesh(pool2, pool4, world, case):
    msgs = (pool2 if world == 2 else pool4).run(_errors, case, timeout=60)
    assert all(msgs), msgs
    if case == "not_divisible":
        assert all("pad_for_sp" in m for m in msgs), msgs
    if case == "batch":
        assert all("B == 1" in m for m in msgs), msgs


def test_cp_group_of_a_wrong_type_is_named():
    with pytest.raises(TypeError, match="cp_group"):
        GatedDeltaNet(HIDDEN, HK, HV, DK, DV, cp_group="world")


def _no_grad_state(rank, world):
    """Inference: no autograd, state only; a pack whose middle sequence spans both slices."""
    cp_group, _ = _mesh(2, 1, False)
    layer, ref = _layer(cp_group), _layer()
    x = torch.randn(1, 32, HIDDEN, generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 9, 30, 32])
    with torch.no_grad():
        y, st = layer(shard_sequence(x, dist.group.WORLD), cu_seqlens=cu, output_state=True)
        y_ref, st_ref = ref(x, cu_seqlens=cu, output_state=True)
        y = gather_sequence(y, dist.group.WORLD)
    return rel_err(y, y_ref), rel_err(st.recurrent_state, st_ref.recurrent_state)


def test_cp2_under_no_grad(pool2):
    for errs in pool2.run(_no_grad_state, timeout=60):
        assert max(errs) <= TOL, errs



def _dtype_parity(rank, world, dtype):
    """cp = world on a pack straddling every boundary, in ``dtype``: output, state and input gradient."""
    layer, ref = _layer(dist.group.WORLD).to(dtype), _layer().to(dtype)
    x = torch.randn(1, 64, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    cu = torch.tensor([0, 5, 60, 64])
    x_ref, x_cp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, st = layer(shard_sequence(x_cp, dist.group.WORLD), cu_seqlens=cu, output_state=True)
    y_ref, st_ref = ref(x_ref, cu_seqlens=cu, output_state=True)
    (y.float().square().sum() + st.recurrent_state.sum() / world).backward()
    (y_ref.float().square().sum() + st_ref.recurrent_state.sum()).backward()
    dist.all_reduce(x_cp.grad)
    return (y.dtype == dtype and st.recurrent_state.dtype == st_ref.recurrent_state.dtype,
            [rel_err(gather_sequence(y.detach(), dist.group.WORLD), y_ref),
             rel_err(st.recurrent_state, st_ref.recurrent_state), rel_err(x_cp.grad, x_ref.grad)])


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.bfloat16, 1e-2)])
def test_cp4_in_float64_and_bfloat16(pool4, dtype, tol):
    for dtypes_ok, errs in pool4.run(_dtype_parity, dtype, timeout=120):
        assert dtypes_ok and max(errs) <= tol, errs


def _state_only_grad(rank, world, cp, sp):
    """A frozen layer and a trainable initial recurrent state (e.g. prefix tuning): nothing else needs a
    gradient, so some ranks' maps depend on it only through ranks where a sequence began."""
    gen = torch.Generator().manual_seed(21)
    cu = torch.tensor([0, 5, 20, 30, 64])  # with cp = 4: one rank sends a map from a sequence begun there
    x = torch.randn(1, 64, HIDDEN, generator=gen)
    cot = torch.randn(1, 64, HIDDEN, generator=gen)
    ref = _layer().requires_grad_(False)
    rec0 = torch.randn(4, HV, DK, DV, generator=gen)
    conv0 = torch.randn(4, ref.conv_dim, ref.conv_kernel_size - 1, generator=gen)
    s_ref = GDNState(conv0.clone(), rec0.clone().requires_grad_())  # q, k, v need no gradient
    (ref(x, cu_seqlens=cu, state=s_ref) * cot).sum().backward()
    cp_group, sp_group = _mesh(cp, sp, False)
    layer = _layer(cp_group, sp_group).requires_grad_(False)
    s = GDNState(conv0.clone(), rec0.clone().requires_grad_())
    (layer(shard_sequence(x, dist.group.WORLD), cu_seqlens=cu, state=s) * shard_sequence(cot, dist.group.WORLD)
     ).sum().backward()
    dist.all_reduce(s.recurrent_state.grad)
    return rel_err(s.recurrent_state.grad, s_ref.recurrent_state.grad)


@pytest.mark.parametrize("cp, sp", [(4, 1), (2, 2)])
def test_frozen_layer_with_a_trainable_initial_state(pool4, cp, sp):
    for err in pool4.run(_state_only_grad, cp, sp, timeout=120):
        assert err <= TOL, err


def _from_hf_cp(rank, world):
    """A transformers block converted with cp_group: each rank's slice equals the block on the whole pack."""
    import test_hf
    from gdn_layer.hf import swap_gated_deltanet
    torch.manual_seed(3)
    model = test_hf.qwen3_5()
    block = model.model.layers[0].linear_attn
    x = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(4))
    group = dist.new_group([0, 1])
    with torch.no_grad():
        want = block(x)[:, rank * 16:(rank + 1) * 16]
        layer = GatedDeltaNet.from_hf(block, cp_group=group)
        got = layer(x[:, rank * 16:(rank + 1) * 16].contiguous())
        n = swap_gated_deltanet(model, cp_group=group)
        swapped = model.model.layers[0].linear_attn
    return layer.cp_size, rel_err(got, want), n, swapped.cp_size


def test_from_hf_and_swap_take_cp_group(pool2):
    pytest.importorskip("transformers")
    for cp_size, err, n, swapped_cp in pool2.run(_from_hf_cp, timeout=120):
        assert (cp_size, n, swapped_cp) == (2, 2, 2) and err <= TOL, (cp_size, err, n, swapped_cp)


def _same_group_for_sp_and_cp(rank, world):
    g = dist.new_group(list(range(world)))
    try:
        GatedDeltaNet(HIDDEN, HK, HV, DK, DV, sp_group=g, cp_group=g)
    except ValueError as e:
        return str(e)
    return "no error"


def test_sp_and_cp_groups_sharing_ranks_raise(pool2):
    for msg in pool2.run(_same_group_for_sp_and_cp, timeout=60):
        assert "share" in msg and "sp_group and cp_group" in msg, msg


def _warmup_cp(rank, world, cp, sp, include_states):
    """warmup() on a cp (x sp) layer: the inputs are this rank's slices of packs of global length
    T = cp * sp * T_local, never dense batches (CP takes B == 1) nor decode (T = N is not split); the
    chunk kernel always sees states (CP hands them on)."""
    import dataclasses
    from gdn_layer.kernels import registry, warmup
    torch_b = registry.backend_by_name("torch")
    seen = []

    def chunk(*args, initial_state=None, output_final_state=False, cu=None, **kw):
        seen.append((initial_state is not None, output_final_state))
        return torch_b.chunk_gated_delta_rule(*args, initial_state=initial_state,
                                              output_final_state=output_final_state, cu=cu, **kw)

    registry.register_backend(dataclasses.replace(torch_b, name="cp_spy", priority=-5, chunk_gated_delta_rule=chunk))
    try:
        cp_group, sp_group = _mesh(cp, sp, use_mesh=False)
        layer = _layer(cp_group=cp_group, sp_group=sp_group)
        layer.backend = "cp_spy"
        assert warmup(layer, include_states=include_states) > 0
    finally:
        registry._BACKENDS.pop("cp_spy", None)
    return sorted(set(seen))


@pytest.mark.parametrize("include_states", [True, False])
def test_warmup_of_a_cp_layer_runs_its_slices(pool4, include_states):
    for cp, sp in ((4, 1), (2, 2)):
        for seen in pool4.run(_warmup_cp, cp, sp, include_states):
            # whatever include_states says, CP runs the chunk kernel with initial and final states
            assert (True, True) in seen, seen
