"""Ulysses SP in a dozen lines: the README's example, runnable.

    .venv/bin/torchrun --nproc_per_node=2 examples/sp_quickstart.py

Every rank builds the same layer (same seed: the weights must be identical on every rank), takes
its slice of one packed batch, and the gathered output and the summed gradients equal one process.
"""
import torch
import torch.distributed as dist

from gdn_layer import GatedDeltaNet
from gdn_layer.parallel import gather_sequence, pad_for_sp, reduce_sp_grads, shard_sequence


def demo(group) -> float:
    """Returns the largest relative difference to the single-process layer (output and grads)."""
    P = dist.get_world_size(group)
    torch.manual_seed(0)                                                  # identical weights and data
    mixer = GatedDeltaNet(512, 4, 8, 64, 64, sp_group=group)             # ProcessGroup or 1-D DeviceMesh
    x = torch.randn(1, 387, 512)                                          # three documents, packed
    cu_seqlens = torch.tensor([0, 100, 137, 387], dtype=torch.int32)      # global, the same on every rank

    T = x.shape[1]
    xp, cu_p, pad = pad_for_sp(x, cu_seqlens, P)                          # T divisible by P (the pad is a segment)
    y_local = mixer(shard_sequence(xp, group), cu_seqlens=cu_p)           # [1, T/P, 512]
    real = shard_sequence((torch.arange(T + pad) < T)[None], group)       # which local tokens are not pad
    loss = (y_local.square().mean(-1) * real).sum() / T                  # local sum / GLOBAL count
    loss.backward()
    reduce_sp_grads(mixer, group)                                         # now grads == one process
    y = gather_sequence(y_local.detach(), group)[:, :T]                   # drop the pad

    alone = GatedDeltaNet(512, 4, 8, 64, 64)
    alone.load_state_dict(mixer.state_dict())
    y_ref = alone(x, cu_seqlens=cu_seqlens)
    y_ref.square().mean(-1).mean().backward()
    y_ref = y_ref.detach()
    errs = [float((y - y_ref).norm() / y_ref.norm())]
    errs += [float((p.grad - q.grad).norm() / q.grad.norm()) for p, q in zip(mixer.parameters(), alone.parameters())]
    return max(errs)


if __name__ == "__main__":
    from requires import help_if_asked, require_torchrun
    help_if_asked(__doc__)
    require_torchrun("sp_quickstart.py", ".venv/bin/torchrun --nproc_per_node=2 examples/sp_quickstart.py")
    dist.init_process_group("gloo")
    err = demo(dist.group.WORLD)
    if dist.get_rank() == 0:
        print(f"SP={dist.get_world_size()} vs one process: max relative difference {err:.1e}")
    dist.destroy_process_group()
