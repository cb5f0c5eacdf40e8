"""A small hybrid model (GatedDeltaNet blocks around a softmax-attention block) trained on a
load-balanced context-parallel layout: the sequence is rearranged ONCE (per-document head-tail, the
layout of PyTorch's ``_PerDocumentHeadTailLoadBalancer``) and every layer works on that layout.

- GDN blocks: ``GatedDeltaNet(..., cp_group=..., sp_group=...)`` called with ``token_order`` (no
  reshuffle of activations in or out).
- Attention block: each rank attends with its held queries over the whole sequence, restricted by a
  causal per-document mask on the ORIGINAL positions. PyTorch's ``context_parallel()`` (ring attention)
  only replaces the CUDA SDPA kernels (flash / efficient / cudnn aten ops; CPU SDPA dispatches to
  ``_scaled_dot_product_flash_attention_for_cpu``, which it does not handle), so on CPU/gloo this
  example all-gathers K/V instead and calls SDPA: the same math, and the same held layout, as the ring.

``train(rank, world, cp, sp, steps)`` returns the loss of each step; on any (cp, sp) mesh it equals the
one-process run (``world = 1``) to fp32 rounding (tests/test_layer_token_order.py).

    python examples/cp_token_order.py --cp 2 --sp 2      # spawns 4 gloo ranks, compares with 1 process
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gdn_layer import GatedDeltaNet
from gdn_layer.parallel import gather_sequence, per_document_head_tail_order, shard_sequence

VOCAB, HIDDEN, HEADS = 64, 32, 4
DOC_LENS = [16, 40, 8]  # every length divisible by 2 * world for world up to 4


class Attention(nn.Module):
    """Causal softmax attention over packed documents for tokens held in ``order``.

    ``forward(x [1, T_local, hidden], order [T], cu_seqlens [N + 1], group)``: all-gathers the held
    tokens' K and V (gradient summed over ranks), masks by original position and document.
    """

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x, order, cu_seqlens, group):
        q, k, v = self.qkv(x).chunk(3, -1)
        if group is not None:
            k, v = (gather_sequence(t, group, grad="sum") for t in (k, v))
        T_local, T = x.shape[1], k.shape[1]
        rank = 0 if group is None else dist.get_rank(group)
        pos_q, pos_k = order[rank * T_local:(rank + 1) * T_local], order
        doc = torch.bucketize(torch.arange(T), cu_seqlens[1:], right=True)
        mask = (pos_k[None] <= pos_q[:, None]) & (doc[pos_k][None] == doc[pos_q][:, None])
        heads = lambda t: t.unflatten(-1, (HEADS, -1)).transpose(1, 2)  # noqa: E731
        o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=mask)
        return self.out(o.transpose(1, 2).flatten(2))


class Hybrid(nn.Module):
    """embed -> [GDN, attention, GDN] blocks (pre-norm, residual) -> norm -> lm head."""

    def __init__(self, cp_group=None, sp_group=None):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(nn.RMSNorm(HIDDEN) for _ in range(4))
        self.gdn = nn.ModuleList(GatedDeltaNet(HIDDEN, 2, 4, 8, 8, cp_group=cp_group, sp_group=sp_group)
                                 for _ in range(2))
        self.attn = Attention()
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens, order, cu_seqlens, group):
        h = self.embed(tokens)
        h = h + self.gdn[0](self.norms[0](h), cu_seqlens=cu_seqlens, token_order=order)
        h = h + self.attn(self.norms[1](h), order, cu_seqlens, group)
        h = h + self.gdn[1](self.norms[2](h), cu_seqlens=cu_seqlens, token_order=order)
        return self.head(self.norms[3](h))


def _groups(cp, sp):
    """(cp_group, sp_group) of this rank on a cp x sp mesh; rank = c * sp + s holds share c * sp + s."""
    if cp * sp == 1:
        return None, None
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (cp, sp), mesh_dim_names=("cp", "sp"))
    return (mesh["cp"] if cp > 1 else None), (mesh["sp"] if sp > 1 else None)


def train(rank: int, world: int, cp: int, sp: int, steps: int = 3) -> list[float]:
    """Train the hybrid for ``steps`` Adam steps on one packed batch; every rank returns the global losses."""
    assert world == cp * sp
    cp_group, sp_group = _groups(cp, sp)
    group = dist.group.WORLD if world > 1 else None
    torch.manual_seed(0)
    model = Hybrid(cp_group, sp_group)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cu = torch.tensor([0] + DOC_LENS).cumsum(0)
    T = int(cu[-1])
    tokens = torch.randint(1, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    labels = torch.cat([tokens[:, 1:], tokens[:, :1]], 1)
    labels[0, cu[1:] - 1] = -100  # no target across a document end
    # one rearrangement for the whole model: the layout the attention's load balancer wants (with one
    # rank the order is still applied, so the one-process run checks the same code path)
    order = per_document_head_tail_order(cu, world)
    held_tokens, held_labels = shard_sequence(tokens[:, order], group), shard_sequence(labels[:, order], group)
    n_targets = int((labels != -100).sum())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        logits = model(held_tokens, order, cu, group)
        loss = F.cross_entropy(logits.flatten(0, 1), held_labels.flatten(), ignore_index=-100, reduction="sum")
        (loss / n_targets).backward()
        total = loss.detach() / n_targets
        if group is not None:
            for p in model.parameters():  # each rank's loss is its share: the sum is the global gradient
                dist.all_reduce(p.grad, group=group)
            dist.all_reduce(total, group=group)
        losses.append(float(total))
        opt.step()
    return losses


def _spawned(rank, world, cp, sp, steps, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        losses = train(rank, world, cp, sp, steps)
        if rank == 0:
            out.put(losses)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Spawns cp x sp gloo ranks on this machine; about a minute on 2 CPU cores at "
                                        "--cp 2 --sp 2.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--cp", type=int, default=2, help="context-parallel ranks (state passing between them)")
    ap.add_argument("--sp", type=int, default=1, help="Ulysses ranks within each cp rank")
    ap.add_argument("--steps", type=int, default=3, help="training steps; each step's loss is compared with one process")
    args = ap.parse_args(argv)
    if "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1:   # (torchrun sets both)
        ap.error("this example starts its own cp x sp gloo ranks: run it with plain python, not torchrun "
                 "(python examples/cp_token_order.py --cp 2 --sp 2)")
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = args.cp * args.sp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_spawned, args=(world, args.cp, args.sp, args.steps, port, out), nprocs=world,
                       start_method="spawn")
    parallel = out.get()
    single = train(0, 1, 1, 1, args.steps)
    worst = max(abs(a - b) / abs(b) for a, b in zip(parallel, single))
    print(f"cp={args.cp} sp={args.sp} losses {['%.6f' % v for v in parallel]}; one process "
          f"{['%.6f' % v for v in single]}; max relative difference {worst:.2e}")
    return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
