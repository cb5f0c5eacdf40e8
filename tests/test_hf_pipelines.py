"""The transformers adapter in the pipelines people run: inference_mode and generate, position_ids
buffers refilled in place or reused across batch sizes, masks and caches that turn packing off (as in
transformers). The oracle is the unswapped transformers model on the same tiny config."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

from gdn_layer.hf import swap_gated_deltanet  # noqa: E402
from test_hf import COMMON, qwen3_5, qwen3_next, rel_err  # noqa: E402
from test_hf_training import linear_only_qwen3_5, slow_decay  # noqa: E402


def linear_only_qwen3_next():
    """Qwen3-Next hands the model's position_ids tensor itself to its layers (Qwen3.5 a new view of it
    per forward), so a refilled buffer reaches the blocks as the same tensor."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    cfg = dict(COMMON, num_hidden_layers=2, layer_types=["linear_attention"] * 2)
    return Qwen3NextForCausalLM(Qwen3NextConfig(**cfg, num_experts=4, num_experts_per_tok=2,
                                                moe_intermediate_size=32, shared_expert_intermediate_size=32))


def pair(make, seed=0):
    torch.manual_seed(seed)
    original = slow_decay(make()).eval()
    swapped = make().eval()
    swapped.load_state_dict(original.state_dict())
    assert swap_gated_deltanet(swapped) == 2
    return original, swapped


@pytest.fixture(scope="module")
def qwen35_pair():
    return pair(qwen3_5)


def packed_position_ids(lens=(3, 4)):
    return torch.cat([torch.arange(n) for n in lens])[None]


# --------------------------------------------------------------------------------------------------
# 1. torch.inference_mode


def test_inference_mode_forward_generate_and_packed_row_equal_no_grad(qwen35_pair):
    original, swapped = qwen35_pair
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want_logits = swapped(ids).logits
        want_tokens = original.generate(ids, **kw)
        want_packed = swapped(ids[:1], position_ids=packed_position_ids(), use_cache=False).logits
    with torch.inference_mode():
        got_logits = swapped(ids).logits
        got_tokens = swapped.generate(ids, **kw)
        pos = packed_position_ids()                  # an inference tensor: no version counter
        got_packed = swapped(ids[:1], position_ids=pos, use_cache=False).logits
        again = swapped(ids[:1], position_ids=pos, use_cache=False).logits
    assert torch.equal(got_tokens, want_tokens)
    assert rel_err(got_logits, want_logits) <= 1e-6
    assert rel_err(got_packed, want_packed) <= 1e-6 and torch.equal(again, got_packed)
    # the packed row really was read as two samples
    with torch.no_grad():
        alone = swapped(ids[:1, 3:], use_cache=False).logits
    assert rel_err(got_packed[:, 3:], alone) <= 1e-5


# --------------------------------------------------------------------------------------------------
# 2. boundaries of a position_ids buffer refilled in place, or reused for another batch size


def logits(model, ids, **kw):
    with torch.no_grad():
        return model(ids, use_cache=False, **kw).logits


@pytest.mark.parametrize("how", ["numpy_view", "data"])
def test_position_ids_refilled_in_place_without_a_version_bump_give_the_new_boundaries(how):
    _, swapped = pair(linear_only_qwen3_next)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    first, second = packed_position_ids((5, 7)), packed_position_ids((8, 4))
    staging = first.clone()
    logits(swapped, ids, position_ids=staging)
    version = staging._version
    if how == "numpy_view":
        np.copyto(staging.numpy(), second.numpy())
    else:
        staging.data.copy_(second)
    assert staging._version == version            # the refill is invisible to the version counter
    assert rel_err(logits(swapped, ids, position_ids=staging), logits(swapped, ids, position_ids=second)) == 0


@pytest.mark.parametrize("make", [linear_only_qwen3_next, linear_only_qwen3_5], ids=["qwen3_next", "qwen3_5"])
def test_one_position_ids_row_reused_for_batches_of_two_then_three(make):
    _, swapped = pair(make)
    pos = packed_position_ids((5, 7))              # [1, T], expanded to each batch
    ids = torch.randint(0, 128, (3, 12), generator=torch.Generator().manual_seed(3))
    logits(swapped, ids[:2], position_ids=pos)
    got = logits(swapped, ids, position_ids=pos)
    assert rel_err(got, logits(swapped, ids, position_ids=pos.expand(3, -1).clone())) == 0
    assert rel_err(got[2:, 5:], logits(swapped, ids[2:, 5:])) <= 1e-5


# --------------------------------------------------------------------------------------------------
# 3. packing read from positions only when transformers reads it: no attention_mask, no cache


@pytest.mark.parametrize("make", [qwen3_5, qwen3_next], ids=["qwen3_5", "qwen3_next"])
def test_custom_4d_attention_mask_with_a_cache_follows_the_mask_as_transformers_does(make):
    """transformers' test_custom_4d_attention_mask: three sequences sharing a prefix, packed as one row
    [0, 1, 2, 3, 3, 3] with a 4-D mask, continuing from a cache, against each sequence alone."""
    original, swapped = pair(make)
    ids = torch.randint(1, 128, (1, 6), generator=torch.Generator().manual_seed(4))
    pos = torch.tensor([[0, 1, 2, 3, 3, 3]])
    allowed = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                            [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 0, 1]], dtype=torch.bool)
    mask4d = torch.zeros(1, 1, 6, 6).masked_fill(~allowed, torch.finfo(torch.float32).min)
    outs = []
    for model in (original, swapped):
        with torch.no_grad():
            cache = transformers.DynamicCache(config=model.config)
            outs.append(model(ids, attention_mask=mask4d, position_ids=pos, cache=cache,
                              use_cache=True).logits)
    assert rel_err(outs[1], outs[0]) <= 1e-5


@pytest.mark.parametrize("extra", ["all_ones_2d_mask", "use_cache"])
def test_packed_positions_with_a_mask_or_a_cache_are_not_a_pack_as_in_transformers(qwen35_pair, extra):
    original, swapped = qwen35_pair
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    pos = packed_position_ids().expand(2, -1)
    kw = dict(attention_mask=torch.ones(2, 7, dtype=torch.long), use_cache=False) \
        if extra == "all_ones_2d_mask" else dict(use_cache=True)
    with torch.no_grad():
        want, got = original(ids, position_ids=pos, **kw).logits, swapped(ids, position_ids=pos, **kw).logits
        packed = swapped(ids, position_ids=pos, use_cache=False).logits     # no mask, no cache: a pack
    assert rel_err(got, want) <= 1e-5
    assert rel_err(packed, want) > 1e-3


@pytest.mark.parametrize("name", ["token_order", "state", "output_state", "state_slots", "checkpoint_slots",
                                  "checkpoint_every"])
def test_the_layers_own_arguments_are_refused_by_the_transformers_interface_never_dropped(qwen35_pair, name):
    from gdn_layer.hf import HFGatedDeltaNet
    _, swapped = qwen35_pair
    block = next(m for m in swapped.modules() if isinstance(m, HFGatedDeltaNet))
    x = torch.randn(1, 6, block.hidden_size)
    value = {"token_order": torch.arange(6).flip(0), "state": object(), "output_state": True,
             "state_slots": torch.tensor([0]), "checkpoint_slots": torch.zeros(1, 2, dtype=torch.long),
             "checkpoint_every": 64}[name]
    with pytest.raises(TypeError, match=name):
        block(x, **{name: value})


def test_the_layers_own_arguments_at_their_defaults_pass_and_warmup_runs_a_swapped_block(qwen35_pair):
    from gdn_layer.hf import HFGatedDeltaNet
    from gdn_layer.kernels import warmup
    _, swapped = qwen35_pair
    block = next(m for m in swapped.modules() if isinstance(m, HFGatedDeltaNet))
    x = torch.randn(1, 6, block.hidden_size)
    torch.testing.assert_close(block(x, token_order=None, state=None, output_state=False, state_slots=None,
                                     checkpoint_slots=None, checkpoint_every=1), block(x))
    calls = []
    block.register_forward_pre_hook(lambda m, args, kwargs: calls.append(m) and None, with_kwargs=True)
    assert warmup(block) >= 0           # runs through GatedDeltaNet.forward (states included)
    assert calls and all(m is block for m in calls)      # through the module's __call__: its hooks run
    assert "forward" not in block.__dict__                # the transformers forward is back
    torch.testing.assert_close(block(x), block(x, token_order=None, state=None, output_state=False))
