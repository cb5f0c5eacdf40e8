"""The transformers adapter keeps what transformers keeps: fp32 parameters of a bf16 model (exact, through
from_hf, the swap, state_dict and save_pretrained) and the original block's initialisation (init_weights
after a meta-device build). The oracle is the unswapped transformers model."""
import copy
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

from gdn_layer import GatedDeltaNet  # noqa: E402
from gdn_layer.hf import HFGatedDeltaNet, swap_gated_deltanet  # noqa: E402
from test_hf import COMMON, qwen3_5, qwen3_next, rel_err  # noqa: E402
from test_hf_training import slow_decay  # noqa: E402


def blocks(model):
    return [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]


# --------------------------------------------------------------------------------------------------
# 5. fp32 A_log and norm.weight in a bf16 model


def bf16_with_fp32_gate(make):
    """A bf16 model whose A_log and gated-norm weight are fp32 (as transformers keeps them), holding
    values bf16 cannot represent."""
    torch.manual_seed(0)
    model = slow_decay(make()).to(torch.bfloat16).eval()
    g = torch.Generator().manual_seed(1)
    for b in blocks(model):
        b.A_log.data = torch.empty(b.A_log.shape).uniform_(-4, -1, generator=g)
        b.norm.weight.data = 1 + 0.1 * torch.randn(b.norm.weight.shape, generator=g)
    return model


@pytest.mark.parametrize("make", [qwen3_5, qwen3_next], ids=["qwen3_5", "qwen3_next"])
def test_fp32_parameters_of_a_bf16_model_stay_fp32_and_exact(make, tmp_path):
    from safetensors.torch import load_file
    original = bf16_with_fp32_gate(make)
    assert original.model.layers[0].linear_attn.A_log.dtype == torch.float32
    layer = GatedDeltaNet.from_hf(original.model.layers[0].linear_attn)
    want = original.model.layers[0].linear_attn.state_dict()
    got = layer.state_dict()
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    assert all(torch.equal(got[k], want[k]) for k in want)

    swapped = bf16_with_fp32_gate(make)
    assert swap_gated_deltanet(swapped) == 2
    want, got = original.state_dict(), swapped.state_dict()
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    assert all(torch.equal(got[k], want[k]) for k in want)
    swapped.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    for k in ("model.layers.0.linear_attn.A_log", "model.layers.2.linear_attn.norm.weight"):
        assert saved[k].dtype == torch.float32 and torch.equal(saved[k], want[k]), k
    ids = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert rel_err(swapped(ids).logits, original(ids).logits) <= 3e-2     # bf16 rounding, 3 layers


# --------------------------------------------------------------------------------------------------
# 4. init_weights after a meta-device build and to_empty


def lara_mini():
    from transformers import LaraMiniConfig, LaraMiniForCausalLM
    cfg = LaraMiniConfig(**{k: v for k, v in COMMON.items()}, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=32)
    return LaraMiniForCausalLM(cfg)


@pytest.mark.parametrize("make, low", [(qwen3_5, 0.01), (lara_mini, 1.0)], ids=["qwen3_5", "lara_mini"])
def test_init_weights_after_meta_build_swap_and_to_empty_gives_the_original_distributions(make, low):
    with torch.device("meta"):
        model = make()
    assert swap_gated_deltanet(model) == 2
    model.to_empty(device="cpu")
    for p in model.parameters():           # what to_empty leaves: anything, here huge values
        p.data.fill_(3e24)
    if make is qwen3_5:              # the hook survives pickling and deep copies (EMA / reference models)
        model = pickle.loads(pickle.dumps(copy.deepcopy(model)))
    model.init_weights()
    swapped = [m for m in model.modules() if isinstance(m, HFGatedDeltaNet)]
    assert len(swapped) == 2
    for b in swapped:
        assert torch.equal(b.dt_bias, torch.ones_like(b.dt_bias))
        A = b.A_log.exp()
        assert bool(((A >= low * (1 - 1e-6)) & (A <= 16 * (1 + 1e-6))).all()), A
        assert len(set(b.A_log.tolist())) == b.num_v_heads        # drawn, not filled
        assert torch.equal(b.norm.weight, torch.ones_like(b.norm.weight))
        for lin in (b.in_proj_qkv, b.out_proj, b.conv1d):
            assert 0.01 < float(lin.weight.detach().std()) < 0.04
    assert all(bool(p.abs().max() < 1e3) for p in model.parameters())


def test_init_weights_reaches_olmo_hybrid_blocks_with_its_own_distributions():
    """OLMo-Hybrid draws A = U(linear_a_log_min, linear_a_log_max) = U(0, 16) and dt_bias as the
    inverse softplus of dt = exp(U(log 1e-3, log 0.1))."""
    from test_hf_families import olmo_hybrid
    with torch.device("meta"):
        model = olmo_hybrid()
    assert swap_gated_deltanet(model) == 2
    model.to_empty(device="cpu")
    for p in model.parameters():
        p.data.fill_(3e24)
    model.init_weights()
    for b in (model.model.layers[0].linear_attn, model.model.layers[2].linear_attn):
        assert type(b).__name__ == "HFOlmoHybridGatedDeltaNet"
        A, dt = b.A_log.exp(), torch.nn.functional.softplus(b.dt_bias)
        assert bool(((A >= 0) & (A <= 16 * (1 + 1e-6))).all()), A
        assert bool(((dt >= 1e-3 * (1 - 1e-4)) & (dt <= 0.1 * (1 + 1e-4))).all()), dt
