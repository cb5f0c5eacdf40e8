"""How the all-to-all pair moves bytes: slice copies instead of a gather, the receive buffer returned as a
view, a backward without any accumulating index-put (on CUDA one costs 60x the
collective), and the block a rank keeps for itself never entering the exchange (it is copied while the
peers' blocks are in flight). Values and gradients are checked against plain indexing in float64,
single process and over gloo with the layer's own ``_feature_index``; what reaches
``torch.distributed`` is checked with a spy on ``batch_isend_irecv``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dist_utils import DistributedPool
from gdn_layer import GatedDeltaNet
from gdn_layer.parallel import head_to_seq, partition_heads, project_seq_to_head, seq_to_head
from gdn_layer.parallel.feature_plan import MAX_RUNS_PER_ROW, build_plan, plan_for

# an accumulating index-put is what x[..., idx]'s backward runs; a gather is what x[..., idx] runs
INDEX_PUT = {"aten.index_put.default", "aten.index_put_.default", "aten._index_put_impl_.default"}
GATHER = {"aten.index.Tensor", "aten.index_select.default", "aten.index_select.out", "aten.gather.default",
          "aten.take.default"}
INDEX_ADD = {"aten.index_add_.default", "aten.index_add.default"}


class OpLog(TorchDispatchMode):
    """Records the name of every aten op dispatched while active (forward and autograd's backward), and
    for each ``copy_`` the number of elements it wrote."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.written = []          # (position in ops, elements) of each copy_

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) == "aten.copy_.default":
            self.written.append((len(self.ops), args[0].numel()))
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def first_exchange(self):
        """Position of the first point-to-point op (where the exchange is posted)."""
        return next(i for i, op in enumerate(self.ops) if op.startswith(("c10d.send", "c10d.recv")))

    def copied(self, start=0, stop=None):
        """Elements written by copy_ between op positions ``start`` and ``stop``."""
        stop = len(self.ops) if stop is None else stop
        return sum(n for at, n in self.written if start <= at < stop)

    def exchange_ops(self):
        """How many sends and receives ran, and whether any all-to-all collective did."""
        return (sum(op.startswith("c10d.send") for op in self.ops), sum(op.startswith("c10d.recv") for op in self.ops),
                any("alltoall" in op for op in self.ops))


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _head_index(Hk, Hv, P, Dk, Dv):
    """The layer's rows (docs/ulysses.md): ``[q rows of its k heads | k rows | v rows | a | b]`` over
    ``[q_all | k_all | v_all | a | b]``."""
    hp = partition_heads(Hk, Hv, P)
    key_dim, conv_dim = Hk * Dk, 2 * Hk * Dk + Hv * Dv
    rows = []
    for d in range(P):
        qk = [h * Dk + i for h in hp.k_heads(d) for i in range(Dk)]
        v = [2 * key_dim + h * Dv + i for h in hp.v_heads(d) for i in range(Dv)]
        vh = list(hp.v_heads(d))
        rows.append(qk + [key_dim + i for i in qk] + v + [conv_dim + h for h in vh] + [conv_dim + Hv + h for h in vh])
    return torch.tensor(rows), conv_dim + 2 * Hv


def _fragmented(F, width, seed):
    """One row of ``width`` distinct random features: far more runs than MAX_RUNS_PER_ROW."""
    return torch.randperm(F, generator=torch.Generator().manual_seed(seed))[:width].view(1, width)


# ---------------------------------------------------------------------------------------------------
# the plan: what the host decides once per feature_index


def test_disjoint_head_blocks_become_one_copy_per_field_for_all_ranks():
    idx, _ = _head_index(Hk=4, Hv=8, P=4, Dk=3, Dv=2)
    plan = build_plan(idx)
    assert plan.disjoint and plan.pieces == ()
    # q, k, v, a, b: each one strided copy that serves the four rows
    assert len(plan.copies) == 5 and all(c.count == 4 and c.first == 0 for c in plan.copies)


def test_replicated_heads_are_added_where_a_second_rank_received_them():
    idx, F = _head_index(Hk=2, Hv=4, P=4, Dk=3, Dv=2)       # ranks (0, 1) and (2, 3) share a q/k head
    plan = build_plan(idx)
    assert not plan.disjoint and plan.copies is not None
    added = {(p.row, p.src) for p in plan.pieces if p.accumulate}
    # rows 1 and 3 re-send the q and k rows of the head rows 0 and 2 sent first
    assert added == {(1, 0), (1, 6), (3, 3), (3, 9)}
    assert plan.uncovered(F) == []


def test_replicated_heads_written_back_own_row_first_copy_there_and_add_in_the_others():
    # a rank unpacks its own block while the peers' blocks are in flight: that row must copy
    idx, _ = _head_index(Hk=2, Hv=4, P=4, Dk=3, Dv=2)
    plan = build_plan(idx)
    assert plan.pieces_from(0) is plan.pieces
    added = {(p.row, p.src) for p in plan.pieces_from(1) if p.accumulate}
    assert added == {(0, 0), (0, 6), (3, 3), (3, 9)}
    assert {(p.row, p.src) for p in plan.pieces_from(2) if p.accumulate} == {(1, 0), (1, 6), (3, 3), (3, 9)}
    assert plan.pieces_from(1) is plan.pieces_from(1)                  # cached
    # every feature is copied exactly once, whichever row goes first
    for first in range(4):
        copied = [f for p in plan.pieces_from(first) if not p.accumulate for f in range(p.src, p.src + p.n)]
        assert sorted(copied) == sorted(set(idx.flatten().tolist()))


def test_fragmented_rows_are_gathered_instead():
    assert build_plan(_fragmented(400, 200, seed=0)).copies is None
    few = torch.tensor([[2 * i for i in range(MAX_RUNS_PER_ROW)]])
    assert build_plan(few).copies is not None


def test_plan_is_cached_per_tensor_and_rebuilt_after_an_in_place_change():
    idx = torch.tensor([[0, 1, 2], [3, 4, 5]])
    plan = plan_for(idx)
    assert plan_for(idx) is plan
    assert plan_for(idx.clone()) is not plan
    idx[1] = torch.tensor([5, 3, 4])
    assert plan_for(idx) is not plan
    x = _rand(0, 1, 2, 6)
    torch.testing.assert_close(seq_to_head(x, idx[:1], None), x[..., [0, 1, 2]], rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------
# one process (no group): the same code path without the collective

INDEXES = {
    "head_blocks": lambda: _head_index(Hk=2, Hv=4, P=1, Dk=3, Dv=2),
    "permuted_blocks": lambda: (torch.tensor([[6, 7, 8, 0, 1, 2, 9]]), 11),
    "repeats_and_gaps": lambda: (torch.tensor([[3, 4, 5, 3, 4, 9, 9, 0]]), 12),
    "fragmented": lambda: (_fragmented(300, 120, seed=1), 300),
}


@pytest.mark.parametrize("kind", list(INDEXES))
@pytest.mark.parametrize("B", [1, 3])
def test_without_group_equals_indexing_in_values_and_gradients(kind, B):
    idx, F = INDEXES[kind]()
    # a non-contiguous x: the copies must follow its strides
    x = _rand(1, 5, B, F).transpose(0, 1).requires_grad_()
    cot = _rand(2, B, 5, idx.shape[1])
    y = seq_to_head(x, idx, None)
    torch.testing.assert_close(y, x.detach()[..., idx[0]], rtol=0, atol=0)
    (gx,) = torch.autograd.grad((y * cot).sum(), x)
    ref = torch.zeros(B, 5, F, dtype=torch.float64)
    for j, f in enumerate(idx[0].tolist()):
        ref[..., f] += cot[..., j]
    torch.testing.assert_close(gx, ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", list(INDEXES))
def test_no_accumulating_index_put_and_no_gather_for_ranges(kind):
    idx, F = INDEXES[kind]()
    x = _rand(3, 2, 4, F).requires_grad_()
    plan_for(idx)                                       # the one host read happens outside the log
    with OpLog() as fwd:
        y = seq_to_head(x, idx, None)
    with OpLog() as bwd:
        y.backward(_rand(4, *y.shape))
    assert not INDEX_PUT & set(fwd.ops + bwd.ops)
    if kind != "fragmented":
        assert not (GATHER | INDEX_ADD) & set(fwd.ops + bwd.ops), fwd.ops + bwd.ops


def test_output_is_a_view_of_the_receive_buffer():
    idx, F = _head_index(Hk=2, Hv=4, P=1, Dk=3, Dv=2)
    for B in (1, 3):
        y = seq_to_head(_rand(5, B, 4, F), idx, None)
        W = idx.shape[1]
        assert y.untyped_storage().nbytes() == y.numel() * y.element_size()
        assert y._is_view() and y.stride() == (W, B * W, 1)


# ---------------------------------------------------------------------------------------------------
# over gloo, with the layer's own feature_index


def _layer_index(P, replicated):
    Hk = P // 2 if replicated else P
    layer = GatedDeltaNet(16, Hk, 2 * P, 4, 2, sp_group=dist.group.WORLD)
    idx, F = _head_index(Hk, 2 * P, P, 4, 2)
    assert torch.equal(layer._feature_index(idx.device), idx)   # the test's rows are the layer's rows
    return layer._feature_index(idx.device), F


def _check_layer_index_parity_and_op_log(rank, P, replicated, B):
    idx, F = _layer_index(P, replicated)
    TL = 3
    x_full = _rand(1, B, TL * P, F).requires_grad_()
    cots = [_rand(100 + r, B, TL * P, idx.shape[1]) for r in range(P)]
    sum((x_full[..., idx[r]] * cots[r]).sum() for r in range(P)).backward()
    x = x_full.detach()[:, rank * TL:(rank + 1) * TL].clone().requires_grad_()
    plan_for(idx)
    with OpLog() as fwd:
        out = seq_to_head(x, idx, dist.group.WORLD)
    torch.testing.assert_close(out, x_full.detach()[..., idx[rank]], rtol=0, atol=0)
    assert out.untyped_storage().nbytes() == out.numel() * out.element_size()   # the receive buffer itself
    cot = cots[rank].clone()
    with OpLog() as bwd:
        out.backward(cot)
    torch.testing.assert_close(x.grad, x_full.grad[:, rank * TL:(rank + 1) * TL], rtol=1e-12, atol=1e-12)
    assert torch.equal(cot, cots[rank])                     # the incoming gradient is left as it was
    ops = set(fwd.ops + bwd.ops)
    assert not (INDEX_PUT | GATHER | INDEX_ADD) & ops, sorted(ops)
    # one send and one receive per peer each way, no collective over all P blocks
    assert fwd.exchange_ops() == bwd.exchange_ops() == (P - 1, P - 1, False)
    # forward: the peers' (P - 1) / P of the send side packed before the exchange is posted, the own block
    # after (overlapping it) straight into the output; every element of the output written once
    at = fwd.first_exchange()
    assert fwd.copied(0, at) == (P - 1) * out.numel() // P and fwd.copied(at) == out.numel() // P
    # backward: a contiguous incoming gradient (B == 1) is sent as it is; else its peers' blocks copied
    at = bwd.first_exchange()
    assert bwd.copied(0, at) == (0 if B == 1 else (P - 1) * out.numel() // P), bwd.ops


def _check_head_to_seq_copies_once_and_leaves_the_gradient(rank, P, B):
    TL, FL = 3, 5
    full = _rand(3, B, TL * P, P * FL).requires_grad_()
    cots = [_rand(200 + r, B, TL, P * FL) for r in range(P)]
    sum((full[:, r * TL:(r + 1) * TL] * cots[r]).sum() for r in range(P)).backward()
    x = full.detach()[..., rank * FL:(rank + 1) * FL].clone().requires_grad_()
    with OpLog() as fwd:
        out = head_to_seq(x, dist.group.WORLD)
    torch.testing.assert_close(out, full.detach()[:, rank * TL:(rank + 1) * TL], rtol=0, atol=0)
    assert out.is_contiguous()
    cot = cots[rank].clone()
    with OpLog() as bwd:
        out.backward(cot)
    torch.testing.assert_close(x.grad, full.grad[..., rank * FL:(rank + 1) * FL], rtol=0, atol=0)
    assert torch.equal(cot, cots[rank])
    assert fwd.exchange_ops() == bwd.exchange_ops() == (P - 1, P - 1, False)
    assert "aten.clone.default" not in fwd.ops + bwd.ops
    # forward, B == 1: the peers' blocks of x are sent as they are (B > 1: copied once); after posting,
    # every output element is written once: the own block while the exchange runs, then the received
    at = fwd.first_exchange()
    assert fwd.copied(0, at) == (0 if B == 1 else (P - 1) * x.numel() // P), fwd.ops
    assert fwd.copied(at) == out.numel(), fwd.ops
    # backward: the peers' column blocks of the gradient copied once into the send buffer, the own block
    # into the receive buffer after posting; the gradient leaves as a view of that buffer ([T, B,
    # F_local] order), so for B == 1 nothing else is copied (for B > 1 the leaf's AccumulateGrad copies
    # it into x's strides, which is autograd's, not ours)
    at = bwd.first_exchange()
    assert bwd.copied(0, at) == (P - 1) * cot.numel() // P, bwd.ops
    if B == 1:
        assert bwd.copied(at) == cot.numel() // P, bwd.ops
    # a broadcast (stride-0) gradient, as from .sum(), goes through as well
    x2 = x.detach().clone().requires_grad_()
    head_to_seq(x2, dist.group.WORLD).sum().backward()
    torch.testing.assert_close(x2.grad, torch.ones_like(x2), rtol=0, atol=0)


def _check_projected_equals_projection_then_seq_to_head(rank, P, replicated, B):
    """project_seq_to_head(x, W, idx) == seq_to_head(x @ W^T, idx): values, layout, grads of x and W."""
    idx, F = _layer_index(P, replicated)
    TL, H = 3, 7
    x = _rand(10 + rank, B, TL, H)
    w = _rand(20, F, H)
    cot = _rand(30 + rank, B, TL * P, idx.shape[1])
    outs, grads = [], []
    for fn in (lambda x, w: seq_to_head(torch.nn.functional.linear(x, w), idx, dist.group.WORLD),
               lambda x, w: project_seq_to_head(x, w, idx, dist.group.WORLD)):
        xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(xl, wl)
        out.backward(cot)
        outs.append(out)
        grads.append((xl.grad, wl.grad))
    assert outs[1].shape == outs[0].shape and outs[1].stride() == outs[0].stride()
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


class P2PSpy:
    """While active, records every ``dist.batch_isend_irecv`` batch as ``[(kind, group peer, tensor)]``
    and fails on the all-to-all collectives (which would move the block a rank keeps)."""

    def __enter__(self):
        self.batches = []
        self._saved = {name: getattr(dist, name) for name in ("batch_isend_irecv", "all_to_all_single", "all_to_all")}

        def spy(ops):
            self.batches.append([("send" if op.op is dist.isend else "recv", op.group_peer, op.tensor) for op in ops])
            return self._saved["batch_isend_irecv"](ops)

        def forbidden(*args, **kwargs):
            raise AssertionError("an all-to-all collective ran")

        dist.batch_isend_irecv, dist.all_to_all_single, dist.all_to_all = spy, forbidden, forbidden
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)

    def check_one_batch(self, rank, P, block):
        """One batch: one send and one receive of ``block`` elements to / from each peer, none to itself.
        Returns ``{peer: (sent tensor, receive tensor)}``."""
        assert len(self.batches) == 1, len(self.batches)
        (ops,) = self.batches
        peers = {}
        for kind, peer, t in ops:
            assert peer != rank and 0 <= peer < P and t.numel() == block and t.is_contiguous()
            assert kind not in peers.setdefault(peer, {}), (kind, peer)
            peers[peer][kind] = t
        assert sorted(peers) == [d for d in range(P) if d != rank] and all(len(v) == 2 for v in peers.values())
        self.batches.clear()
        return {d: (v["send"], v["recv"]) for d, v in peers.items()}


def _at_block(t, base, d, block):
    """``t`` starts at block ``d`` of ``base``'s storage (no copy: it is that block itself)."""
    return (t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            and t.data_ptr() == base.data_ptr() + d * block * base.element_size())


def _check_self_block_never_enters_the_exchange(rank, P, B):
    """What reaches torch.distributed: P - 1 blocks each way, the own block never; where the layout
    allows, blocks are sent from and received into the caller's tensors without a copy."""
    idx, F = _layer_index(P, replicated=False)
    TL, W = 3, idx.shape[1]
    block = TL * B * W
    x = _rand(rank, B, TL, F).requires_grad_()
    with P2PSpy() as spy:
        out = seq_to_head(x, idx, dist.group.WORLD)
        for d, (_, r) in spy.check_one_batch(rank, P, block).items():
            assert _at_block(r, out, d, block)                        # received in place
        cot = _rand(9 + rank, TL * P, B, W).transpose(0, 1)          # a gradient in the output's layout
        out.backward(cot)
        for d, (s, _) in spy.check_one_batch(rank, P, block).items():
            assert _at_block(s, cot, d, block)                        # sent as it is
        # head_to_seq: x's blocks of the peers' tokens sent as they are (B == 1 contiguous, or in
        # seq_to_head's layout), the gradient's received straight into the returned gradient
        FL = 5
        y = _rand(20 + rank, B * TL * P * FL)
        y = (y.view(1, TL * P, FL) if B == 1 else y.view(TL * P, B, FL).transpose(0, 1)).requires_grad_()
        z = head_to_seq(y, dist.group.WORLD)
        for d, (s, _) in spy.check_one_batch(rank, P, TL * B * FL).items():
            assert _at_block(s, y, d, TL * B * FL)
        (gy,) = torch.autograd.grad(z, y, _rand(30 + rank, *z.shape))
        for d, (_, r) in spy.check_one_batch(rank, P, TL * B * FL).items():
            assert _at_block(r, gy, d, TL * B * FL)
        # project_seq_to_head: the own block is computed into the receive buffer, never sent
        w = _rand(40, F, 7).requires_grad_()
        h = _rand(41 + rank, B, TL, 7).requires_grad_()
        out = project_seq_to_head(h, w, idx, dist.group.WORLD)
        for d, (_, r) in spy.check_one_batch(rank, P, block).items():
            assert _at_block(r, out, d, block)
        out.backward(cot)
        for d, (s, _) in spy.check_one_batch(rank, P, block).items():
            assert _at_block(s, cot, d, block)
        # no tokens: nothing to move, but a one-element placeholder still meets each peer (a rank whose
        # shapes differ then fails on the size instead of waiting forever)
        e = seq_to_head(x.detach()[:, :0], idx, dist.group.WORLD)
        spy.check_one_batch(rank, P, 1)
        assert e.shape == (B, 0, W) and head_to_seq(e, dist.group.WORLD).shape == (B, 0, P * W)
        spy.check_one_batch(rank, P, 1)


def _check_subgroup_ranks_are_group_ranks(rank, P):
    """In a group whose ranks are not the global ranks ({0, 2} and {1, 3}), every block reaches the
    group rank it is meant for: values and gradients against the single-process definition."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group, me, Q = groups[rank % 2], rank // 2, 2
    B, TL, F = 2, 3, 8
    idx = torch.tensor([[5, 6, 7, 0], [1, 2, 3, 5]])                  # feature 5 goes to both
    x_full = _rand(1 + rank % 2, B, TL * Q, F).requires_grad_()
    cots = [_rand(100 + r, B, TL * Q, idx.shape[1]) for r in range(Q)]
    sum((x_full[..., idx[r]] * cots[r]).sum() for r in range(Q)).backward()
    x = x_full.detach()[:, me * TL:(me + 1) * TL].clone().requires_grad_()
    out = seq_to_head(x, idx, group)
    torch.testing.assert_close(out, x_full.detach()[..., idx[me]], rtol=0, atol=0)
    out.backward(cots[me])
    torch.testing.assert_close(x.grad, x_full.grad[:, me * TL:(me + 1) * TL], rtol=1e-12, atol=1e-12)
    # head_to_seq: the rank's features of every token, back to its tokens with every rank's features
    full = _rand(3 + rank % 2, B, TL * Q, Q * 4)
    back = head_to_seq(full[..., me * 4:(me + 1) * 4], group)
    torch.testing.assert_close(back, full[:, me * TL:(me + 1) * TL], rtol=0, atol=0)
    w = _rand(5, F, 6)
    h = _rand(6 + rank, B, TL, 6)
    torch.testing.assert_close(project_seq_to_head(h, w, idx, group),
                               seq_to_head(torch.nn.functional.linear(h, w), idx, group), rtol=1e-12, atol=1e-12)


def _check_projected_under_autocast_runs_in_its_dtype(rank, P):
    """Under CPU bf16 autocast with fp32 weights, as the layer runs: bf16 out (as F.linear would give),
    values as the GEMM in bf16 then seq_to_head, fp32 weight gradient."""
    idx, F = _layer_index(P, replicated=True)
    x = _rand(10 + rank, 1, 3, 7).float()
    w = _rand(20, F, 7).float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = project_seq_to_head(x, w, idx, dist.group.WORLD)
        ref = seq_to_head(torch.nn.functional.linear(x, w), idx, dist.group.WORLD)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    out.float().sum().backward()
    assert w.grad.dtype == torch.float32 and w.grad.abs().sum() > 0
    with pytest.raises(TypeError, match="weight dtype"):
        project_seq_to_head(x, w.detach().double(), idx, dist.group.WORLD)


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def pool(request):
    with DistributedPool(request.param, timeout=60) as p:
        yield p


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("replicated", [False, True], ids=["disjoint", "replicated"])
def test_layer_index_matches_indexing_without_index_put_or_gather(pool, replicated, B):
    pool.run(_check_layer_index_parity_and_op_log, replicated, B)


@pytest.mark.parametrize("B", [1, 2])
def test_head_to_seq_copies_once_per_direction_and_leaves_the_gradient(pool, B):
    pool.run(_check_head_to_seq_copies_once_and_leaves_the_gradient, B)


def test_bench_script_runs_on_cpu_under_torchrun(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(root, "benchmarks", "bench_all_to_all.py"), "--device", "cpu", "--dtype", "float32",
           "--seq-lens", "64", "128", "--hidden", "32", "--k-heads", "2", "--v-heads", "4", "--head-dim", "8",
           "--iters", "2", "--warmup", "1", "--json", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| 128 |" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["T"] for r in rows] == [64, 128]
    # the send buffer of seq_to_head: T/P tokens x all 2*Hk*Dk + Hv*Dv + 2*Hv features, 4 bytes each
    assert rows[0]["s2h_mb"] == pytest.approx(32 * (2 * 2 * 8 + 4 * 8 + 2 * 4) * 4 / 1e6)
    assert all(r[k] > 0 for r in rows for k in ("s2h_fwd", "s2h_fwd_bwd", "s2h_raw", "h2s_fwd", "h2s_fwd_bwd"))


@pytest.mark.parametrize("B", [1, 2])
@pytest.mark.parametrize("replicated", [False, True], ids=["disjoint", "replicated"])
def test_projection_written_into_the_send_buffer_equals_projection_then_seq_to_head(pool, replicated, B):
    pool.run(_check_projected_equals_projection_then_seq_to_head, replicated, B)


def test_projected_without_group_and_bad_weight():
    idx = torch.tensor([[0, 2, 3]])
    x, w = _rand(1, 2, 4, 5), _rand(2, 6, 5)
    torch.testing.assert_close(project_seq_to_head(x, w, idx, None),
                               torch.nn.functional.linear(x, w)[..., idx[0]], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="weight must be"):
        project_seq_to_head(x, w[:, :4], idx, None)
    with pytest.raises(ValueError, match="feature_index must hold indices"):
        project_seq_to_head(x, w[:3], idx, None)


@pytest.mark.parametrize("B", [1, 2])
def test_the_block_a_rank_keeps_never_enters_the_exchange(pool, B):
    pool.run(_check_self_block_never_enters_the_exchange, B)


def test_blocks_reach_group_ranks_in_a_subgroup(pool):
    if pool.world_size != 4:
        pytest.skip("needs a group whose ranks differ from the global ranks")
    pool.run(_check_subgroup_ranks_are_group_ranks)


def test_projected_under_bf16_autocast(pool):
    pool.run(_check_projected_under_autocast_runs_in_its_dtype)


def _check_zero_sized_blocks_have_zero_sized_gradients(rank, P, B):
    """No tokens (T_local = 0) or no features (F_local = 0, W = 0, H = 0): nothing is exchanged, and the
    backward returns zero-sized gradients of the inputs' shapes (a -1 in a view is ambiguous there)."""
    g = dist.group.WORLD
    for T_local, FL in ((0, 3), (2, 0), (0, 0)):
        x = _rand(rank, B, T_local * P, FL).requires_grad_()
        out = head_to_seq(x, g)
        assert out.shape == (B, T_local, P * FL)
        (gx,) = torch.autograd.grad(out, x, torch.ones_like(out))
        assert gx.shape == x.shape
        h = _rand(rank, B, T_local, 4).requires_grad_()
        idx = torch.arange(P * 2).view(P, 2) if FL else torch.zeros(P, 0, dtype=torch.long)
        y = seq_to_head(torch.cat([h, h], -1), idx, g)
        assert y.shape == (B, T_local * P, idx.shape[1])
        (gh,) = torch.autograd.grad(y, h, torch.ones_like(y), allow_unused=True)
        assert gh is None or gh.shape == h.shape
        w = _rand(5, 8, 4).requires_grad_()
        z = project_seq_to_head(h, w, idx, g)
        assert z.shape == y.shape
        gh, gw = torch.autograd.grad(z, (h, w), torch.ones_like(z), allow_unused=True)
        assert gh is None or gh.shape == h.shape
        assert gw is None or gw.shape == w.shape


@pytest.mark.parametrize("B", [1, 2])
def test_zero_sized_blocks_have_zero_sized_gradients(pool, B):
    pool.run(_check_zero_sized_blocks_have_zero_sized_gradients, B)


def _check_projected_under_autocast_leaves_float64_as_autocast_does(rank, P):
    """Autocast never casts float64: float64 x and weight stay float64 (the values of F.linear then
    seq_to_head, to float64 precision), and float64 next to a cast dtype is a dtype mismatch."""
    idx, F = _layer_index(P, replicated=False)
    x = _rand(10 + rank, 2, 3, 7).requires_grad_()
    w = _rand(20, F, 7).requires_grad_()
    cot = _rand(30 + rank, 2, 3 * P, idx.shape[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = project_seq_to_head(x, w, idx, dist.group.WORLD)
        ref = seq_to_head(torch.nn.functional.linear(x, w), idx, dist.group.WORLD)
    assert out.dtype == ref.dtype == torch.float64
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out, (x, w), cot)
    want = torch.autograd.grad(ref, (x, w), cot)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for xx, ww in ((x.float(), w), (x, w.float())):
            with pytest.raises(TypeError, match="weight dtype"):
                project_seq_to_head(xx, ww, idx, dist.group.WORLD)


def test_projected_under_autocast_leaves_float64_alone(pool):
    pool.run(_check_projected_under_autocast_leaves_float64_as_autocast_does)


def _rank0_without_tokens(rank, P):
    x = _rand(rank, 1, 0 if rank == 0 else 3, 2 * P)
    seq_to_head(x, torch.arange(2 * P).view(P, 2), dist.group.WORLD)


def test_a_rank_without_tokens_among_ranks_with_tokens_fails_instead_of_hanging(pool):
    """A shape disagreement (which the layer rules out with agree_across_ranks first) must not leave
    ranks waiting: a rank with no tokens still meets its peers, and gloo fails on the size mismatch
    (it aborts that process: "Received data size doesn't match expected size")."""
    with pytest.raises(AssertionError) as e:
        pool.run(_rank0_without_tokens, timeout=60)
    assert "died without a result" in str(e.value) and "did not finish" not in str(e.value), str(e.value)


def _dx_errors_under_bf16_autocast(rank, P):
    """Relative error of dx against float64, under CPU bf16 autocast: projection then seq_to_head, and
    project_seq_to_head (whose dx sums one GEMM per destination rank)."""
    gen = torch.Generator().manual_seed(0)
    B, TL, H, W = 2, 64, 128, 48
    idx = torch.arange(P * W).view(P, W)
    xs = [torch.randn(B, TL, H, generator=gen, dtype=torch.float64) for _ in range(P)]
    w = torch.randn(P * W, H, generator=gen, dtype=torch.float64) / H ** 0.5
    cots = [torch.randn(B, TL * P, W, generator=gen, dtype=torch.float64) for _ in range(P)]
    xt = xs[rank].clone().requires_grad_()
    (truth,) = torch.autograd.grad(seq_to_head(xt @ w.t(), idx, dist.group.WORLD), xt, cots[rank])
    errs = []
    for fn in (lambda x, w: seq_to_head(torch.nn.functional.linear(x, w), idx, dist.group.WORLD),
               lambda x, w: project_seq_to_head(x, w, idx, dist.group.WORLD)):
        x = xs[rank].detach().float().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(x, w.float())
        (gx,) = torch.autograd.grad(out, x, cots[rank].to(out.dtype))
        errs.append(float((gx.double() - truth).norm() / truth.norm()))
    return errs


def test_projected_dx_in_bf16_is_as_accurate_as_the_projection_then_seq_to_head(pool):
    """dx = sum over destinations of g_d @ W_d: summed in float32, not rounded to bf16 after each
    destination (P roundings: 1.2x the error of F.linear's backward at P = 4)."""
    for ref, got in pool.run(_dx_errors_under_bf16_autocast):
        assert got < 1.05 * ref, (got, ref)


def _double_backward_raises(rank, P):
    idx = torch.arange(2 * P).view(P, 2)
    x = _rand(rank, 1, 2 * P, 2 * P).requires_grad_()
    w = _rand(7, 2 * P, 2 * P).requires_grad_()
    for fn in (lambda x: seq_to_head(x, idx, dist.group.WORLD), lambda x: head_to_seq(x, dist.group.WORLD),
               lambda x: project_seq_to_head(x, w, idx, dist.group.WORLD)):
        (gx,) = torch.autograd.grad((fn(x) ** 3).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice"):
            gx.sum().backward()


def test_a_second_derivative_through_the_exchange_raises(pool):
    """The backward's exchange is not itself recorded by autograd: a second derivative would silently
    miss every peer's contribution (it did: off by ~10 at P = 4), so it raises instead."""
    pool.run(_double_backward_raises)
