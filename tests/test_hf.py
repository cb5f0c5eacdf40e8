"""transformers adapter: tiny Qwen3-Next / Qwen3.5 models with random weights, built from local configs."""
import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

from gdn_layer import GatedDeltaNet  # noqa: E402
from gdn_layer.hf import HFGatedDeltaNet, swap_gated_deltanet  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              layer_types=["linear_attention", "full_attention", "linear_attention"])


def qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    cfg = Qwen3NextConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32)
    return Qwen3NextForCausalLM(cfg)


def qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**COMMON))


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.fixture(params=[qwen3_next, qwen3_5], ids=["qwen3_next", "qwen3_5"])
def model_pair(request):
    torch.manual_seed(0)
    original = request.param().eval()
    with torch.no_grad():  # slower decays than the default init, so the recurrence carries information
        for m in original.modules():
            if type(m).__name__.endswith("GatedDeltaNet"):
                m.A_log.uniform_(-4, -1)
                m.conv1d.weight.normal_(0, 0.3)
    swapped = request.param().eval()
    swapped.load_state_dict(original.state_dict())
    assert swap_gated_deltanet(swapped) == 2
    return original, swapped


def test_swapped_model_logits_equal_the_original(model_pair):
    original, swapped = model_pair
    assert sum(isinstance(m, HFGatedDeltaNet) for m in swapped.modules()) == 2
    ids = torch.randint(0, 128, (2, 70))
    with torch.no_grad():
        a, b = original(ids).logits, swapped(ids).logits
    assert rel_err(b, a) <= 1e-5


def test_generate_with_cache_gives_the_same_tokens(model_pair):
    original, swapped = model_pair
    ids = torch.randint(0, 128, (2, 9))
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        a = original.generate(ids, **kw)
        b = swapped.generate(ids, **kw)
    assert torch.equal(a, b)
    # and the cached decode really used the cache: logits of the last step equal a full forward
    with torch.no_grad():
        full = swapped(b[:, :-1]).logits[:, -1]
        out = swapped(b[:, :-2], use_cache=True)
        step = swapped(b[:, -2:-1], cache=out.past_key_values, use_cache=True).logits[:, -1]
    assert rel_err(step, full) <= 1e-5


def test_state_dict_names_are_unchanged_by_the_swap(model_pair):
    original, swapped = model_pair
    assert sorted(original.state_dict()) == sorted(swapped.state_dict())


def test_from_hf_copies_weights_and_matches_the_block():
    torch.manual_seed(1)
    model = qwen3_5()
    block = model.model.layers[0].linear_attn
    layer = GatedDeltaNet.from_hf(block)
    assert type(layer) is GatedDeltaNet and layer.projection_layout == "split"
    x = torch.randn(1, 33, 64)
    with torch.no_grad():
        assert rel_err(layer(x), block(x)) <= 1e-5
    with pytest.raises(TypeError, match="hf_module"):
        GatedDeltaNet.from_hf(torch.nn.Linear(3, 3))
