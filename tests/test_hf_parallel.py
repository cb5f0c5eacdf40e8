"""The transformers adapter under context / sequence parallelism (2 gloo ranks): boundaries are never
read from a rank's slice of position_ids / seq_idx (refused on every rank, like under SP), a 2-D
attention_mask is taken as this rank's slice (a global one is refused naming the convention), and a
position_ids buffer received in place by a collective gives the new boundaries."""
import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

from test_hf import rel_err  # noqa: E402


def _model(seed=0):
    from test_hf_training import linear_only_qwen3_5, slow_decay
    torch.manual_seed(seed)
    return slow_decay(linear_only_qwen3_5()).eval()


def _cp_slices_refused(rank, world):
    from gdn_layer.hf import swap_gated_deltanet
    model = _model()
    swap_gated_deltanet(model, cp_group=dist.group.WORLD)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(6), torch.arange(6)])[None]      # boundary at the rank edge
    seq = torch.cat([torch.zeros(6), torch.ones(6)]).long()[None]
    local = slice(rank * 6, (rank + 1) * 6)
    msgs = []
    for kw in (dict(position_ids=pos[:, local]), dict(seq_idx=seq[:, local])):
        try:
            with torch.no_grad():
                model(ids[:, local], use_cache=False, **kw)
            msgs.append("")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_cp_refuses_boundaries_from_each_ranks_slice_on_every_rank(pool2):
    for msgs in pool2.run(_cp_slices_refused, timeout=120):
        assert all("cu_seq_lens_q" in m and "context parallelism" in m for m in msgs), msgs


def _sp_mask(rank, world):
    from gdn_layer.hf import swap_gated_deltanet
    original = _model()
    model = _model()
    swap_gated_deltanet(model, sp_group=dist.group.WORLD)
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0                                                  # left padding, across rank 0's slice
    local = slice(rank * 4, (rank + 1) * 4)
    try:
        with torch.no_grad():
            model(ids[:, local], attention_mask=mask, use_cache=False)
        msg = ""
    except ValueError as e:
        msg = str(e)
    with torch.no_grad():
        got = model(ids[:, local], attention_mask=mask[:, local], use_cache=False).logits
        parts = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(parts, got.contiguous())
        want = original(ids, attention_mask=mask, use_cache=False).logits
    return msg, rel_err(torch.cat(parts, 1), want)


def test_sp_takes_a_2d_attention_mask_as_the_ranks_slice_and_refuses_the_global_one(pool2):
    for msg, err in pool2.run(_sp_mask, timeout=120):
        assert "this rank's slice" in msg and err <= 1e-5, (msg, err)


def _broadcast_refill(rank, world):
    from test_hf_pipelines import linear_only_qwen3_next, pair
    _, model = pair(linear_only_qwen3_next)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3))
    first = torch.cat([torch.arange(5), torch.arange(7)])[None]
    second = torch.cat([torch.arange(8), torch.arange(4)])[None]
    staging = first.clone() if rank == 1 else second.clone()
    with torch.no_grad():
        model(ids, position_ids=staging, use_cache=False)
        version = staging._version
        dist.broadcast(staging, src=0)              # rank 1's buffer now holds `second`, version unchanged
        got = model(ids, position_ids=staging, use_cache=False).logits
        want = model(ids, position_ids=second.clone(), use_cache=False).logits
    return staging._version == version, rel_err(got, want)


def test_position_ids_received_in_place_by_a_gloo_broadcast_give_the_new_boundaries(pool2):
    for unchanged_version, err in pool2.run(_broadcast_refill, timeout=120):
        assert unchanged_version and err == 0, (unchanged_version, err)


def _olmo_under_sp(rank, world):
    from gdn_layer.hf import from_hf
    from gdn_layer.parallel import gather_sequence, shard_sequence
    from test_hf_families import olmo_hybrid
    from test_hf_training import slow_decay
    torch.manual_seed(0)
    block = slow_decay(olmo_hybrid()).model.layers[0].linear_attn        # allow_neg_eigval on (default)
    group = dist.group.WORLD
    layer = from_hf(block, sp_group=group)
    x = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = gather_sequence(layer(shard_sequence(x, group), cu_seq_lens_q=torch.tensor([0, 7, 16])), group)
        want = torch.cat([block(x[:, :7]), block(x[:, 7:])], 1)
    return layer.sp_size, rel_err(got, want)


def test_olmo_hybrid_block_under_sp_matches_the_block_per_sequence(pool2):
    for sp, err in pool2.run(_olmo_under_sp, timeout=120):
        assert sp == 2 and err <= 1e-5, (sp, err)


def _block_with_masks(rank, world):
    from gdn_layer.hf import from_hf
    from test_hf_families import olmo_hybrid
    from test_hf_training import slow_decay
    torch.manual_seed(0)
    block = slow_decay(olmo_hybrid()).model.layers[0].linear_attn
    layer = from_hf(block, sp_group=dist.group.WORLD)
    x = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0                                                  # left padding, across rank 0's slice
    local = slice(rank * 4, (rank + 1) * 4)
    try:
        with torch.no_grad():
            layer(x[:, local], attention_mask=mask)
        msg = ""
    except ValueError as e:
        msg = str(e)
    with torch.no_grad():
        got = layer(x[:, local], attention_mask=mask[:, local])
        parts = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(parts, got.contiguous())
        want = block(x, attention_mask=mask)
    return msg, rel_err(torch.cat(parts, 1), want)


def test_a_block_called_directly_under_sp_refuses_the_global_mask_and_takes_the_ranks_slice(pool2):
    for msg, err in pool2.run(_block_with_masks, timeout=120):
        assert "this rank's slice" in msg and "attention_mask [B, 8]" in msg and err <= 1e-5, (msg, err)
