"""GatedDeltaNet with ``token_order`` (tokens held in a CP load balancer's order) == the single-process
layer at the held positions: outputs, the full final state and every gradient (input, initial state,
parameters), under Ulysses (any permutation), state passing (cp) and the cp x sp mesh, over real gloo
process groups; the rejection cases, raised on every rank together; and examples/cp_token_order.py
(a GDN / attention hybrid on one per-document head-tail layout) training like one process."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import cp_token_order  # noqa: E402
from dist_utils import error_of  # noqa: E402
from oracle import rel_err  # noqa: E402
from test_layer_cp import _layer, _mesh
from gdn_layer import GatedDeltaNet, GDNState
from gdn_layer.parallel import (count_fragments, gather_sequence, head_tail_order, per_document_head_tail_order,
                                plan_fragments, reduce_sp_grads, shard_sequence)

HIDDEN, HK, HV, DK, DV = 24, 2, 4, 8, 4
TOL = 1e-5


def _order(kind, T, cu, world):
    if kind == "head_tail":
        return head_tail_order(T, world)
    if kind == "per_document":
        return per_document_head_tail_order(torch.tensor(cu), world)
    if kind == "torch_per_document":  # torch's own rearrange index, passed as is
        from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
            _PerDocumentHeadTailLoadBalancer)
        lens = [b - a for a, b in zip(cu, cu[1:])]
        return _PerDocumentHeadTailLoadBalancer([lens], world, "cpu")._generate_indices()[0]
    if kind == "random":
        return torch.randperm(T, generator=torch.Generator().manual_seed(7))
    if kind == "contiguous":
        return torch.arange(T)
    raise AssertionError(kind)


def _parity(rank, world, cp, sp, T, cu, kind, with_state):
    """The single-process layer and the (cp, sp) run holding ``x[:, order]``; relative errors."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(1, T, HIDDEN, generator=gen)
    cot = torch.randn(1, T, HIDDEN, generator=gen)
    cu_t = None if cu is None else torch.tensor(cu)
    N = 1 if cu is None else len(cu) - 1
    ref = _layer()
    conv0 = torch.randn(N, ref.conv_dim, ref.conv_kernel_size - 1, generator=gen)
    rec0 = torch.randn(N, HV, DK, DV, generator=gen)
    w_conv, w_rec = torch.randn(conv0.shape, generator=gen), torch.randn(rec0.shape, generator=gen)

    def loss_of(y, st, cot_, share):
        return (y * cot_).sum() + share * ((st.conv_state * w_conv).sum() + (st.recurrent_state * w_rec).sum())

    def fresh_state():
        return GDNState(conv0.clone().requires_grad_(), rec0.clone().requires_grad_()) if with_state else None

    state_ref, x_ref = fresh_state(), x.clone().requires_grad_(True)
    y_ref, st_ref = ref(x_ref, cu_seqlens=cu_t, state=state_ref, output_state=True)
    loss_of(y_ref, st_ref, cot, 1.0).backward()

    order = _order(kind, T, cu, world)
    cp_group, sp_group = _mesh(cp, sp, False) if world > 1 else (None, None)
    layer = GatedDeltaNet(HIDDEN, HK, HV, DK, DV, sp_group=sp_group, cp_group=cp_group)
    layer.load_state_dict(ref.state_dict())
    group = dist.group.WORLD if world > 1 else None
    state = fresh_state()
    x_held = x[:, order].clone().requires_grad_(True)
    y_local, st = layer(shard_sequence(x_held, group), cu_seqlens=cu_t, state=state, output_state=True,
                        token_order=order)
    loss_of(y_local, st, shard_sequence(cot[:, order], group), 1.0 / world).backward()
    grads = {"x": x_held.grad}
    if world > 1:
        reduce_sp_grads(layer, cp_group)
        reduce_sp_grads(layer, sp_group)
        y = gather_sequence(y_local.detach(), group)
        if with_state:
            grads.update({"conv0": state.conv_state.grad, "rec0": state.recurrent_state.grad})
        for g in grads.values():
            dist.all_reduce(g, group=group)
    else:
        y = y_local.detach()
        if with_state:
            grads.update({"conv0": state.conv_state.grad, "rec0": state.recurrent_state.grad})
    errs = {"y": rel_err(y, y_ref[:, order]), "x.grad": rel_err(grads["x"], x_ref.grad[:, order]),
            "conv_state": rel_err(st.conv_state, st_ref.conv_state),
            "recurrent_state": rel_err(st.recurrent_state, st_ref.recurrent_state)}
    if with_state:
        errs["conv0.grad"] = rel_err(grads["conv0"], state_ref.conv_state.grad)
        errs["rec0.grad"] = rel_err(grads["rec0"], state_ref.recurrent_state.grad)
    ref_params = dict(ref.named_parameters())
    for name, p in layer.named_parameters():
        errs[name] = rel_err(p.grad, ref_params[name].grad)
    return errs


# T = 64 unless said otherwise; per-document orders need every length divisible by 2 * world
CASES = {  # name: (T, cu_seqlens, order kind, with_state)
    "head_tail_one_sequence": (64, None, "head_tail", True),
    "head_tail_pack_crossing_chunk_edges": (64, [0, 5, 60, 64], "head_tail", True),
    "per_document_with_an_empty_segment": (64, [0, 16, 16, 48, 64], "per_document", True),
    "per_document_without_state": (64, [0, 32, 40, 64], "per_document", False),
    "torch_per_document_index_as_is": (64, [0, 16, 48, 64], "torch_per_document", True),
    "contiguous_order": (64, [0, 7, 23, 40, 64], "contiguous", True),
    "chunks_shorter_than_the_conv_window": (16, [0, 3, 16], "head_tail", True),  # halo from several pieces
    "one_token_chunks": (8, [0, 3, 8], "head_tail", True),  # cp 4: 2 tokens per rank, the decode kernel
}
SP_CASES = {**CASES, "random_permutation": (64, [0, 5, 60, 64], "random", True)}


def test_one_process_any_permutation():
    errs = _parity(0, 1, 1, 1, 40, [0, 9, 9, 33, 40], "random", True)
    assert max(errs.values()) <= TOL, errs


def test_one_process_batch_of_sequences_in_one_order():
    """Without cu_seqlens (B rows), the order applies to every row."""
    layer, gen = _layer(), torch.Generator().manual_seed(5)
    x, order = torch.randn(3, 12, HIDDEN, generator=gen), torch.randperm(12, generator=gen)
    assert rel_err(layer(x[:, order], token_order=order), layer(x)[:, order]) <= TOL


@pytest.mark.parametrize("case", ["head_tail_pack_crossing_chunk_edges", "random_permutation"])
def test_sp2_matches_single_process(pool2, case):
    for errs in pool2.run(_parity, 1, 2, *SP_CASES[case], timeout=120):
        assert max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("case", ["per_document_with_an_empty_segment", "random_permutation"])
def test_sp4_matches_single_process(pool4, case):
    for errs in pool4.run(_parity, 1, 4, *SP_CASES[case], timeout=180):
        assert max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("case", list(CASES))
def test_cp2_matches_single_process(pool2, case):
    for errs in pool2.run(_parity, 2, 1, *CASES[case], timeout=120):
        assert max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("case", ["head_tail_pack_crossing_chunk_edges", "per_document_with_an_empty_segment",
                                  "torch_per_document_index_as_is", "chunks_shorter_than_the_conv_window",
                                  "one_token_chunks"])
def test_cp4_matches_single_process(pool4, case):
    for errs in pool4.run(_parity, 4, 1, *CASES[case], timeout=180):
        assert max(errs.values()) <= TOL, errs


@pytest.mark.parametrize("case", ["head_tail_pack_crossing_chunk_edges", "per_document_with_an_empty_segment",
                                  "per_document_without_state"])
def test_cp2_x_sp2_mesh_matches_single_process(pool4, case):
    for errs in pool4.run(_parity, 2, 2, *CASES[case], timeout=180):
        assert max(errs.values()) <= TOL, errs


def test_one_plan_per_token_order_tensor_rebuilt_after_an_in_place_change():
    from gdn_layer.token_order import prepare_token_order
    layer, x = _layer(), torch.randn(1, 8, HIDDEN)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(2))
    first = prepare_token_order(layer, order, x, None)
    assert prepare_token_order(layer, order, x, None) is first  # every layer of a step shares it
    order[[0, 1]] = order[[1, 0]]
    again = prepare_token_order(layer, order, x, None)
    assert again is not first and torch.equal(again.unsort, order)
    order[0] = order[1]  # no longer a permutation: raises on every call, nothing cached
    for _ in range(2):
        with pytest.raises(ValueError, match="appears 2 times"):
            prepare_token_order(layer, order, x, None)


def _frozen_or_no_grad(rank, world, cp, sp, mode):
    """A frozen layer with only the initial recurrent state trainable (some ranks' maps then need a
    gradient only through the state), or inference under no_grad; head-tail order."""
    gen = torch.Generator().manual_seed(21)
    cu = torch.tensor([0, 5, 20, 30, 64])
    x, cot = torch.randn(1, 64, HIDDEN, generator=gen), torch.randn(1, 64, HIDDEN, generator=gen)
    ref = _layer().requires_grad_(False)
    rec0 = torch.randn(4, HV, DK, DV, generator=gen)
    conv0 = torch.randn(4, ref.conv_dim, ref.conv_kernel_size - 1, generator=gen)
    order, group = head_tail_order(64, world), dist.group.WORLD
    cp_group, sp_group = _mesh(cp, sp, False)
    layer = _layer(cp_group, sp_group).requires_grad_(False)
    if mode == "no_grad":
        with torch.no_grad():
            y_ref, st_ref = ref(x, cu_seqlens=cu, state=GDNState(conv0, rec0), output_state=True)
            y, st = layer(shard_sequence(x[:, order], group), cu_seqlens=cu, state=GDNState(conv0, rec0),
                          output_state=True, token_order=order)
        return max(rel_err(gather_sequence(y, group), y_ref[:, order]),
                   rel_err(st.recurrent_state, st_ref.recurrent_state))
    s_ref = GDNState(conv0.clone(), rec0.clone().requires_grad_())
    (ref(x, cu_seqlens=cu, state=s_ref) * cot).sum().backward()
    s = GDNState(conv0.clone(), rec0.clone().requires_grad_())
    y = layer(shard_sequence(x[:, order], group), cu_seqlens=cu, state=s, token_order=order)
    (y * shard_sequence(cot[:, order], group)).sum().backward()
    dist.all_reduce(s.recurrent_state.grad)
    return rel_err(s.recurrent_state.grad, s_ref.recurrent_state.grad)


@pytest.mark.parametrize("cp, sp, mode", [(4, 1, "frozen"), (2, 2, "frozen"), (4, 1, "no_grad")])
def test_frozen_layer_and_inference_with_a_head_tail_order(pool4, cp, sp, mode):
    for err in pool4.run(_frozen_or_no_grad, cp, sp, mode, timeout=120):
        assert err <= TOL, err


def test_head_tail_orders_follow_the_load_balancer_layout():
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer
    assert torch.equal(head_tail_order(24, 3), _HeadTailLoadBalancer(24, 3, "cpu")._generate_indices()[0].long())
    # rank r holds chunk r then chunk 2P-1-r of every document, documents in order
    order = per_document_head_tail_order(torch.tensor([0, 4, 12, 12, 16]), 2)
    assert order.tolist() == [0, 3, 4, 5, 10, 11, 12, 15] + [1, 2, 6, 7, 8, 9, 13, 14]
    assert count_fragments(head_tail_order(32, 4), 4).tolist() == [2, 2, 2, 1]  # ranks 3's chunks touch
    with pytest.raises(ValueError, match="document 1 has length 6"):
        per_document_head_tail_order(torch.tensor([0, 4, 10]), 2)


def test_fragment_plan_of_a_head_tail_pack():
    cu = [0, 5, 60, 64]  # cp = 2, chunks of 16: rank 0 holds [0, 16) and [48, 64), rank 1 [16, 48)
    plans = [plan_fragments(head_tail_order(64, 2), cu, 2, r, 3, torch.device("cpu")) for r in range(2)]
    assert plans[0].cu_local.tolist() == [0, 5, 16, 28, 32]  # pieces [0,5) [5,16) [48,60) [60,64)
    assert plans[1].cu_local.tolist() == [0, 32]
    assert plans[0].later.tolist() == [2] and plans[1].later.tolist() == [0]  # [48,60) and [16,48) of doc 1
    assert plans[0].owner.tolist() == [0, 0, 0]
    # only pieces whose document goes on hand over: [5,16) on rank 0 and [16,48) on rank 1, one slot each
    assert plans[0].sent.tolist() == [1] and plans[1].sent.tolist() == [0] and plans[0].slots == 1
    # doc 1's earlier pieces are rank 0 slot 0 (row 0) and rank 1 slot 0 (row 1); the pad row is 2
    assert plans[0].chain.tolist() == [[0, 1]] and plans[1].chain.tolist() == [[0]]
    # the halo of [48, 60): the last 3 rows of rank 1's piece [16, 48) (gathered rows after N * 3 = 9)
    assert plans[0].halo.tolist() == [[9 + 3 + 0, 9 + 3 + 1, 9 + 3 + 2]]


# --------------------------------------------------------------------------------------------------
# rejection: before any collective of the forward, on every rank together


def _errors(rank, world, cp, case):
    cp_group, sp_group = _mesh(cp, world // cp, False)
    layer = _layer(cp_group, sp_group)
    T = 8 * world
    x = torch.randn(1, 8, HIDDEN)
    order = head_tail_order(T, world)
    if case == "not_a_permutation":
        order[3] = order[4]
    elif case == "out_of_range":
        order[0] = T
    elif case == "wrong_length":
        order = torch.arange(T + 1)
    elif case == "float_dtype":
        order = order.float()
    elif case == "differs_on_last_rank":
        order = torch.arange(T) if rank == world - 1 else order
    elif case == "too_many_fragments":
        order = torch.cat([torch.arange(0, T, 2), torch.arange(1, T, 2)])  # every other token: T/2 fragments
    return error_of(layer, x, cu_seqlens=torch.tensor([0, 5, T]), token_order=order)


REJECT = {"not_a_permutation": "appears 2 times", "out_of_range": "out of range", "wrong_length": "T = ",
          "float_dtype": "integer dtype", "differs_on_last_rank": "token_order",
          "too_many_fragments": "fragments"}


# (under sp_group alone any permutation is served: test_sp2_matches_single_process[random_permutation])
@pytest.mark.parametrize("cp, case", [(cp, c) for cp in (1, 2) for c in REJECT if cp == 2 or c != "too_many_fragments"])
def test_bad_token_order_raises_on_every_rank(pool2, cp, case):
    msgs = pool2.run(_errors, cp, case, timeout=60)
    assert all(msgs), msgs
    assert any(REJECT[case] in m for m in msgs), msgs


def test_bad_token_order_raises_on_every_rank_of_the_cp2_x_sp2_mesh(pool4):
    msgs = pool4.run(_errors, 2, "differs_on_last_rank", timeout=60)
    assert all(msgs), msgs


def test_token_order_of_a_wrong_type_is_named():
    layer = _layer()
    with pytest.raises(TypeError, match="token_order"):
        layer(torch.randn(1, 4, HIDDEN), token_order=[0, 1, 2, 3])


# --------------------------------------------------------------------------------------------------
# examples/cp_token_order.py (shares this module's worker pools)

STEPS = 3


@pytest.fixture(scope="module")
def one_process_losses():
    return cp_token_order.train(0, 1, 1, 1, STEPS)


def _close(parallel, single):
    return max(abs(a - b) / abs(b) for a, b in zip(parallel, single)) <= 1e-5


def test_example_hybrid_on_cp2_trains_like_one_process(pool2, one_process_losses):
    for losses in pool2.run(cp_token_order.train, 2, 1, STEPS, timeout=120):
        assert _close(losses, one_process_losses), (losses, one_process_losses)


@pytest.mark.parametrize("cp, sp", [(2, 2), (4, 1)])
def test_example_hybrid_on_four_ranks_trains_like_one_process(pool4, one_process_losses, cp, sp):
    for losses in pool4.run(cp_token_order.train, cp, sp, STEPS, timeout=180):
        assert _close(losses, one_process_losses), (losses, one_process_losses)


@pytest.mark.parametrize("variable, value", [("TORCHELASTIC_RUN_ID", "none"), ("WORLD_SIZE", "2")])
def test_example_refuses_a_torchrun_launch(monkeypatch, capsys, variable, value):
    """It starts its own ranks: under torchrun each launched process would start its own set and wait.
    (A LOCAL_RANK alone, as a SLURM script may export, is no torchrun launch: not refused.)"""
    monkeypatch.setenv(variable, value)
    with pytest.raises(SystemExit) as exc:
        cp_token_order.main(["--cp", "2"])
    assert exc.value.code == 2 and "not torchrun" in capsys.readouterr().err
