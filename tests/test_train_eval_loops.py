"""The layer in real train / eval loops: the one caching rule (``gdn_layer.derived``) under
every way a buffer gets refilled, an eval pass under ``inference_mode`` before SP training, ``warmup``
on ranks seeded differently, and ``reduce_sp_grads`` for parameters some or no rank used.

The caches are driven by one table of refill paths (``REFILLS``) and one table of caches (``CACHES``):
each cache, after each refill, must give what a fresh tensor with the new values gives, computed
independently of the cache (``searchsorted``, ``index_select``, the values themselves).
"""
import copy

import pytest
import torch
import torch.distributed as dist

from oracle import rel_err
from gdn_layer import GatedDeltaNet
from gdn_layer.kernels import check_cu_seqlens, cu_cache, warmup
from gdn_layer.kernels.triton import conv_args
from gdn_layer.parallel import gather_sequence, reduce_sp_grads, seq_to_head, shard_sequence


def _no_grad_copy(t, new):
    with torch.no_grad():
        t.copy_(new)


def _inference_copy(t, new):
    with torch.inference_mode():
        t.copy_(new)


def _numpy_view(t, new):
    t.numpy()[...] = new.numpy()


def _data_copy(t, new):
    t.data.copy_(new)


def _data_assign(t, new):
    t.data = new.clone()


# how a buffer kept by the caller gets the next batch's values (a gloo broadcast: below, on two ranks)
REFILLS = {"copy_ under no_grad": _no_grad_copy, "copy_ under inference_mode": _inference_copy,
           "numpy view": _numpy_view, ".data copy_": _data_copy, ".data assigned": _data_assign}

T = 12


def _cu_int64(cu):
    return cu_cache.as_int64(cu, torch.device("cpu")).tolist()


def _conv_index(cu):
    return conv_args._seq_index(check_cu_seqlens(cu, T), T).tolist()


def _plan_gather(idx):
    x = torch.arange(2 * 3 * 6, dtype=torch.float32).reshape(2, 3, 6)
    return seq_to_head(x, idx, None).tolist()


def _cp_slice(cu):
    from gdn_layer.context_parallel import slice_plan
    plan = slice_plan(check_cu_seqlens(cu, T), 2, 1)
    return plan.cu_local.tolist(), plan.owner.tolist(), plan.incoming


def _cp_slice_expected(v):
    """Rank 1 of 2 holds tokens 6..11: local boundaries clamp(cu - 6, 0, 6); each sequence's owner is the
    rank holding its last token (an empty one: the rank holding its position); the sequence that started
    before token 6 and has tokens after it, if any."""
    cu = [int(c) for c in v]
    owner = [(cu[n + 1] - 1) // 6 if cu[n + 1] > cu[n] else min(cu[n] // 6, 1) for n in range(len(cu) - 1)]
    incoming = next((n for n in range(len(cu) - 1) if cu[n] < 6 < cu[n + 1]), -1)
    return [min(max(c - 6, 0), 6) for c in cu], owner, incoming


# cache name -> (first values, next values, what the code gives for a tensor, the independent expectation)
CACHES = {
    "cu_seqlens int64 copy": ([0, 3, 7, 12], [0, 6, 6, 12], _cu_int64, lambda v: v.tolist()),
    "conv sequence index": ([0, 3, 7, 12], [0, 1, 11, 12], _conv_index,
                            lambda v: (torch.searchsorted(v.long(), torch.arange(T), right=True) - 1).tolist()),
    "cp slice plan": ([0, 3, 7, 12], [0, 6, 6, 12], _cp_slice, _cp_slice_expected),
    "all-to-all plan": ([[0, 1, 2, 5]], [[4, 3, 0, 1]], _plan_gather,
                        lambda v: torch.arange(36.).reshape(2, 3, 6).index_select(-1, v[0]).tolist()),
}


@pytest.mark.parametrize("refill", list(REFILLS))
@pytest.mark.parametrize("cache", list(CACHES))
def test_no_cache_serves_a_refilled_buffer(cache, refill):
    first, new, query, expect = CACHES[cache]
    dtype = torch.int64 if cache == "all-to-all plan" else torch.int32
    buf = torch.tensor(first, dtype=dtype)
    assert query(buf) == expect(buf)                        # now kept
    REFILLS[refill](buf, torch.tensor(new, dtype=dtype))
    assert buf.tolist() == new
    assert query(buf) == expect(torch.tensor(new, dtype=dtype)), f"{cache} after {refill}"


@pytest.mark.parametrize("cache", list(CACHES))
def test_a_buffer_made_under_inference_mode_and_refilled_there_is_seen(cache):
    first, new, query, expect = CACHES[cache]
    dtype = torch.int64 if cache == "all-to-all plan" else torch.int32
    with torch.inference_mode():
        buf = torch.tensor(first, dtype=dtype)
        assert query(buf) == expect(buf)
        buf.copy_(torch.tensor(new, dtype=dtype))
        assert query(buf) == expect(torch.tensor(new, dtype=dtype)), cache


def _broadcast_refills(rank, world):
    got = []
    for cache, (first, new, query, expect) in CACHES.items():
        dtype = torch.int64 if cache == "all-to-all plan" else torch.int32
        buf = torch.tensor(first, dtype=dtype)
        query(buf)
        if rank == 0:
            buf.copy_(torch.tensor(new, dtype=dtype))
        dist.broadcast(buf, 0)                  # writes past the version counter on the receiving rank
        got.append((cache, query(buf) == expect(torch.tensor(new, dtype=dtype))))
    return got


def test_no_cache_serves_a_buffer_refilled_by_a_gloo_broadcast(pool2):
    for result in pool2.run(_broadcast_refills, timeout=120):
        assert all(ok for _, ok in result), result


# ------------------------------------------------------------------------------------------------
# an eval pass under inference_mode, then SP training

SIZES = (24, 2, 4, 8, 4)
CU = [0, 5, 12]


def _layer(group=None, seed=0):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(*SIZES, sp_group=group)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
        layer.A_log.copy_(torch.linspace(-2.5, 0.5, SIZES[2]))
    return layer


def _eval_then_train(rank, world):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1, CU[-1], SIZES[0], generator=gen)
    cot = torch.randn(1, CU[-1], SIZES[0], generator=gen)
    ref = _layer()
    cu = torch.tensor(CU)
    (ref(x, cu_seqlens=cu) * cot).sum().backward()
    layer = _layer(dist.group.WORLD)
    with torch.inference_mode():
        cu_eval = torch.tensor(CU)            # an inference tensor, reused below for training
        y_eval = layer(shard_sequence(x, dist.group.WORLD), cu_seqlens=cu_eval)
    errs = {"eval": rel_err(gather_sequence(y_eval, dist.group.WORLD), ref(x, cu_seqlens=cu).detach())}
    for step in range(2):
        layer.zero_grad()
        y = layer(shard_sequence(x, dist.group.WORLD), cu_seqlens=cu_eval if step else cu)
        (y * shard_sequence(cot, dist.group.WORLD)).sum().backward()
        reduce_sp_grads(layer, dist.group.WORLD)
        errs[f"y{step}"] = rel_err(gather_sequence(y.detach(), dist.group.WORLD), ref(x, cu_seqlens=cu).detach())
        errs[f"grad{step}"] = max(rel_err(p.grad, q.grad) for p, q in zip(layer.parameters(), ref.parameters()))
    return errs


def test_an_eval_pass_under_inference_mode_then_sp_training_matches_one_process(pool2):
    for errs in pool2.run(_eval_then_train, timeout=120):
        assert max(errs.values()) < 1e-5, errs


# ------------------------------------------------------------------------------------------------
# warmup on ranks whose global RNG differs

def _warmup_seeded_per_rank(rank, world, mode):
    from gdn_layer.parallel import resolve_sp_group  # noqa: F401  (the group is WORLD either way)
    ref = _layer()
    kw = {"sp_group": dist.group.WORLD} if mode == "sp" else {"cp_group": dist.group.WORLD}
    layer = GatedDeltaNet(*SIZES, **kw)
    layer.load_state_dict(ref.state_dict())            # identical weights on every rank
    torch.manual_seed(100 + rank)                      # the common per-rank seeding recipe
    before = torch.get_rng_state()
    warmup(layer, include_decode=False)
    return torch.equal(before, torch.get_rng_state())


@pytest.mark.parametrize("mode", ["sp", "cp"])
def test_warmup_passes_when_ranks_seed_their_rng_differently(pool2, mode):
    assert pool2.run(_warmup_seeded_per_rank, mode, timeout=180) == [True, True]


# ------------------------------------------------------------------------------------------------
# reduce_sp_grads and parameters that some or no rank used

class _Model(torch.nn.Module):
    def __init__(self, group=None):
        super().__init__()
        self.mixer = _layer(group)
        torch.manual_seed(3)
        self.extra = torch.nn.Linear(SIZES[0], SIZES[0])      # used on step 0 only
        self.head = torch.nn.Linear(SIZES[0], SIZES[0])       # used by the first half of the tokens only


def _loss(model, x, step, first_half):
    y = model.mixer(x, cu_seqlens=torch.tensor(CU))
    if step == 0:
        y = y + model.extra(x)
    h = model.head(x) * first_half[..., None]
    return (y.square() + h).sum() / CU[-1]


def _unused_params(rank, world):
    gen = torch.Generator().manual_seed(11)
    xs = [torch.randn(1, CU[-1], SIZES[0], generator=gen) for _ in range(3)]
    first_half = (torch.arange(CU[-1]) < CU[-1] // 2).float()[None]
    ref, model = _Model(), _Model(dist.group.WORLD)
    model.load_state_dict(ref.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ref, model)]
    grads_none = []
    for step, x in enumerate(xs):
        for m, opt in zip((ref, model), opts):
            opt.zero_grad()
            if m is ref:
                _loss(m, x, step, first_half).backward()
            else:
                _loss(m, shard_sequence(x, dist.group.WORLD), step, shard_sequence(first_half, dist.group.WORLD)).backward()
                reduce_sp_grads(m, dist.group.WORLD)
                grads_none.append((m.extra.weight.grad is None, ref.extra.weight.grad is None))
            opt.step()
    err = max(rel_err(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    return err, grads_none


def test_reduce_sp_grads_leaves_a_parameter_no_rank_used_without_a_gradient(pool2):
    for err, grads_none in pool2.run(_unused_params, timeout=120):
        assert grads_none == [(False, False), (True, True), (True, True)]
        assert err < 1e-5


def test_layer_module_reads_as_the_block():
    import pathlib
    import gdn_layer.layer
    assert len(pathlib.Path(gdn_layer.layer.__file__).read_text().splitlines()) <= 400
    copy.deepcopy(_layer())   # still a plain module


# ------------------------------------------------------------------------------------------------
# what a malformed input on one rank raises must reach the agreement step: every rank raises together, instead of
# the others waiting in a collective that rank never joins

def _malformed_on_one_rank(rank, world, case):
    from gdn_layer import GDNState
    from gdn_layer.parallel import head_tail_order
    kw = {"cp_group": dist.group.WORLD} if case.startswith("cp") else {"sp_group": dist.group.WORLD}
    layer = GatedDeltaNet(*SIZES, **kw)
    layer.load_state_dict(_layer().state_dict())
    x = torch.randn(1, CU[-1] // world, SIZES[0], generator=torch.Generator().manual_seed(1))
    args = {"cu_seqlens": torch.tensor(CU)}
    if case.endswith("state") and rank == 1:
        args["state"] = (torch.zeros(2), torch.zeros(2)) if case == "sp tuple state" else GDNState(None, None)
    if case == "cp empty token_order":
        x, args = x[:, :0], {"token_order": head_tail_order(0, world) if rank == 0 else torch.zeros(0)}
    try:
        layer(x, **args)
    except (TypeError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.parametrize("case", ["sp tuple state", "cp GDNState(None, None) state", "cp empty token_order"])
def test_a_malformed_input_on_one_rank_raises_on_every_rank_together(pool2, case):
    results = pool2.run(_malformed_on_one_rank, case, timeout=60)
    assert all(r is not None for r in results), results
    if case.endswith("state"):
        assert results[1][0] == "TypeError" and "state" in results[1][1]
        assert "global rank(s) [1]" in results[0][1] and ("CP group" if case.startswith("cp") else "SP group") in results[0][1]
    else:
        assert all("token_order" in r[1] or "rank(s)" in r[1] for r in results)


def test_one_source_reused_with_ever_new_keys_keeps_a_bounded_number_of_values():
    from gdn_layer import derived as rule
    src = torch.arange(10)
    for i in range(5 * rule.MAX_VALUES_PER_ENTRY):
        rule.derived(src, ("step", i), lambda: torch.zeros(1000))
    assert len(rule._CACHE[id(src)].values) == rule.MAX_VALUES_PER_ENTRY
    assert rule.derived(src, ("step", 5 * rule.MAX_VALUES_PER_ENTRY - 1), lambda: None) is not None  # recent: kept


def _state_from_an_inference_pass(rank, world, mode):
    """Prefill under inference_mode returns a state; a training forward continues from it."""
    gen = torch.Generator().manual_seed(8)
    x0, x1 = (torch.randn(1, CU[-1], SIZES[0], generator=gen) for _ in range(2))
    ref = _layer()
    with torch.inference_mode():
        _, st_ref = ref(x0, cu_seqlens=torch.tensor(CU), output_state=True)
    y_ref = ref(x1, cu_seqlens=torch.tensor(CU), state=st_ref)          # one process: works too
    y_ref.square().sum().backward()
    layer = GatedDeltaNet(*SIZES, **{f"{mode}_group": dist.group.WORLD})
    layer.load_state_dict(ref.state_dict())
    with torch.inference_mode():
        _, st = layer(shard_sequence(x0, dist.group.WORLD), cu_seqlens=torch.tensor(CU), output_state=True)
    y = layer(shard_sequence(x1, dist.group.WORLD), cu_seqlens=torch.tensor(CU), state=st)
    y.square().sum().backward()
    reduce_sp_grads(layer, dist.group.WORLD)
    return (rel_err(gather_sequence(y.detach(), dist.group.WORLD), y_ref.detach()),
            max(rel_err(p.grad, q.grad) for p, q in zip(layer.parameters(), ref.parameters())))


@pytest.mark.parametrize("mode", ["sp", "cp"])
def test_a_state_made_under_inference_mode_continues_in_training(pool2, mode):
    for err_y, err_grad in pool2.run(_state_from_an_inference_pass, mode, timeout=60):
        assert err_y < 1e-5 and err_grad < 1e-5


def _grad_mode_on_one_rank(rank, world):
    layer = GatedDeltaNet(*SIZES, sp_group=dist.group.WORLD)
    layer.load_state_dict(_layer().state_dict())
    x = torch.randn(1, CU[-1] // world, SIZES[0], generator=torch.Generator().manual_seed(rank))
    try:
        with torch.set_grad_enabled(rank == 0):
            layer(x, cu_seqlens=torch.tensor(CU))
    except ValueError as e:
        return str(e)
    return None


def test_grad_mode_differing_on_one_rank_raises_on_every_rank(pool2):
    for msg in pool2.run(_grad_mode_on_one_rank, timeout=60):
        assert msg is not None and "grad mode" in msg
