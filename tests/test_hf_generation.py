"""Swapped models decode from transformers' cache exactly as the unswapped model does, on every path
``generate`` takes: cached continuation with a mask, multi-turn chat with a passed cache and left padding,
beam search, assisted generation and prompt-lookup decoding (5.25 rolls the recurrent state back after
rejected drafts; 5.24 refuses both for these models, swapped or not). The oracle is the unswapped model."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

from gdn_layer.hf import swap_gated_deltanet  # noqa: E402
from test_hf import qwen3_5, qwen3_next, rel_err  # noqa: E402
from test_hf_training import slow_decay  # noqa: E402

GREEDY = dict(do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)


@pytest.fixture(scope="module", params=[qwen3_5, qwen3_next], ids=["qwen3_5", "qwen3_next"])
def pair(request):
    torch.manual_seed(0)
    original = slow_decay(request.param()).eval()
    swapped = copy.deepcopy(original)
    assert swap_gated_deltanet(swapped) == 2
    return original, swapped


def outcome(model, call):
    """``call(model)``'s result, or the type of what it raised (both models must do the same)."""
    try:
        with torch.no_grad():
            return call(model)
    except (ValueError, TypeError, NotImplementedError, RuntimeError) as e:
        return type(e)


def assert_same_generation(original, swapped, call):
    want, got = outcome(original, call), outcome(swapped, call)
    if isinstance(want, type):
        assert got is want, (want, got)
        return
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    assert len(got.logits) == len(want.logits)
    for a, b in zip(got.logits, want.logits):
        assert rel_err(a, b) <= 1e-5


def left_padded(batch=2, length=9, pads=(3,), seed=1):
    ids = torch.randint(2, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


def test_cached_chunk_after_a_left_padded_prefill_follows_the_mask(pair):
    original, swapped = pair
    ids, mask = left_padded(batch=1, length=9, pads=(2,))

    def chunked(model):
        out = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        return model(ids[:, 6:], attention_mask=mask, cache=out.past_key_values, use_cache=True).logits

    with torch.no_grad():
        assert rel_err(chunked(swapped), chunked(original)) <= 1e-5
        assert rel_err(chunked(swapped), swapped(ids, attention_mask=mask).logits[:, 6:]) <= 1e-5


def test_multi_turn_generate_with_the_passed_cache_equals_the_original(pair):
    original, swapped = pair
    ids, mask = left_padded()
    more = torch.randint(2, 128, (2, 4), generator=torch.Generator().manual_seed(2))

    def two_turns(model):
        first = model.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY)
        turn2 = torch.cat([first.sequences, more], 1)
        mask2 = torch.cat([mask, torch.ones(2, turn2.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        return model.generate(turn2, attention_mask=mask2, cache=first.past_key_values, max_new_tokens=6, **GREEDY)

    assert_same_generation(original, swapped, two_turns)
    # and the cached second turn gives the tokens of recomputing the whole history
    with torch.no_grad():
        cached = two_turns(swapped).sequences
        first = swapped.generate(ids, attention_mask=mask, max_new_tokens=5, **GREEDY).sequences
        turn2 = torch.cat([first, more], 1)
        mask2 = torch.cat([mask, torch.ones(2, turn2.shape[1] - mask.shape[1], dtype=mask.dtype)], 1)
        fresh = swapped.generate(turn2, attention_mask=mask2, max_new_tokens=6, **GREEDY).sequences
    assert torch.equal(cached, fresh)


def test_beam_search_equals_the_original(pair):
    original, swapped = pair
    ids, mask = left_padded()
    assert_same_generation(original, swapped, lambda m: m.generate(
        ids, attention_mask=mask, max_new_tokens=6, num_beams=3, num_return_sequences=2, early_stopping=False,
        **GREEDY))


def drafting_assistant(original, noise=0.02, seed=5):
    """A draft model whose tokens the target sometimes accepts and sometimes rejects: the target's weights,
    perturbed (unswapped; the swapped target must roll back after each rejection)."""
    assistant = copy.deepcopy(original)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in assistant.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise)
    return assistant


@pytest.mark.parametrize("swap_assistant", [False, True], ids=["assistant", "swapped_assistant"])
def test_assisted_generation_rolls_back_rejected_drafts(pair, swap_assistant):
    original, swapped = pair
    ids = torch.randint(2, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    assistant = drafting_assistant(original)
    if swap_assistant:                       # its cache records states from its first call on
        assistant = copy.deepcopy(assistant)
        swap_gated_deltanet(assistant)
    call = lambda m: m.generate(ids, assistant_model=assistant, max_new_tokens=12, num_assistant_tokens=3,  # noqa: E731
                                **GREEDY)
    assert_same_generation(original, swapped, call)
    result = outcome(swapped, call)
    if not isinstance(result, type):         # transformers >= 5.25: assisted greedy equals plain greedy
        with torch.no_grad():
            plain = swapped.generate(ids, max_new_tokens=12, **GREEDY).sequences
        assert torch.equal(result.sequences, plain)


def test_prompt_lookup_decoding_rolls_back_rejected_drafts_to_plain_greedy(pair):
    """transformers 5.25's own block rolls back one state too far when every draft of a call is rejected
    (``hf_cache.states_to_keep``), so here the oracle is the unswapped model's plain greedy decoding."""
    original, swapped = pair
    phrase = torch.randint(2, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    ids = torch.cat([phrase, phrase[:, :3], phrase, phrase[:, :2]], 1)   # repeats: the lookup proposes drafts
    lookup = lambda m: m.generate(ids, prompt_lookup_num_tokens=3, max_new_tokens=10, **GREEDY)  # noqa: E731
    want, got = outcome(original, lookup), outcome(swapped, lookup)
    if isinstance(want, type):               # transformers 5.24 refuses it for these models, swapped or not
        assert got is want
        return
    plain = outcome(original, lambda m: m.generate(ids, max_new_tokens=10, **GREEDY))
    assert torch.equal(got.sequences, plain.sequences), (got.sequences, plain.sequences)
    for a, b in zip(got.logits, plain.logits, strict=True):
        assert rel_err(a, b) <= 1e-5


def rollback_logits(model, reference, keep, length, back, ids):
    """Prefill 6 tokens, record with ``keep``, one call of ``length`` tokens, ``crop(-back)``, then the next
    token's logits from the cache, and the same logits recomputed by ``reference`` without a cache."""
    with torch.no_grad():
        cache = model(ids[:, :6], use_cache=True).past_key_values
        cache.activate_past_recording(recurrent_states_to_keep=keep)
        model(ids[:, 6:6 + length], cache=cache, use_cache=True)
        cache.crop(-back)
        at = 6 + length - back
        got = model(ids[:, at:at + 1], cache=cache, use_cache=True).logits[:, -1]
        return got, reference(ids[:, :at + 1]).logits[:, -1]


@pytest.mark.parametrize("keep, length, back", [(1, 4, 2), (2, 5, 3), (None, 3, 1), (1, 5, 5), (3, 4, 4)])
def test_a_rollback_within_the_recorded_states_restores_the_state_at_that_token(pair, keep, length, back):
    from transformers.cache_utils import Cache
    if not hasattr(Cache, "get_recurrent_states_to_keep"):
        pytest.skip("transformers < 5.25 records no recurrent states (tests/test_hf*.py also run under 5.25)")
    original, swapped = pair
    ids = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    got, want = rollback_logits(swapped, original, keep, length, back, ids)
    assert rel_err(got, want) <= 1e-5


def test_a_rollback_past_the_recorded_states_raises_instead_of_decoding_from_a_wrong_state(pair):
    from transformers.cache_utils import Cache
    if not hasattr(Cache, "get_recurrent_states_to_keep"):
        pytest.skip("transformers < 5.25 records no recurrent states (tests/test_hf*.py also run under 5.25)")
    _, swapped = pair
    ids = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="rolled back .* further than the states recorded"):
        rollback_logits(swapped, swapped, 1, 5, 3, ids)


def test_decode_steps_run_the_pools_fused_kernels_and_equal_the_original(pair, monkeypatch):
    """A cached one-token step runs the state pool's decode step on the rows read from the cache (on CUDA its
    fused kernels; here the same kernels under Triton's interpreter): greedy tokens and logits as the
    unswapped model's, over a left-padded batch."""
    from gdn_layer import pool
    from gdn_layer.kernels.triton import decode
    calls = []
    real = decode.decode_step
    monkeypatch.setattr(pool, "FUSED_DECODE_ON_CPU", True)
    monkeypatch.setattr(decode, "decode_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    original, swapped = pair
    ids, mask = left_padded()
    assert_same_generation(original, swapped, lambda m: m.generate(ids, attention_mask=mask, max_new_tokens=4,
                                                                     **GREEDY))
    assert len(calls) == 2 * 3                 # 2 swapped blocks x the 3 steps after the prefill
