"""Every transformers 5.24 / 5.25 family with a GatedDeltaNet block converted exactly (logits, greedy
tokens decoded from the cache with their logits, and gradients of the unswapped model); a block
computing something the conversion does not is caught before anything is replaced. Plus the import
direction layer -> hf_blocks <- hf."""
import ast
import copy
import pathlib
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

from gdn_layer.hf import HFGatedDeltaNet, swap_gated_deltanet  # noqa: E402
from test_hf import COMMON, qwen3_5, qwen3_next, rel_err  # noqa: E402
from test_hf_training import slow_decay  # noqa: E402
from test_hf_weights import lara_mini  # noqa: E402

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def qwen4_exp(gate=None):
    cfg = transformers.Qwen4ExpTextConfig(
        **COMMON, **MOE, output_gate_type=gate, indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
        indexer_budget=4, indexer_compress_ratio=2, ngram_vocab_size_base=1000, hc_lowrank=8, split_ngram_parts=4)
    return transformers.Qwen4ExpForCausalLM(cfg)


def qwen3_5_moe():
    return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**COMMON, **MOE))


def olmo_hybrid():
    cfg = dict(COMMON, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return transformers.OlmoHybridForCausalLM(transformers.OlmoHybridConfig(**cfg))


def swapped_pair(make):
    torch.manual_seed(0)
    original = slow_decay(make()).eval()
    swapped = copy.deepcopy(original)
    assert swap_gated_deltanet(swapped) == 2
    return original, swapped


FAMILIES = {"qwen3_next": qwen3_next, "qwen3_5": qwen3_5, "qwen3_5_moe": qwen3_5_moe, "lara_mini": lara_mini,
            "qwen4_exp": qwen4_exp, "qwen4_exp_sigmoid_gate": lambda: qwen4_exp("sigmoid"),
            "olmo_hybrid": olmo_hybrid}


@pytest.mark.parametrize("make", FAMILIES.values(), ids=FAMILIES.keys())
def test_family_converts_exactly_logits_cached_greedy_tokens_and_gradients(make):
    original, swapped = swapped_pair(make)
    assert sum(isinstance(m, HFGatedDeltaNet) for m in swapped.modules()) == 2
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        assert rel_err(swapped(ids).logits, original(ids).logits) <= 1e-5
        got, want = swapped.generate(ids, **kw), original.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        assert rel_err(a, b) <= 1e-5
    for model in (original, swapped):
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
    grads = dict(original.named_parameters())
    compared = 0
    for name, p in swapped.named_parameters():
        if grads[name].grad is not None:
            assert rel_err(p.grad, grads[name].grad) <= 1e-5, name
            compared += ".linear_attn." in name
    # every GatedDeltaNet parameter of both blocks got its gradient
    assert compared == sum(len(list(m.parameters())) for m in swapped.modules() if isinstance(m, HFGatedDeltaNet))


def test_a_block_computing_something_else_is_refused_before_anything_is_replaced():
    torch.manual_seed(0)
    model = qwen3_5().eval()
    norm = model.model.layers[2].linear_attn.norm         # a gate the adapter does not know, not announced
    norm.forward = lambda x, z: norm.weight * x * torch.tanh(z)
    with pytest.raises(ValueError, match="qwen3_5 block Qwen3_5GatedDeltaNet .*relative difference"):
        swap_gated_deltanet(model)
    assert not any(isinstance(m, HFGatedDeltaNet) for m in model.modules())   # block 0 matched: kept too


@pytest.mark.parametrize("allow_neg_eigval", [True, False])
def test_olmo_hybrid_converts_exactly_with_its_parameter_names(allow_neg_eigval):
    """Separate q/k/v/a/b/g projections, o_norm with its fixed eps 1e-5, o_proj, beta doubled when
    allow_neg_eigval (the default)."""
    def make():
        model = olmo_hybrid()
        for m in model.modules():
            if hasattr(m, "allow_neg_eigval"):
                m.allow_neg_eigval = allow_neg_eigval
        return model
    original, swapped = swapped_pair(make)
    block = swapped.model.layers[0].linear_attn
    assert type(block).__name__ == "HFOlmoHybridGatedDeltaNet" and block.allow_neg_eigval == allow_neg_eigval
    assert block.norm.eps == 1e-5 and sorted(original.state_dict()) == sorted(swapped.state_dict())
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert rel_err(swapped(ids).logits, original(ids).logits) <= 1e-5
        assert torch.equal(swapped.generate(ids, **kw), original.generate(ids, **kw))


def test_olmo_hybrid_block_converts_through_the_adapter_not_into_a_plain_layer():
    from gdn_layer import GatedDeltaNet
    from gdn_layer.hf import from_hf
    torch.manual_seed(0)
    block = slow_decay(olmo_hybrid()).model.layers[0].linear_attn
    with pytest.raises(TypeError, match="HFOlmoHybridGatedDeltaNet"):
        GatedDeltaNet.from_hf(block)
    layer = from_hf(block)
    x = torch.randn(1, 13, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(layer(x), block(x)) <= 1e-5


def test_a_config_with_linear_attention_but_no_block_found_warns():
    torch.manual_seed(0)
    model = qwen3_5()
    for i in (0, 2):                                       # a block of another name: nothing to swap
        model.model.layers[i].linear_attn = nn.Identity()
    with pytest.warns(UserWarning, match="linear_attention"):
        assert swap_gated_deltanet(model) == 0
    swapped = qwen3_5()
    swap_gated_deltanet(swapped)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert swap_gated_deltanet(swapped) == 0            # already swapped: nothing left, no warning


def test_layer_never_imports_the_adapter():
    """One direction: layer -> hf_blocks <- hf (GatedDeltaNet.from_hf builds through hf_blocks)."""
    root = pathlib.Path(__file__).resolve().parents[1] / "gdn_layer"

    def imported(name):
        tree = ast.parse((root / f"{name}.py").read_text())
        return {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported("layer") if m in ("gdn_layer.hf", "gdn_layer.hf_packing")}
    assert not {m for m in imported("hf_blocks") if m.startswith("gdn_layer")}
