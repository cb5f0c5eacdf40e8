"""The fine-tuning step on static device buffers, captured once in a CUDA graph (``finetune.py --cuda-graphs``).

A CUDA graph replays fixed kernels on fixed memory, so the step is written against a fixed *capacity*:
every batch is a pack of exactly ``T`` tokens whose ``cu_seqlens`` is padded to ``N_max + 1`` entries
with empty segments (``gdn_layer.parallel.pad_cu_seqlens``). ``StaticStep`` owns one device buffer per
input (``input_ids``, ``labels``, ``position_ids`` ``[1, T]``, ``cu_seqlens`` ``[N_max + 1]`` int32 and the
label count as a 0-d int64 tensor, which the loss divides by: no Python number from the batch enters the
step). Each call copies the batch into them and runs forward + loss + backward:

- ``capture=True`` (CUDA): PyTorch's whole-network capture. The first call warms up on a side stream,
  sets the gradients to None and captures forward + loss + backward into a ``torch.cuda.CUDAGraph``, so
  the gradients are allocated from the graph's pool and stay where they are; every call then replays it.
  The captured backward writes the gradients in place: never set them to None (or zero them) between
  replays, and never replace a ``.grad`` tensor.
- ``capture=False``: the same buffers and the same code, run eagerly (zeroing the gradients first). This
  is what the CPU tests drive (tests/test_finetune_graphs.py).

What stays outside, in ``finetune.train_step``: the DP all-reduce of the gradients, clipping, the
optimizer and scheduler steps (they read and update the parameters and gradients in place, which the
replay then sees), and reading the loss. Under Ulysses SP or CP the captured region would hold
all-to-alls and state passing; ``finetune.parse_args`` refuses those for now (docs/finetune.md).
"""
from __future__ import annotations

import torch

import text_data
from gdn_layer.parallel import pad_cu_seqlens
from hybrid import hybrid_forward, local_loss


def capture(step, warmup_iters: int = 2, before_each=None):
    """PyTorch's whole-network capture recipe: run ``step()`` ``warmup_iters`` times on a side stream (every
    kernel compiles and autotunes there, outside the capture), then capture one ``step()`` in a
    ``torch.cuda.CUDAGraph``. ``before_each()`` (optional) runs before each warm-up call and before the
    capture, e.g. to set the gradients to None so that the capture allocates them.

    Returns ``(graph, out)``: ``out`` is what the captured ``step()`` returned (static tensors, refreshed by
    each ``graph.replay()``). The capture itself computes nothing: replay once to get a result."""
    prepare = before_each or (lambda: None)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_iters):
            prepare()
            step()
    torch.cuda.current_stream().wait_stream(side)
    prepare()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def max_documents(batches: list[text_data.PackedBatch]) -> int:
    """The capacity ``N_max``: the largest number of ``cu_seqlens`` segments in ``batches``."""
    return max(b.cu_seqlens.numel() - 1 for b in batches)


class StaticStep:
    """Forward + loss + backward of one replica's packed batch on static buffers (module docstring).

    Args:
        model: the (hybrid) causal LM, on ``device``, one process per sequence (no SP group).
        optimizer: its optimizer; its parameters' gradients are set to None before capture only.
        seq_len: ``T``, tokens of every batch.
        max_docs: ``N_max``, the most documents a batch may hold (``max_documents``).
        device: where the buffers live (the model's device).
        capture: capture a CUDA graph (``device`` must be CUDA), else run eagerly.
        warmup_iters: eager iterations on a side stream before the capture (``capture`` only).

    Calling it with a ``PackedBatch`` returns the loss (0-d fp32, a static buffer when captured: read it
    or clone it before the next call) and leaves the gradients in the parameters' ``.grad``.
    """

    def __init__(self, model, optimizer, seq_len: int, max_docs: int, device: torch.device, capture: bool,
                 warmup_iters: int = 3):
        if capture and torch.device(device).type != "cuda":
            raise ValueError(f"capture=True needs a CUDA device, got {device}")
        self.model, self.optimizer, self.max_docs = model, optimizer, max_docs
        self.capture, self.warmup_iters = capture, warmup_iters
        self.graph: torch.cuda.CUDAGraph | None = None
        self.loss: torch.Tensor | None = None
        long = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(1, seq_len, **long)
        self.labels = torch.full((1, seq_len), text_data.IGNORE, **long)
        self.position_ids = torch.zeros(1, seq_len, **long)
        # one document of T tokens until the first load: valid contents from the start
        self.cu_seqlens = pad_cu_seqlens(torch.tensor([0, seq_len], dtype=torch.int32), max_docs).to(device)
        self.n_labels = torch.zeros((), **long)

    def load(self, batch: text_data.PackedBatch) -> None:
        """Copy ``batch`` into the buffers (``cu_seqlens`` padded on the host to ``N_max + 1`` entries).

        Raises ValueError (from ``pad_cu_seqlens``) when the batch holds more than ``N_max`` documents, and
        when its length is not ``T``."""
        if batch.input_ids.numel() != self.input_ids.shape[1]:
            raise ValueError(f"batch of {batch.input_ids.numel()} tokens, the static step holds "
                             f"{self.input_ids.shape[1]} (--seq-len)")
        cu = pad_cu_seqlens(batch.cu_seqlens, self.max_docs)     # (raises before any buffer changes)
        self.input_ids.copy_(batch.input_ids[None], non_blocking=True)
        self.labels.copy_(batch.labels[None], non_blocking=True)
        self.position_ids.copy_(batch.position_ids[None], non_blocking=True)
        self.cu_seqlens.copy_(cu, non_blocking=True)
        self.n_labels.copy_((batch.labels != text_data.IGNORE).sum(), non_blocking=True)

    def forward_backward(self) -> torch.Tensor:
        """Loss of the buffers' batch (0-d fp32, detached); its gradients reach the parameters' ``.grad``."""
        logits = hybrid_forward(self.model, self.input_ids, self.position_ids, self.cu_seqlens, None)
        loss = local_loss(logits, self.labels, self.n_labels)
        loss.backward()
        return loss.detach()

    def __call__(self, batch: text_data.PackedBatch) -> torch.Tensor:
        self.load(batch)
        if not self.capture:
            self.optimizer.zero_grad(set_to_none=True)
            return self.forward_backward()
        if self.graph is None:   # the gradients set to None before the capture: it allocates them, static from now on
            self.graph, self.loss = capture(self.forward_backward, self.warmup_iters,
                                            lambda: self.optimizer.zero_grad(set_to_none=True))
        self.graph.replay()
        return self.loss
