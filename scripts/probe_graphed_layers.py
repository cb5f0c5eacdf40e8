"""Probe (GPU, issue 23): the fine-tuning step with each GatedDeltaNet layer in its own CUDA graph.

The eager 8k fine-tuning step is host-bound in the GDN layers (docs/performance.md: about 6.6 ms of host
time per layer call against 1 ms of kernels), while the rest of the model (softmax attention, MLPs,
loss, optimizer) costs the host little. ``--cuda-graphs`` captures the whole step; this probe asks what
graphing only the GDN layers gives, leaving everything else eager (what a user of a model that cannot be
captured whole would do). Each layer becomes a callable of ``torch.cuda.make_graphed_callables`` (its
forward and backward captured once, one memory pool for all of them, parameters as graph inputs) on a
fixed capacity: ``x [1, T, hidden]`` and ``cu_seqlens`` padded to ``N_max + 1`` entries
(``gdn_layer.parallel.pad_cu_seqlens``, on the device). In eval mode the layers run eagerly.

Takes finetune.py's own arguments (model, data, layers, backend, seq-len, dtype; one process, no SP/CP).
Prints, for the same batch at the same parameters, the loss and the largest relative gradient
difference of graphed against eager layers, then the median tokens/s of ``--timed-steps`` training steps
(after 3 warm-up steps) eager and with graphed layers, side by side.

    python3 scripts/probe_graphed_layers.py --model DIR --data DIR --device cuda --dtype bfloat16 \
        --seq-len 8192 --train all [--timed-steps 20]
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import torch
from torch import nn

import finetune
import graph_step
import text_data
from gdn_layer import GatedDeltaNet
from gdn_layer.parallel import pad_cu_seqlens
from hybrid import hybrid_forward, local_loss
from requires import require_cuda


class _Positional(nn.Module):
    """``layer(x, cu_seqlens=cu)`` as ``forward(x, cu)``: make_graphed_callables passes positional tensors
    only, and takes the wrapper's parameters (the layer's) as graph inputs."""

    def __init__(self, layer: GatedDeltaNet):
        super().__init__()
        self.layer = layer

    def forward(self, x, cu):
        return GatedDeltaNet.forward(self.layer, x, cu_seqlens=cu)   # the class's: the instance's is replaced


def graph_gdn_layers(model, seq_len: int, n_max: int, cu_example: torch.Tensor) -> int:
    """Replace each GDN layer's ``forward`` (training mode) by a replay of its captured forward/backward;
    ``cu_seqlens`` is padded to ``n_max + 1`` entries at each call. Returns the number of layers graphed."""
    layers = [b.self_attn for b in model.model.layers if isinstance(b.self_attn, GatedDeltaNet)]
    if not layers:
        return 0
    p = next(model.parameters())
    wrappers = tuple(_Positional(layer) for layer in layers)
    cu0 = pad_cu_seqlens(cu_example.to(p.device), n_max)
    samples = tuple((torch.randn(1, seq_len, layer.hidden_size, device=p.device, dtype=p.dtype, requires_grad=True),
                     cu0.clone()) for layer in layers)
    graphed = torch.cuda.make_graphed_callables(wrappers, samples)
    for layer, g in zip(layers, graphed):
        def fwd(hidden_states, cu_seqlens=None, _g=g, _layer=layer):
            if not _layer.training or not torch.is_grad_enabled():
                return GatedDeltaNet.forward(_layer, hidden_states, cu_seqlens=cu_seqlens)
            return _g(hidden_states, pad_cu_seqlens(cu_seqlens, n_max))
        layer.forward = fwd
    return len(layers)


def main(argv=None):
    mine, rest = finetune.own_and_finetune_args(__doc__, lambda p: p.add_argument(
        "--timed-steps", type=int, default=20, help="training steps timed in each mode, after 3"), argv)
    require_cuda("probe_graphed_layers.py")
    if mine.timed_steps < 1:
        raise SystemExit(f"--timed-steps must be >= 1, got {mine.timed_steps}")
    args = finetune.parse_args(rest)
    ctx = finetune.setup_distributed(args.sp, args.device, args.cp)
    if ctx.sp > 1 or ctx.dp > 1:
        raise SystemExit("probe_graphed_layers.py runs one process (no --sp / --cp, no torchrun)")
    model, params, _, train, _, _, summary = finetune.build(args, ctx)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    print(summary, flush=True)

    def batch(i):
        return text_data.batch_for_step(train, i, ctx.dp_rank, ctx.dp, args.seed)

    def timed(label):
        for i in range(3):
            finetune.train_step(model, params, optimizer, batch(i), ctx)
        torch.cuda.synchronize()
        walls = []
        for i in range(mine.timed_steps):
            t0 = time.perf_counter()
            finetune.train_step(model, params, optimizer, batch(3 + i), ctx)   # its loss read syncs
            walls.append(time.perf_counter() - t0)
        tok_s = args.seq_len / statistics.median(walls)
        print(f"{label}: median step {statistics.median(walls) * 1e3:.1f} ms, {tok_s:.0f} tokens/s "
              f"(min {args.seq_len / max(walls):.0f}, max {args.seq_len / min(walls):.0f})", flush=True)
        return tok_s

    def loss_and_grads(b):
        ids, labels, pos, cu = finetune.local_inputs(b, ctx)
        n_global = int((b.labels != text_data.IGNORE).sum())
        optimizer.zero_grad(set_to_none=True)
        loss = local_loss(hybrid_forward(model, ids, pos, cu, None), labels, n_global)
        loss.backward()
        return float(loss), [p.grad.detach().double().clone() for p in params]

    eager = timed("eager GDN layers")
    probe = batch(1000)
    loss_e, grads_e = loss_and_grads(probe)
    n = graph_gdn_layers(model, args.seq_len, graph_step.max_documents(train), probe.cu_seqlens)
    loss_g, grads_g = loss_and_grads(probe)
    worst = max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(grads_g, grads_e))
    print(f"graphed {n} GDN layers; same batch, same parameters: loss {loss_g:.6f} vs eager {loss_e:.6f}, "
          f"largest relative gradient difference {worst:.2e}", flush=True)
    graphed = timed("graphed GDN layers")
    print(f"tokens/s graphed / eager: {graphed / eager:.2f}x", flush=True)


if __name__ == "__main__":
    main()
