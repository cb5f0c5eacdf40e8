"""What wraps a block's submodules in real pipelines: accelerate's CPU offload hooks (weights restored
before each module's forward, put back on meta after), PEFT-style wrappers and forward hooks. The layer
reads conv1d's weight itself: accelerate's hook is honoured, anything else on conv1d raises."""
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")  # the `hf` extra; .ci/run installs it

from gdn_layer import GatedDeltaNet  # noqa: E402
from gdn_layer.hf import swap_gated_deltanet  # noqa: E402
from test_hf import qwen3_5, rel_err  # noqa: E402
from test_hf_training import slow_decay  # noqa: E402


def pair():
    torch.manual_seed(0)
    original = slow_decay(qwen3_5()).eval()
    swapped = qwen3_5().eval()
    swapped.load_state_dict(original.state_dict())
    assert swap_gated_deltanet(swapped) == 2
    return original, swapped


def test_accelerate_cpu_offload_of_a_swapped_model_gives_its_logits():
    accelerate = pytest.importorskip("accelerate")
    original, swapped = pair()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, reference = swapped(ids).logits, original(ids).logits
    accelerate.cpu_offload(swapped, execution_device=torch.device("cpu"))
    block = swapped.model.layers[0].linear_attn
    assert block.conv1d.weight.device.type == "meta" and block.out_proj.weight.device.type == "meta"
    with torch.no_grad():
        got = swapped(ids).logits
    # (offloaded projections are called one by one, not as one GEMM of their concatenated weights)
    assert rel_err(got, want) <= 1e-6 and rel_err(got, reference) <= 1e-5
    assert block.conv1d.weight.device.type == "meta"         # given back to the hook after use


def test_swapping_an_offloaded_model_raises_instead_of_copying_meta_weights():
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    model = qwen3_5().eval()
    accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
    with pytest.raises(ValueError, match="offloaded by accelerate hooks"):
        swap_gated_deltanet(model)


class LoraConv1d(nn.Module):
    """What PEFT puts in place of a targeted Conv1d: the base layer inside, ``weight`` still reachable,
    the low-rank update applied in forward only."""

    def __init__(self, base: nn.Conv1d, rank=2):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Conv1d(base.in_channels, rank, base.kernel_size, bias=False, padding=base.padding)
        self.lora_B = nn.Conv1d(rank, base.out_channels, 1, bias=False)
        nn.init.normal_(self.lora_B.weight)

    @property
    def weight(self):
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


@pytest.mark.parametrize("how", ["lora_wrapper", "forward_hook", "forward_pre_hook"])
def test_a_wrapper_or_hook_on_conv1d_raises_naming_it_instead_of_being_ignored(how):
    torch.manual_seed(0)
    layer = GatedDeltaNet(64, 2, 4, 16, 8)
    if how == "lora_wrapper":
        layer.conv1d = LoraConv1d(layer.conv1d)
    elif how == "forward_hook":
        layer.conv1d.register_forward_hook(lambda *a: None)
    else:
        layer.conv1d.register_forward_pre_hook(lambda *a: None)
    with pytest.raises(ValueError, match="conv1d"):
        layer(torch.randn(1, 7, 64))


def test_a_wrapper_on_a_projection_is_honoured():
    torch.manual_seed(0)
    layer = GatedDeltaNet(64, 2, 4, 16, 8)
    x = torch.randn(1, 7, 64)
    with torch.no_grad():
        plain = layer(x)
        calls = []
        layer.in_proj_qkv.register_forward_hook(lambda m, i, o: calls.append(1) or o * 2)
        hooked = layer(x)
    assert calls == [1] and rel_err(hooked, plain) > 1e-2
