"""The version guard: outside the tested transformers range the swap warns once, and every swap checks a
cached prefill + decode step (and, where transformers records states for speculative decoding, a rollback)
against the transformers block, so a changed cache interface is refused, never decoded silently wrong.
A changed cache is simulated by breaking one piece of the adapter's cache handling (``gdn_layer/hf_cache.py``)."""
import copy
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

from gdn_layer import hf_cache  # noqa: E402
from gdn_layer.hf import HFGatedDeltaNet, from_hf, swap_gated_deltanet  # noqa: E402
from test_hf import qwen3_5  # noqa: E402
from test_hf_training import slow_decay  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return slow_decay(qwen3_5()).eval()


def counts_tokens():
    from transformers.cache_utils import LinearAttentionLayer
    return hasattr(LinearAttentionLayer, "get_seq_length")


def records_states():
    from transformers.cache_utils import Cache
    return hasattr(Cache, "get_recurrent_states_to_keep")


def swap_outcome(model):
    copy_ = copy.deepcopy(model)
    try:
        swap_gated_deltanet(copy_)
    except ValueError as e:
        assert not any(isinstance(m, HFGatedDeltaNet) for m in copy_.modules())   # nothing replaced
        return str(e)
    return ""


def test_a_cache_the_adapter_does_not_follow_is_refused_by_the_swap(model, monkeypatch):
    monkeypatch.setattr(hf_cache, "read", lambda *a, **k: None)           # the stored state never found
    assert "a prefill and a cached decode step" in swap_outcome(model)


def test_a_token_count_the_adapter_does_not_keep_is_refused_where_the_cache_counts(model, monkeypatch):
    monkeypatch.setattr(hf_cache, "_count", lambda *a, **k: None)
    msg = swap_outcome(model)
    assert ("the tokens the cache counts" in msg) if counts_tokens() else msg == ""


def test_a_rollback_the_adapter_does_not_follow_is_refused_where_the_cache_records(model, monkeypatch):
    monkeypatch.setattr(hf_cache, "states_to_keep", lambda *a, **k: 0)   # no states kept for crop()
    msg = swap_outcome(model)
    assert ("a speculative call rolled back by one token" in msg) if records_states() else msg == ""


def test_the_block_check_also_runs_for_from_hf_on_the_layers_own_state(model, monkeypatch):
    block = model.model.layers[0].linear_attn
    from_hf(block)                                                       # passes as it is
    from gdn_layer import GatedDeltaNet
    real = GatedDeltaNet.forward

    def drop_state(self, x, cu_seqlens=None, state=None, output_state=False, token_order=None):
        return real(self, x, cu_seqlens=cu_seqlens, state=None, output_state=output_state)
    monkeypatch.setattr(GatedDeltaNet, "forward", drop_state)            # a decode step ignoring the state
    with pytest.raises(ValueError, match="a prefill and a cached decode step"):
        from_hf(block)


@pytest.mark.parametrize("version, warns", [("5.30.0", True), ("5.23.1", True), ("5.25.0", False),
                                            ("5.24.0", False), ("5.25.1.dev0", False)])
def test_an_untested_transformers_version_warns_once_naming_the_tested_range(model, monkeypatch, version, warns):
    # the module the adapter imports (transformers swaps a lazy module into sys.modules under its name)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    monkeypatch.setattr(hf_cache, "_warned", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        swap_gated_deltanet(copy.deepcopy(model))
        from_hf(model.model.layers[0].linear_attn)
    ours = [w for w in caught if "tested with transformers" in str(w.message)]
    assert len(ours) == (1 if warns else 0), [str(w.message) for w in caught]
    if warns:
        assert hf_cache.TESTED_TEXT in str(ours[0].message) and version in str(ours[0].message)


def test_from_hf_on_a_converted_block_names_it(model):
    swapped = copy.deepcopy(model)
    swap_gated_deltanet(swapped)
    with pytest.raises(TypeError, match="already a gdn_layer HFGatedDeltaNet"):
        from_hf(swapped.model.layers[0].linear_attn)


@pytest.mark.parametrize("shape", [(2, 1, 1, 6), (2, 1, 6), (6,)])
def test_a_block_refuses_an_attention_mask_that_is_not_2d(model, shape):
    swapped = copy.deepcopy(model)
    swap_gated_deltanet(swapped)
    block = swapped.model.layers[0].linear_attn
    mask = torch.ones(shape)
    mask[..., :2] = 0
    with torch.no_grad(), pytest.raises(ValueError, match="must be a 2-D"):
        block(torch.randn(2, 6, 64), attention_mask=mask)
