"""A decode step of one layer over its state pool, captured once in a CUDA graph and replayed per step.

``step = DecodeGraph(layer, pool, max_num_seqs)``; then ``y = step(x, slots)`` with ``x [n, 1, hidden]`` (one
token of each of ``n <= max_num_seqs`` sequences) and ``slots [n]`` (their pool rows) runs
``layer(x, state=pool, state_slots=slots)`` as one graph replay: ``x`` and ``slots`` are copied into the
graph's static buffers (rows ``n ..`` padded with ``-1``: nothing read or written), the pool rows are read and
written in place, and ``y`` is a copy of the graph's output rows ``:n``. The layer's pool path reads no value
on the host (gdn_layer/pool.py), which is what makes the capture possible; a whole model's decode step over the
layers' pools can be captured the same way with ``torch.cuda.graph``.

Capture after ``gdn_layer.kernels.warmup(layer)`` (every kernel the step launches is compiled and tuned then;
a compile or an autotuning run inside a capture would sync, which a capture forbids). The graph holds the
layer's parameters, the pool's tensors and its own buffers by address: replace none of them afterwards
(a new pool needs a new ``DecodeGraph``).
"""
from __future__ import annotations

import torch

from gdn_layer import mix_graphs
from gdn_layer.checks import positive_int
from gdn_layer.state import GDNState


class DecodeGraph:
    """One layer's pooled decode step of up to ``max_num_seqs`` sequences in a CUDA graph.

    Args:
        layer: a ``GatedDeltaNet`` on a CUDA device, without ``sp_group`` / ``cp_group``.
        pool: its ``GDNState`` pool (``layer.new_state(num_slots)``), on the same device.
        max_num_seqs: the capacity N of every replay.
        warmup_steps: eager calls on a side stream before the capture (the allocator's and cuBLAS's first-use
            work), on the padding rows only (``slots = -1``: the pool is not touched).

    Raises:
        TypeError / ValueError: ``max_num_seqs`` not a positive int; a layer or pool that is not on CUDA; the
            layer's own checks of a pool call (gdn_layer/pool.py), raised at construction.
    """

    def __init__(self, layer, pool: GDNState, max_num_seqs: int, warmup_steps: int = 2):
        self.max_num_seqs = positive_int("max_num_seqs", max_num_seqs)
        device = layer.out_proj.weight.device
        if device.type != "cuda":
            raise ValueError(f"DecodeGraph captures a CUDA graph: the layer is on {device}")
        self.layer, self.pool = layer, pool
        self.x = torch.zeros(self.max_num_seqs, 1, layer.hidden_size, device=device, dtype=layer.out_proj.weight.dtype)
        self.slots = torch.full((self.max_num_seqs,), -1, device=device, dtype=torch.int64)
        with torch.inference_mode(), mix_graphs.paused():             # (no automatic decode replay inside)
            layer(self.x, state=pool, state_slots=self.slots)         # the checks, eagerly, before any capture
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(warmup_steps):
                    layer(self.x, state=pool, state_slots=self.slots)
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.y = layer(self.x, state=pool, state_slots=self.slots)

    def __call__(self, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``layer(x, state=pool, state_slots=slots)`` by one replay: ``x [n, 1, hidden]``, ``slots [n]`` int on the
        layer's device, ``n <= max_num_seqs``; returns ``y [n, 1, hidden]`` (a copy).

        Raises:
            ValueError / TypeError: shapes, dtypes or devices that differ from the capture's.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        n = x.shape[0] if x.dim() == 3 else -1
        if tuple(x.shape[1:]) != tuple(self.x.shape[1:]) or not 0 < n <= self.max_num_seqs:
            raise ValueError(f"x must be [n, 1, {self.x.shape[-1]}] with 0 < n <= max_num_seqs = {self.max_num_seqs}, "
                             f"got {tuple(x.shape)}")
        if x.dtype != self.x.dtype or x.device != self.x.device:
            raise TypeError(f"x must be {self.x.dtype} on {self.x.device} (as captured), got {x.dtype} on {x.device}")
        if (not isinstance(slots, torch.Tensor) or tuple(slots.shape) != (n,)
                or slots.dtype not in (torch.int32, torch.int64)):
            raise ValueError(f"slots must be an int32/int64 [{n}] tensor (one pool row per sequence, -1 = padding)")
        if slots.device != self.x.device:
            raise ValueError(f"slots is on {slots.device} but the graph runs on {self.x.device}")
        self.x[:n].copy_(x)
        self.slots[:n].copy_(slots)
        if n < self.max_num_seqs:
            self.slots[n:].fill_(-1)
        self.graph.replay()
        return self.y[:n].clone()
