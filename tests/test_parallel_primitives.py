"""Specification of gdn_layer.parallel: head partition, all-to-all pair, padding, sharding, SP grads, agreement.

Multi-rank checks run in one pool of gloo worker processes per world size (P = 2 and 4), each check a
module-level ``_check_*`` function that every rank runs; the single-process reference is computed on
every rank from the same seeded global tensors. All inputs are fresh random float64, never zeros.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import dist_utils
from dist_utils import DistributedPool, run_distributed
from gdn_layer.kernels import recurrent_gated_delta_rule
from gdn_layer.parallel import (DIGEST_LEN, HeadPartition, agree_across_ranks, digest_of, gather_sequence,
                                head_to_seq, pad_for_sp, partition_heads, reduce_sp_grads, resolve_sp_group,
                                seq_to_head, shard_sequence)

# ------------------------------------------------------------------------------------------------------
# head partition (single process)

ACCEPTED = [(2, 4, 4), (4, 8, 2), (16, 32, 8), (1, 2, 2), (2, 8, 4), (1, 4, 4), (4, 8, 1), (16, 16, 16), (4, 8, 8)]
REJECTED = [(8, 12, 2), (2, 4, 8), (3, 6, 2), (4, 4, 8), (2, 6, 4), (0, 4, 2), (2, 4, 0), (2, 4, True)]


def test_partition_with_replication_shares_each_k_head_between_ranks():
    hp = partition_heads(2, 4, 4)
    assert hp == HeadPartition(2, 4, 4)
    assert (hp.k_heads_per_rank, hp.v_heads_per_rank, hp.replication) == (1, 1, 2)
    assert [list(hp.k_heads(i)) for i in range(4)] == [[0], [0], [1], [1]]
    assert [list(hp.v_heads(i)) for i in range(4)] == [[0], [1], [2], [3]]


def test_partition_without_replication_gives_whole_k_groups():
    hp = partition_heads(16, 32, 8)
    assert (hp.k_heads_per_rank, hp.v_heads_per_rank, hp.replication) == (2, 4, 1)
    assert hp.k_heads(3) == range(6, 8) and hp.v_heads(3) == range(12, 16)


@pytest.mark.parametrize("hk,hv,p", ACCEPTED)
def test_every_value_head_reads_a_k_head_its_rank_holds(hk, hv, p):
    hp = partition_heads(hk, hv, p)
    r = hv // hk
    for i in range(p):
        assert len(hp.k_heads(i)) == hp.k_heads_per_rank
        assert len(hp.v_heads(i)) == hp.v_heads_per_rank
        for j in hp.v_heads(i):
            assert j // r in hp.k_heads(i), f"rank {i}: value head {j} reads k head {j // r}"
    # value heads: a partition of range(Hv); k heads: each held by exactly `replication` ranks
    assert sorted(j for i in range(p) for j in hp.v_heads(i)) == list(range(hv))
    held = [h for i in range(p) for h in hp.k_heads(i)]
    assert sorted(held) == sorted(list(range(hk)) * hp.replication)


@pytest.mark.parametrize("hk,hv,p", REJECTED)
def test_partition_rejects_with_all_three_numbers_named(hk, hv, p):
    with pytest.raises(ValueError) as e:
        partition_heads(hk, hv, p)
    msg = str(e.value)
    assert f"num_k_heads = {hk!r}" in msg and f"num_v_heads = {hv!r}" in msg and f"SP size = {p!r}" in msg


def test_partition_rejects_a_rank_outside_the_group():
    hp = partition_heads(4, 8, 2)
    with pytest.raises(ValueError, match="rank"):
        hp.k_heads(2)
    with pytest.raises(ValueError, match="rank"):
        hp.v_heads(-1)


# ------------------------------------------------------------------------------------------------------
# single-process behaviour of the collectives (no group: identities)

def test_resolve_none_and_reject_other_types():
    assert resolve_sp_group(None) == (None, 1, 0)
    for bad in ("sp", 2, [0, 1]):
        with pytest.raises(TypeError, match="sp_group"):
            resolve_sp_group(bad)


def test_without_group_seq_to_head_selects_row_zero_and_head_to_seq_is_identity():
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    idx = torch.tensor([[4, 0, 2]])
    assert torch.equal(seq_to_head(x, idx, None), x[..., [4, 0, 2]])
    assert head_to_seq(x, None) is x
    with pytest.raises(ValueError, match="feature_index"):
        seq_to_head(x, torch.tensor([[0, 1], [2, 3]]), None)       # 2 rows for a group of 1
    with pytest.raises(ValueError, match="feature_index"):
        seq_to_head(x, torch.tensor([[0, 6]]), None)               # index out of [0, F)
    with pytest.raises(TypeError, match="feature_index"):
        seq_to_head(x, torch.tensor([[0, 1]], dtype=torch.int32), None)
    with pytest.raises(ValueError, match="3-D"):
        head_to_seq(x[0], None)


def test_without_group_shard_gather_and_reduce_are_identities():
    x = torch.randn(1, 7, 3, dtype=torch.float64)
    assert shard_sequence(x, None) is x and gather_sequence(x, None) is x
    lin = nn.Linear(3, 2).double()
    lin(x).sum().backward()
    before = lin.weight.grad.clone()
    reduce_sp_grads(lin, None)
    assert torch.equal(lin.weight.grad, before)
    with pytest.raises(ValueError, match="dim"):
        shard_sequence(x, None, dim=3)


# ------------------------------------------------------------------------------------------------------
# pad_for_sp (single process)

@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_pad_becomes_its_own_trailing_segment(dtype):
    x = torch.randn(1, 10, 3, dtype=torch.float64)
    cu = torch.tensor([0, 3, 3, 10], dtype=dtype)
    padded, pcu, pad = pad_for_sp(x, cu, 4)
    assert pad == 2 and padded.shape == (1, 12, 3)
    assert torch.equal(padded[:, :10], x) and torch.equal(padded[:, 10:], torch.zeros(1, 2, 3, dtype=x.dtype))
    assert pcu.dtype == dtype and pcu.tolist() == [0, 3, 3, 10, 12]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_no_pad_needed_returns_inputs_unchanged(dtype):
    x = torch.randn(1, 12, 3, dtype=torch.float64)
    cu = torch.tensor([0, 5, 12], dtype=dtype)
    padded, pcu, pad = pad_for_sp(x, cu, 4)
    assert padded is x and pcu is cu and pad == 0
    assert pad_for_sp(x, None, 3) == (x, None, 0)


def test_pad_without_cu_seqlens_separates_the_pad_only_for_one_row():
    x = torch.randn(1, 5, 2, dtype=torch.float64)
    padded, cu, pad = pad_for_sp(x, None, 4)
    assert pad == 3 and cu.tolist() == [0, 5, 8] and cu.dtype == torch.int64
    xb = torch.randn(3, 5, 2, 4, dtype=torch.float64)              # B > 1, extra trailing dims
    padded, cu, pad = pad_for_sp(xb, None, 2)
    assert cu is None and pad == 1 and padded.shape == (3, 6, 2, 4) and torch.equal(padded[:, :5], xb)


def test_pad_flows_gradient_to_real_tokens_only():
    x = torch.randn(1, 5, 2, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1, 8, 2, dtype=torch.float64)
    (pad_for_sp(x, None, 4)[0] * w).sum().backward()
    assert torch.equal(x.grad, w[:, :5])


def _random_delta_inputs(T, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, 2, 4, generator=g, dtype=torch.float64)
    k = torch.randn(1, T, 2, 4, generator=g, dtype=torch.float64)
    v = torch.randn(1, T, 4, 3, generator=g, dtype=torch.float64)
    gate = -torch.rand(1, T, 4, generator=g, dtype=torch.float64)
    beta = torch.rand(1, T, 4, generator=g, dtype=torch.float64)
    return q, k, v, gate, beta


@pytest.mark.parametrize("cu", [None, [0, 4, 4, 9, 11]])
def test_padding_leaves_real_outputs_and_final_states_unchanged(cu):
    T, P = 11, 4
    inputs = _random_delta_inputs(T, seed=7)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    o, s = recurrent_gated_delta_rule(*inputs, cu_seqlens=cu_t, output_final_state=True, backend="torch")
    padded = [pad_for_sp(t, cu_t, P) for t in inputs]
    pcu = padded[0][1]
    assert all(p[2] == 1 for p in padded)
    o_p, s_p = recurrent_gated_delta_rule(*(p[0] for p in padded), cu_seqlens=pcu, output_final_state=True,
                                          backend="torch")
    torch.testing.assert_close(o_p[:, :T], o, rtol=0, atol=0)
    torch.testing.assert_close(s_p[:-1], s, rtol=0, atol=0)       # the extra last row is the pad's


def test_pad_for_sp_errors_name_the_argument():
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="B == 1"):
        pad_for_sp(x, torch.tensor([0, 6]), 4)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]"):
        pad_for_sp(x[:1], torch.tensor([0, 5]), 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        pad_for_sp(x[:1], torch.tensor([0.0, 6.0]), 4)
    with pytest.raises(ValueError, match="sp_size"):
        pad_for_sp(x, None, 0)
    with pytest.raises(ValueError, match="hidden_states"):
        pad_for_sp(torch.randn(6), None, 2)
    with pytest.raises(TypeError, match="hidden_states"):
        pad_for_sp([1.0, 2.0], None, 2)


# ------------------------------------------------------------------------------------------------------
# digest (single process)

def test_digest_is_deterministic_and_tells_inputs_apart():
    cu = torch.tensor([0, 3, 7, 12])
    d = digest_of(1, (4, 5), cu)
    assert d.dtype == torch.int64 and d.shape == (DIGEST_LEN,)
    assert torch.equal(d, digest_of(1, (4, 5), cu.to(torch.int32)))
    assert torch.equal(d, digest_of(1, torch.Size([4, 5]), cu.clone()))
    others = [digest_of(1, (4, 5), torch.tensor([0, 3, 8, 12])), digest_of(1, (5, 4), cu),
              digest_of(2, (4, 5), cu), digest_of(1, (4, 5)), digest_of((1, 4), 5, cu),
              digest_of(1, (4, 5), torch.tensor([0, 7, 3, 12])), digest_of(1, 4, 5, cu), digest_of(1, (4, 5), None, cu)]
    for o in others:
        assert not torch.equal(d, o)
    kinds = [digest_of(7), digest_of((7,)), digest_of(torch.tensor([7])), digest_of(None), digest_of(()),
             digest_of(7, None)]
    assert len({tuple(k.tolist()) for k in kinds}) == len(kinds)     # type and presence are part of it
    with pytest.raises(TypeError, match="digest_of"):
        digest_of(torch.randn(3))
    with pytest.raises(TypeError, match="digest_of"):
        digest_of("abc")


def test_agree_without_group_only_reraises_the_local_error():
    agree_across_ranks(None, digest_of(3), None, "shapes")
    err = ValueError("x is bad")
    with pytest.raises(ValueError, match="x is bad"):
        agree_across_ranks(None, digest_of(3), err, "shapes")


# ------------------------------------------------------------------------------------------------------
# multi-rank checks (each runs on every rank of the pool)

def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _feature_index(P, F, replicated, seed):
    """[P, F_out] rows: a permutation split into P rows, or overlapping rows (some features on several
    ranks, some on none)."""
    g = torch.Generator().manual_seed(seed)
    if not replicated:
        return torch.randperm(F, generator=g).view(P, F // P)
    rows = [torch.randperm(F, generator=g)[:F // 2 + 1] for _ in range(P)]
    rows[-1][0] = rows[0][0]                                        # at least one feature on two ranks
    return torch.stack(rows)


def _check_seq_to_head_matches_single_process(rank, P, replicated):
    B, TL, F = 2, 3, 8
    x_full = _rand(1, B, TL * P, F).requires_grad_()
    idx = _feature_index(P, F, replicated, seed=2)
    grads_out = [_rand(100 + r, B, TL * P, idx.shape[1]) for r in range(P)]
    # single-process reference: every rank r reads x_full[..., idx[r]], loss = sum_r <out_r, grads_out[r]>
    ref = sum((x_full[..., idx[r]] * grads_out[r]).sum() for r in range(P))
    ref.backward()
    x = x_full.detach()[:, rank * TL:(rank + 1) * TL].clone().requires_grad_()
    out = seq_to_head(x, idx, dist.group.WORLD)
    assert out.shape == (B, TL * P, idx.shape[1])
    torch.testing.assert_close(out, x_full.detach()[..., idx[rank]], rtol=0, atol=0)
    (out * grads_out[rank]).sum().backward()
    torch.testing.assert_close(x.grad, x_full.grad[:, rank * TL:(rank + 1) * TL], rtol=1e-12, atol=1e-12)


def _check_head_to_seq_matches_single_process(rank, P):
    B, TL, FL = 2, 3, 5
    full = _rand(3, B, TL * P, P * FL).requires_grad_()            # [B, T, P*FL], rank r owns columns r
    grads_out = [_rand(200 + r, B, TL, P * FL) for r in range(P)]
    ref = sum((full[:, r * TL:(r + 1) * TL] * grads_out[r]).sum() for r in range(P))
    ref.backward()
    x = full.detach()[..., rank * FL:(rank + 1) * FL].clone().requires_grad_()
    out = head_to_seq(x, dist.group.WORLD)
    assert out.shape == (B, TL, P * FL)
    torch.testing.assert_close(out, full.detach()[:, rank * TL:(rank + 1) * TL], rtol=0, atol=0)
    (out * grads_out[rank]).sum().backward()
    torch.testing.assert_close(x.grad, full.grad[..., rank * FL:(rank + 1) * FL], rtol=0, atol=0)


def _check_round_trip_is_identity(rank, P):
    B, TL, F = 2, 4, 3 * P
    x = _rand(10 + rank, B, TL, F).requires_grad_()
    perm = _feature_index(P, F, replicated=False, seed=4)
    y = head_to_seq(seq_to_head(x, perm, dist.group.WORLD), dist.group.WORLD)
    torch.testing.assert_close(y, x.detach()[..., perm.reshape(-1)], rtol=0, atol=0)
    ident = torch.arange(F).view(P, F // P)
    y = head_to_seq(seq_to_head(x, ident, dist.group.WORLD), dist.group.WORLD)
    torch.testing.assert_close(y, x.detach(), rtol=0, atol=0)
    w = _rand(20 + rank, B, TL, F)
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, w, rtol=0, atol=0)


def _check_all_to_all_shape_errors_raise_on_every_rank(rank, P):
    x = _rand(5, 1, P * 2 + 1, 4)
    with pytest.raises(ValueError, match="pad_for_sp"):
        head_to_seq(x, dist.group.WORLD)
    with pytest.raises(ValueError, match="feature_index"):
        seq_to_head(x, torch.arange(4).view(1, 4), dist.group.WORLD)   # one row for P ranks
    # the group is still usable afterwards (no rank entered a collective)
    y = head_to_seq(x[:, :P * 2], dist.group.WORLD)
    assert y.shape == (1, 2, 4 * P)


def _check_pad_shard_gather_round_trip_and_grads(rank, P):
    group = dist.group.WORLD
    T = 3 * P + 1
    x = _rand(6, 1, T, 4)
    with pytest.raises(ValueError, match="pad_for_sp"):
        shard_sequence(x, group)
    padded, cu, pad = pad_for_sp(x, torch.tensor([0, 2, T], dtype=torch.int32), P)
    assert cu.tolist() == [0, 2, T, T + pad]
    L = padded.shape[1] // P
    local = shard_sequence(padded, group)
    torch.testing.assert_close(local, padded[:, rank * L:(rank + 1) * L], rtol=0, atol=0)
    whole = gather_sequence(local, group)
    torch.testing.assert_close(whole, padded, rtol=0, atol=0)
    torch.testing.assert_close(whole[:, :T], x, rtol=0, atol=0)
    # gather along another dim, non-contiguous input
    y = _rand(7 + rank, 3, 5, 2).transpose(0, 2)                     # [2, 5, 3]
    g2 = gather_sequence(y, group, dim=2)
    parts = [_rand(7 + r, 3, 5, 2).transpose(0, 2) for r in range(P)]
    torch.testing.assert_close(g2, torch.cat(parts, dim=2), rtol=0, atol=0)
    # gradients: shard -> only the slice; gather -> this rank's slice of the (rank-identical) loss grad
    xg = padded.clone().requires_grad_()
    w_r = _rand(30 + rank, 1, L, 4)
    (shard_sequence(xg, group) * w_r).sum().backward()
    expect = torch.zeros_like(padded)
    expect[:, rank * L:(rank + 1) * L] = w_r
    torch.testing.assert_close(xg.grad, expect, rtol=0, atol=0)
    lg = local.detach().clone().requires_grad_()
    w = _rand(40, *padded.shape)                                      # same on every rank
    (gather_sequence(lg, group) * w).sum().backward()
    torch.testing.assert_close(lg.grad, w[:, rank * L:(rank + 1) * L], rtol=0, atol=0)
    # grad="sum": each rank's loss differs (weights w_r); the shard's grad is the sum over ranks
    ls = local.detach().clone().requires_grad_()
    (gather_sequence(ls, group, grad="sum") * _rand(50 + rank, *padded.shape)).sum().backward()
    total = sum(_rand(50 + r, *padded.shape) for r in range(P))
    torch.testing.assert_close(ls.grad, total[:, rank * L:(rank + 1) * L], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="grad must be"):
        gather_sequence(local, group, grad="mean")


class _Tiny(nn.Module):
    """A Linear (float64), a float32 scale (a second dtype bucket) and a parameter only some ranks use."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 3).double()
        self.scale32 = nn.Parameter(torch.rand(3) + 0.5)
        self.extra = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.frozen = nn.Parameter(torch.randn(3, dtype=torch.float64), requires_grad=False)

    def forward(self, x, use_extra):
        y = self.lin(x) * self.scale32.double() + self.frozen
        return y * self.extra if use_extra else y


def _check_reduce_sp_grads_equals_single_process(rank, P):
    x = _rand(8, 1, 2 * P, 4)
    w = _rand(9, 1, 2 * P, 3)
    # single process: loss = sum over all tokens; only shard 0's tokens use `extra`
    ref = _Tiny()
    L = 2
    sum((ref(x[:, r * L:(r + 1) * L], r == 0) * w[:, r * L:(r + 1) * L]).sum() for r in range(P)).backward()
    model = _Tiny()
    loss = (model(shard_sequence(x, dist.group.WORLD), rank == 0) * shard_sequence(w, dist.group.WORLD)).sum()
    loss.backward()
    assert (model.extra.grad is None) == (rank != 0)
    reduce_sp_grads(model, dist.group.WORLD)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6 if p.dtype == torch.float32 else 1e-12,
                                       atol=1e-6 if p.dtype == torch.float32 else 1e-12, msg=name)
        else:
            assert p.grad is None


def _check_agree_passes_on_equal_digests(rank, P):
    cu = torch.tensor([0, 5, 9, 16])
    assert agree_across_ranks(dist.group.WORLD, digest_of((1, 16), cu), None, "cu_seqlens and shapes") is None


def _check_agree_raises_everywhere_on_differing_cu_seqlens(rank, P):
    cu = torch.tensor([0, 5, 9, 16]) if rank != 1 else torch.tensor([0, 5, 10, 16])
    with pytest.raises(ValueError, match="cu_seqlens and shapes differ across the SP ranks"):
        agree_across_ranks(dist.group.WORLD, digest_of((1, 16), cu), None, "cu_seqlens and shapes")


def _check_agree_raises_everywhere_on_a_local_error(rank, P):
    own = TypeError("hidden_states must be a torch.Tensor") if rank == 1 else None
    with pytest.raises(Exception) as e:
        agree_across_ranks(dist.group.WORLD, digest_of(1), own, "shapes")
    if rank == 1:
        assert e.value is own
    else:
        assert type(e.value) is ValueError and "rank(s) [1]" in str(e.value)
    # a malformed digest on one rank is that rank's error, not a mismatched collective
    bad = torch.zeros(DIGEST_LEN + 1, dtype=torch.int64) if rank == P - 1 else digest_of(1)
    with pytest.raises(ValueError, match="digest" if rank == P - 1 else rf"rank\(s\) \[{P - 1}\]"):
        agree_across_ranks(dist.group.WORLD, bad, None, "shapes")


def _check_resolve_device_mesh(rank, P):
    mesh = init_device_mesh("cpu", (P,), mesh_dim_names=("sp",))
    group, size, r = resolve_sp_group(mesh["sp"])
    assert (size, r) == (P, rank) and group is mesh.get_group()
    x = _rand(50 + rank, 1, 2, 2 * P)
    idx = torch.arange(2 * P).view(P, 2)
    torch.testing.assert_close(head_to_seq(seq_to_head(x, idx, mesh["sp"]), mesh["sp"]), x, rtol=0, atol=0)
    if P == 4:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
        with pytest.raises(ValueError, match="sp_group"):
            resolve_sp_group(mesh2)
        _, size, r = resolve_sp_group(mesh2["sp"])
        assert (size, r) == (2, rank % 2)


def _check_gather_sum_never_writes_the_incoming_gradient(rank, P):
    group = dist.group.WORLD
    x = _rand(60 + rank, 1, 2, 3).requires_grad_()
    other = _rand(61, 1, 2 * P, 3).requires_grad_()
    w = _rand(70 + rank, 1, 2 * P, 3)                                  # each rank's loss differs
    b = other * 1.0
    # `full + b` hands one gradient tensor to both branches, and autograd runs the gather's backward
    # first (the newer node): it must not sum that tensor over ranks in place, or b's branch reads the sum
    ((gather_sequence(x, group, grad="sum") + b) * w).sum().backward()
    torch.testing.assert_close(other.grad, w, rtol=0, atol=0)
    total = sum(_rand(70 + r, 1, 2 * P, 3) for r in range(P))
    torch.testing.assert_close(x.grad, total[:, 2 * rank:2 * rank + 2], rtol=1e-12, atol=1e-12)
    # nor the tensor the caller passes to .backward
    g = _rand(80 + rank, 1, 2 * P, 3)
    kept = g.clone()
    gather_sequence(x.detach().requires_grad_(), group, grad="sum").backward(g)
    torch.testing.assert_close(g, kept, rtol=0, atol=0)


def _check_sparse_grad_on_one_rank_raises_on_every_rank(rank, P):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4, sparse=True)
    if rank == 0:
        emb(torch.tensor([1, 3])).sum().backward()
    with pytest.raises(ValueError) as e:
        reduce_sp_grads(emb, dist.group.WORLD)
    assert ("sparse" if rank == 0 else "rank(s) [0]") in str(e.value)
    # no rank entered the gradient all-reduce: the group still works for the next step
    emb.weight.grad = None
    emb.sparse = False
    emb(torch.tensor([rank])).sum().backward()
    reduce_sp_grads(emb, dist.group.WORLD)
    assert emb.weight.grad[:P].eq(1).all() and emb.weight.grad[P:].eq(0).all()


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def pool(request):
    with DistributedPool(request.param, timeout=60) as p:
        yield p


@pytest.mark.parametrize("replicated", [False, True], ids=["disjoint", "replicated"])
def test_seq_to_head_matches_single_process_values_and_grads(pool, replicated):
    pool.run(_check_seq_to_head_matches_single_process, replicated)


def test_head_to_seq_matches_single_process_values_and_grads(pool):
    pool.run(_check_head_to_seq_matches_single_process)


def test_seq_to_head_then_head_to_seq_is_identity(pool):
    pool.run(_check_round_trip_is_identity)


def test_all_to_all_shape_errors_raise_on_every_rank_before_the_collective(pool):
    pool.run(_check_all_to_all_shape_errors_raise_on_every_rank)


def test_pad_shard_gather_round_trip_and_grads(pool):
    pool.run(_check_pad_shard_gather_round_trip_and_grads)


def test_reduce_sp_grads_equals_single_process_grads(pool):
    pool.run(_check_reduce_sp_grads_equals_single_process)


def test_agree_passes_on_equal_digests(pool):
    pool.run(_check_agree_passes_on_equal_digests)


def test_agree_raises_on_every_rank_when_cu_seqlens_differ(pool):
    pool.run(_check_agree_raises_everywhere_on_differing_cu_seqlens)


def test_agree_raises_on_every_rank_when_one_rank_failed_validation(pool):
    pool.run(_check_agree_raises_everywhere_on_a_local_error)


def test_resolve_sp_group_accepts_a_device_mesh_dimension(pool):
    pool.run(_check_resolve_device_mesh)


def test_gather_sum_backward_leaves_the_incoming_gradient_untouched(pool):
    pool.run(_check_gather_sum_never_writes_the_incoming_gradient)


def test_reduce_sp_grads_with_a_sparse_grad_on_one_rank_raises_on_every_rank_without_hanging(pool):
    pool.run(_check_sparse_grad_on_one_rank_raises_on_every_rank, timeout=30)


# ------------------------------------------------------------------------------------------------------
# the harness itself: a failing rank's traceback reaches pytest, a hanging rank cannot hang it

def _fail_on_rank_0_while_rank_1_waits(rank, P):
    if rank == 0:
        raise ValueError("boom on rank 0")
    dist.barrier()                                                    # never matched: rank 0 is gone
    return "unreachable"


def test_harness_reports_the_traceback_and_kills_a_hanging_rank(monkeypatch):
    monkeypatch.setattr(dist_utils, "_GRACE_S", 1.0)
    start = time.monotonic()
    with pytest.raises(AssertionError) as e:
        run_distributed(_fail_on_rank_0_while_rank_1_waits, 2, timeout=60)
    assert time.monotonic() - start < 50                             # the grace period, not the timeout
    msg = str(e.value)
    assert "ValueError: boom on rank 0" in msg
    assert "rank(s) [1] did not finish" in msg and "grace period after another rank failed" in msg


def test_harness_returns_every_ranks_result(pool):
    P = pool.world_size
    assert pool.run(_two_ranks_sum, 5) == [(r, 5 * P + P * (P - 1) // 2) for r in range(P)]


def _two_ranks_sum(rank, P, base):
    t = torch.tensor([base + rank])
    dist.all_reduce(t)
    return rank, int(t)
