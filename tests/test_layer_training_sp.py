"""The layer inside the PyTorch training stack, over real gloo groups: meta-device init under SP, deep
copies that share the SP group, and FSDP2 x Ulysses on a 2-D (dp, sp) mesh."""
import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from oracle import rel_err
from gdn_layer import GatedDeltaNet
from gdn_layer.parallel import gather_sequence, reduce_sp_grads, shard_sequence

SIZES = (64, 2, 4, 16, 16)   # hidden, Hk, Hv, Dk, Dv
CU = [0, 40, 100, 128]       # sequences straddle the rank boundary at 64


def _reference(seed=0):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(*SIZES)
    with torch.no_grad():
        layer.conv1d.weight.normal_(0, 0.5)
        layer.A_log.copy_(torch.linspace(-3, 0, SIZES[2]))
    return layer


def _sp_errors(layer, ref, group):
    """Forward + backward of the SP ``layer`` and the single-process ``ref`` on one packed batch."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, CU[-1], SIZES[0], generator=gen)
    cot = torch.randn(1, CU[-1], SIZES[0], generator=gen)
    cu = torch.tensor(CU)
    y_ref = ref(x, cu_seqlens=cu)
    (y_ref * cot).sum().backward()
    y_local = layer(shard_sequence(x, group), cu_seqlens=cu)
    (y_local * shard_sequence(cot, group)).sum().backward()
    reduce_sp_grads(layer, group)
    errs = {"y": rel_err(gather_sequence(y_local.detach(), group), y_ref)}
    ref_params = dict(ref.named_parameters())
    errs.update({name: rel_err(p.grad, ref_params[name].grad) for name, p in layer.named_parameters()})
    return errs


# --------------------------------------------------------------------------------------------------
# meta-device init


def _meta_init(rank, world, how):
    group = dist.group.WORLD
    ref = _reference()
    with torch.device("meta"):
        layer = GatedDeltaNet(*SIZES, sp_group=group)
    layer.to_empty(device="cpu")
    # to_empty leaves whatever the allocator hands out; make that the quiet worst case for certain:
    # zeros in every tensor it allocated (an index of zeros gives a plausible, wrong output)
    with torch.no_grad():
        for t in itertools.chain(layer.parameters(), layer.buffers()):
            t.zero_()
    if how == "load_state_dict":
        layer.load_state_dict(ref.state_dict())
    else:
        torch.manual_seed(3)
        layer.reset_parameters()
        torch.manual_seed(3)
        ref.reset_parameters()
    return _sp_errors(layer, ref, group)


@pytest.mark.parametrize("how", ["load_state_dict", "reset_parameters"])
def test_meta_device_init_under_sp_then_to_empty_matches_single_process(pool2, how):
    for errs in pool2.run(_meta_init, how, timeout=120):
        assert max(errs.values()) <= 1e-5, errs


# --------------------------------------------------------------------------------------------------
# deep copies


def _deepcopy(rank, world):
    group = dist.group.WORLD
    layer = GatedDeltaNet(*SIZES, sp_group=group)
    layer.load_state_dict(_reference().state_dict())
    model = nn.Sequential(nn.Identity(), layer)
    ema = copy.deepcopy(model)               # an EMA / reference model is a deep copy of the whole model
    twin = ema[1]
    shares_group = twin.sp_group is layer.sp_group
    own_storage = all(a.data_ptr() != b.data_ptr() for a, b in zip(twin.parameters(), layer.parameters()))
    with torch.no_grad():
        twin.out_proj.weight.mul_(0.5)
    original_kept = bool(torch.equal(layer.out_proj.weight, _reference().out_proj.weight))
    with torch.no_grad():
        twin.out_proj.weight.mul_(2.0)
    errs = _sp_errors(twin, _reference(), group)    # the copy runs in the same group
    return shares_group, own_storage, original_kept, errs


def test_deepcopy_under_sp_shares_the_group_and_copies_the_weights(pool2):
    for shares_group, own_storage, original_kept, errs in pool2.run(_deepcopy, timeout=120):
        assert shares_group and own_storage and original_kept
        assert max(errs.values()) <= 1e-5, errs


# --------------------------------------------------------------------------------------------------
# FSDP2 x Ulysses on a 2-D mesh


class _Net(nn.Module):
    """A residual block around the layer, so FSDP2 shards more than one module."""

    def __init__(self, sp_group=None):
        super().__init__()
        self.mixer = GatedDeltaNet(*SIZES, sp_group=sp_group)
        self.mlp = nn.Linear(SIZES[0], SIZES[0])

    def forward(self, x, cu_seqlens):
        x = x + self.mixer(x, cu_seqlens=cu_seqlens)
        return x + self.mlp(x)


def _fsdp_sp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    dp = mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    ref = _Net()
    ref.mixer.load_state_dict(_reference().state_dict())
    model = _Net(sp_group=mesh["sp"])
    model.load_state_dict(ref.state_dict())
    fully_shard(model.mixer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 1, CU[-1], SIZES[0], generator=gen)      # one packed row per dp rank
    cot = torch.randn(2, 1, CU[-1], SIZES[0], generator=gen)
    cu = torch.tensor(CU)
    # one process, the whole batch: the mean over the dp samples of each sample's summed loss
    (sum((ref(x[d], cu) * cot[d]).sum() for d in range(2)) / 2).backward()
    ref_opt.step()
    # FSDP2 averages gradients over dp, reduce_sp_grads sums them over sp
    y = model(shard_sequence(x[dp], mesh["sp"]), cu)
    (y * shard_sequence(cot[dp], mesh["sp"])).sum().backward()
    reduce_sp_grads(model, mesh["sp"])
    sharded = all(type(p.grad).__name__ == "DTensor" for p in model.parameters())
    ref_params = dict(ref.named_parameters())
    grad_errs = {n: rel_err(p.grad.full_tensor(), ref_params[n].grad) for n, p in model.named_parameters()}
    opt.step()
    param_errs = {n: rel_err(p.full_tensor(), ref_params[n]) for n, p in model.named_parameters()}
    return sharded, grad_errs, param_errs


def _fsdp_frozen_differ(rank, world):
    """Ranks of one SP group that train different parameters: every rank raises, none hangs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    model = _Net(sp_group=mesh["sp"])
    model.load_state_dict(_Net().state_dict())
    fully_shard(model, mesh=mesh["dp"])
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    if rank == 0:
        model.mixer.A_log.requires_grad_(False)
    try:
        reduce_sp_grads(model, mesh["sp"])
    except ValueError as e:
        return str(e)
    return ""


def test_fsdp2_on_dp_with_ulysses_on_sp_steps_like_one_process(pool4):
    for sharded, grad_errs, param_errs in pool4.run(_fsdp_sp, timeout=300):
        assert sharded
        assert max(grad_errs.values()) <= 1e-5, grad_errs
        assert max(param_errs.values()) <= 1e-5, param_errs


def test_fsdp2_reduce_sp_grads_raises_on_every_rank_when_trainable_params_differ(pool4):
    msgs = pool4.run(_fsdp_frozen_differ, timeout=300)
    # rank 0 and its SP partner (rank 1) disagree; ranks 2 and 3 form the other SP group and agree
    assert all("differ" in m for m in msgs[:2]) and msgs[2:] == ["", ""], msgs


# --------------------------------------------------------------------------------------------------
# the transformers adapter under SP: packs only through the global cu_seq_lens_q


def _hf_adapter_under_sp(rank, world):
    from gdn_layer.hf import HFGatedDeltaNet

    group = dist.group.WORLD
    block = HFGatedDeltaNet(*SIZES, sp_group=group)
    block.load_state_dict(_reference().state_dict())
    x = torch.randn(1, CU[-1], SIZES[0], generator=torch.Generator().manual_seed(8))
    position_ids = torch.cat([torch.arange(b - a) for a, b in zip(CU[:-1], CU[1:])])[None]
    try:
        block(shard_sequence(x, group), gdn_position_ids=shard_sequence(position_ids, group))
        msg = ""
    except ValueError as e:
        msg = str(e)
    with torch.no_grad():
        y = gather_sequence(block(shard_sequence(x, group), cu_seq_lens_q=torch.tensor(CU)), group)
        err = rel_err(y, _reference()(x, cu_seqlens=torch.tensor(CU)))
    return msg, err


def test_hf_adapter_under_sp_takes_packs_from_cu_seq_lens_q_and_refuses_position_ids_on_every_rank(pool2):
    for msg, err in pool2.run(_hf_adapter_under_sp, timeout=120):
        assert "cu_seq_lens_q" in msg and err <= 1e-5, (msg, err)
