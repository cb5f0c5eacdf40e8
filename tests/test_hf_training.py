"""The transformers adapter inside a training setup: both checkpoint layouts, the model's flags kept by
the swap, packs described by position_ids / seq_idx, float64 caches."""
import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

from gdn_layer import GatedDeltaNet  # noqa: E402
from gdn_layer.hf import HFGatedDeltaNet, swap_gated_deltanet  # noqa: E402
from gdn_layer.hf_blocks import hf_sizes  # noqa: E402
from test_hf import COMMON, qwen3_5, qwen3_next, rel_err  # noqa: E402

LENS = (5, 7)   # two samples packed into one row


def linear_only_qwen3_5():
    """A tiny Qwen3.5 whose two layers are both linear attention: nothing else can mix the samples."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    cfg = dict(COMMON, num_hidden_layers=2, layer_types=["linear_attention"] * 2)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg))


def slow_decay(model):
    """Decays close to 1 so that a leak across a boundary is large."""
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__.endswith("GatedDeltaNet"):
                m.A_log.uniform_(-4, -1)
                m.conv1d.weight.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def swapped():
    torch.manual_seed(0)
    model = slow_decay(linear_only_qwen3_5()).eval()
    assert swap_gated_deltanet(model) == 2
    return model


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, use_cache=False, **kw).logits


# --------------------------------------------------------------------------------------------------
# packs described by position_ids or seq_idx


def packed_row(lens=LENS, seed=1):
    ids = torch.randint(0, 128, (1, sum(lens)), generator=torch.Generator().manual_seed(seed))
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    seq = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lens)])[None]
    return ids, pos, seq


@pytest.mark.parametrize("how", ["position_ids", "seq_idx", "cu_seq_lens_q"])
def test_each_packed_sample_equals_the_sample_run_alone(swapped, how):
    ids, pos, seq = packed_row()
    kw = {"position_ids": dict(position_ids=pos), "seq_idx": dict(seq_idx=seq),
          "cu_seq_lens_q": dict(cu_seq_lens_q=torch.tensor([0, 5, 12]))}[how]
    packed = logits(swapped, ids, **kw)
    assert rel_err(packed[:, :5], logits(swapped, ids[:, :5])) <= 1e-5
    assert rel_err(packed[:, 5:], logits(swapped, ids[:, 5:])) <= 1e-5


def test_packs_in_several_rows_and_unpacked_positions_keep_each_row_one_sequence(swapped):
    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(2))
    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(7)]),
                       torch.cat([torch.arange(8), torch.arange(4)]),
                       torch.arange(12) + 3])                     # ordinary positions: one sequence
    packed = logits(swapped, ids, position_ids=pos)
    for row, spans in enumerate([[(0, 5), (5, 12)], [(0, 8), (8, 12)], [(0, 12)]]):
        for a, b in spans:
            assert rel_err(packed[row, a:b], logits(swapped, ids[row:row + 1, a:b])[0]) <= 1e-5, (row, a)
    # rows of ordinary positions are exactly the plain batch
    plain = torch.arange(12).expand(3, 12)
    assert torch.equal(logits(swapped, ids, position_ids=plain), logits(swapped, ids))


def test_qwen3_next_with_its_attention_layer_keeps_position_id_packs_apart():
    torch.manual_seed(0)
    model = slow_decay(qwen3_next()).eval()      # linear, full attention, linear
    swap_gated_deltanet(model)
    ids, pos, _ = packed_row(seed=5)
    packed = logits(model, ids, position_ids=pos)
    assert rel_err(packed[:, 5:], logits(model, ids[:, 5:])) <= 1e-5


def test_packed_gradients_under_gradient_checkpointing_equal_the_per_sample_gradients():
    """The recomputation in backward sees the same boundaries as the forward."""
    torch.manual_seed(0)
    model = slow_decay(linear_only_qwen3_5()).train()
    swap_gated_deltanet(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids, pos, _ = packed_row(seed=6)
    cot = torch.randn(1, 12, 128, generator=torch.Generator().manual_seed(7))
    (model(ids, position_ids=pos, use_cache=False).logits * cot).sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for a, b in ((0, 5), (5, 12)):
        (model(ids[:, a:b], use_cache=False).logits * cot[:, a:b]).sum().backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert rel_err(packed[n], p.grad) <= 1e-5, n


def test_position_ids_are_read_once_per_forward_not_once_per_layer(swapped, monkeypatch):
    import gdn_layer.hf_packing as packing
    calls = []
    real = packing._row_starts
    monkeypatch.setattr(packing, "_row_starts", lambda *a: calls.append(1) or real(*a))
    ids, pos, _ = packed_row(seed=3)
    logits(swapped, ids, position_ids=pos)
    assert len(calls) == 1   # two GatedDeltaNet layers, one host read
    logits(swapped, ids, position_ids=pos.clone())
    assert len(calls) == 2


def test_every_layer_of_a_forward_gets_the_same_cu_seqlens(swapped, monkeypatch):
    # the kernels' per-cu_seqlens caches (kernels/cu_cache.py; fla's and FlashQLA's, by identity) only
    # hit across layers when the layers are handed one tensor, not an equal new one each
    seen = []
    real = GatedDeltaNet.forward

    def spy(self, x, cu_seqlens=None, **kw):
        seen.append(cu_seqlens)
        return real(self, x, cu_seqlens=cu_seqlens, **kw)
    monkeypatch.setattr(GatedDeltaNet, "forward", spy)
    ids, pos, _ = packed_row(seed=4)
    logits(swapped, ids, position_ids=pos)
    assert len(seen) == 2 and seen[0] is seen[1] and seen[0].tolist() == [0, 5, 12]
    logits(swapped, ids, position_ids=pos.clone())       # a new forward: new boundaries, same values
    assert len(seen) == 4 and seen[2] is seen[3] and seen[2].tolist() == [0, 5, 12]


def test_packed_seq_idx_with_a_cache_raise_instead_of_leaking():
    """seq_idx states a pack explicitly; a cache holds one state per row. (Restarting position_ids with
    a cache are not a pack, as in transformers: tests/test_hf_pipelines.py.)"""
    torch.manual_seed(0)
    model = slow_decay(qwen3_5()).eval()
    swap_gated_deltanet(model)
    ids, _, seq = packed_row()
    with pytest.raises(ValueError, match="use_cache=False"):
        model(ids, seq_idx=seq, use_cache=True)


def test_left_padded_generate_is_not_mistaken_for_a_pack():
    """transformers gives padding positions that 'restart'; between real tokens nothing restarts."""
    torch.manual_seed(0)
    original = slow_decay(qwen3_5()).eval()
    swapped_model = qwen3_5().eval()
    swapped_model.load_state_dict(original.state_dict())
    swap_gated_deltanet(swapped_model)
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0                                              # row 0 is left-padded by 3
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(swapped_model.generate(ids, **kw), original.generate(ids, **kw))


# --------------------------------------------------------------------------------------------------
# the swap keeps the model's flags


@pytest.mark.parametrize("make", [qwen3_5, qwen3_next], ids=["qwen3_5", "qwen3_next"])
def test_swap_keeps_requires_grad_per_parameter_and_train_eval_mode(make):
    torch.manual_seed(0)
    model = make()
    model.requires_grad_(False)
    model.model.layers[0].linear_attn.A_log.requires_grad_(True)
    model.eval()
    swap_gated_deltanet(model)
    blocks = [model.model.layers[0].linear_attn, model.model.layers[2].linear_attn]
    assert all(isinstance(b, HFGatedDeltaNet) for b in blocks)
    assert [n for n, p in blocks[0].named_parameters() if p.requires_grad] == ["A_log"]
    assert not any(p.requires_grad for p in blocks[1].parameters())
    assert not any(m.training for b in blocks for m in b.modules())

    torch.manual_seed(0)
    trained = make().train()
    swap_gated_deltanet(trained)
    assert all(m.training for m in trained.model.layers[0].linear_attn.modules())
    assert all(p.requires_grad for p in trained.parameters())


# --------------------------------------------------------------------------------------------------
# both checkpoint layouts, from real transformers blocks


@pytest.mark.parametrize("make, other", [(qwen3_next, "split"), (qwen3_5, "fused")],
                         ids=["qwen3_next_into_split", "qwen3_5_into_fused"])
def test_a_transformers_checkpoint_loads_into_the_other_layout(make, other):
    torch.manual_seed(5)
    block = slow_decay(make()).model.layers[0].linear_attn
    sizes = hf_sizes(block)
    assert sizes.pop("projection_layout") != other and sizes.pop("output_gate") == "silu"
    layer = GatedDeltaNet(**sizes, projection_layout=other)
    layer.load_state_dict(block.state_dict())
    x = torch.randn(1, 40, COMMON["hidden_size"])
    with torch.no_grad():
        assert rel_err(layer(x), block(x)) <= 1e-5


# --------------------------------------------------------------------------------------------------
# float64 models keep float64 caches


def test_float64_model_decodes_from_its_cache_without_rounding_the_state_to_fp32():
    torch.manual_seed(0)
    model = slow_decay(qwen3_5()).double().eval()
    swap_gated_deltanet(model)
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        out = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], cache=out.past_key_values, use_cache=True).logits[:, -1]
    assert rel_err(step, full) <= 1e-12
