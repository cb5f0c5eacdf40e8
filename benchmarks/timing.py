"""Timing and traffic helpers shared by the multi-rank benchmarks (``bench_all_to_all.py``, ``bench_parallel.py``);
``add_shape_args`` also by ``bench_vs_transformers.py`` and ``profile_sp.py``."""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist


def _int_at_least(lo: int):
    """argparse type: an int >= lo."""
    def parse(text: str) -> int:
        value = int(text)
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {value}")
        return value
    return parse


def add_shape_args(p: argparse.ArgumentParser) -> None:
    """The layer's shape: ``--hidden``, ``--k-heads``, ``--v-heads``, ``--head-dim`` (Qwen3-Next's by default)."""
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--k-heads", type=int, default=16)
    p.add_argument("--v-heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)


def add_common_args(p: argparse.ArgumentParser, iters: int) -> None:
    """The arguments both multi-rank benchmarks take: device, dtype, global lengths, the layer's shape
    (Qwen3-Next's by default), timing repetitions and ``--json``."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seq-lens", type=_int_at_least(1), nargs="+", default=[65536, 131072], help="global packed T")
    add_shape_args(p)
    p.add_argument("--iters", type=_int_at_least(1), default=iters)
    p.add_argument("--warmup", type=_int_at_least(0), default=3)
    p.add_argument("--json", help="rank 0 also writes the rows here")


def init_distributed(device_type: str) -> torch.device:
    """This process's device (``cuda:LOCAL_RANK`` under torchrun, or the CPU) and the default process
    group on it (NCCL on CUDA, gloo on the CPU)."""
    device = torch.device(device_type)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


class Timer:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup``, the slowest rank's of ``group``.

    CUDA events on a CUDA ``device``, ``perf_counter`` otherwise. Every timed run starts after an
    all-reduce over ``group`` and a device sync, so no rank's clock starts while another is still busy.
    ``group=None``: this process alone (no collective at all), for a run on one rank while the others wait.
    """

    def __init__(self, device, group, iters, warmup):
        self.device, self.group, self.iters, self.warmup = device, group, iters, warmup
        self.flag = torch.zeros(1, device=device)

    def _sync(self):
        if self.group is not None:
            dist.all_reduce(self.flag, group=self.group)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, fn) -> float:
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            self._sync()
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        worst = torch.tensor([statistics.median(times)], device=self.device, dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.group)
        return float(worst)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


# For each torch.distributed collective: the tensors this rank puts on the wire, from (args, kwargs).
# Rooted ones (broadcast, scatter) count only on the root; the others count every rank's input.
_ORIGINAL_ISEND = dist.isend


def _arg(args, kwargs, i, name):
    return args[i] if len(args) > i else kwargs.get(name)


def _from_root(i_tensor, tensor_name, i_src):
    """Rooted collectives (broadcast, scatter): only the root sends, ``src`` a global rank or ``group_src``
    a rank of ``group``."""
    def sent(args, kwargs):
        src = _arg(args, kwargs, i_src, "src")
        root = dist.get_rank() == src if src is not None else (
            dist.get_rank(kwargs.get("group")) == kwargs.get("group_src"))
        t = _arg(args, kwargs, i_tensor, tensor_name)
        return (list(t) if isinstance(t, (list, tuple)) else [t]) if root else []
    return sent


def _one(i, name):
    """The collective sends the one tensor at position i / keyword name."""
    return lambda a, k: [_arg(a, k, i, name)]


def _each(i, name):
    """The collective sends each tensor of the list at position i / keyword name."""
    return lambda a, k: list(_arg(a, k, i, name))


_SENT = {
    "all_to_all_single": _one(1, "input"),
    "all_to_all": _each(1, "input_tensor_list"),
    "all_gather": _one(1, "tensor"),
    "all_gather_into_tensor": _one(1, "input_tensor"),
    "all_gather_single": _one(1, "input_tensor"),
    "all_reduce": _one(0, "tensor"),
    "reduce": _one(0, "tensor"),
    "reduce_scatter": _each(1, "input_list"),
    "reduce_scatter_tensor": _one(1, "input"),
    "reduce_scatter_single": _one(1, "input"),
    "gather": _one(0, "tensor"),
    "send": _one(0, "tensor"),
    # point-to-point batches: their sends. ``isend`` itself is not wrapped: ``P2POp`` accepts only the
    # original function, and the all-to-all pair hands it ``dist.isend``
    "batch_isend_irecv": lambda a, k: [op.tensor for op in _arg(a, k, 0, "p2p_op_list")
                                       if op.op is _ORIGINAL_ISEND],
    "broadcast": _from_root(0, "tensor", 1),
    "scatter": _from_root(1, "scatter_list", 2),
}


@contextlib.contextmanager
def count_sent_bytes():
    """Count the bytes this rank hands to ``torch.distributed`` collectives inside the ``with`` block.

    Yields a dict whose ``"bytes"`` (total) and ``"calls"`` (``{name: count}``) fill in as collectives run.
    The input tensors' sizes are summed (an all-gather counts this rank's shard once, an all-to-all its
    whole send buffer, a point-to-point batch its sends, an all-reduce its buffer once), which is what
    the caller asked the library to move, not the wire traffic of a particular algorithm. Only calls through the ``torch.distributed``
    namespace are seen (what ``gdn_layer.parallel`` uses); the originals are restored on exit.
    """
    counts = {"bytes": 0, "calls": {}}
    originals = {name: getattr(dist, name) for name in _SENT if hasattr(dist, name)}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts["bytes"] += _nbytes(_SENT[name](args, kwargs))
            counts["calls"][name] = counts["calls"].get(name, 0) + 1
            return fn(*args, **kwargs)
        return counted

    try:
        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
