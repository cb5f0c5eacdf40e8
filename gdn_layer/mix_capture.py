"""Capture and replay of the layer's token mixing (policy and signatures: gdn_layer/mix_graphs.py).

``record(fn, inputs, grad)`` captures ``fn(*inputs)`` on static copies of the inputs into a forward CUDA
graph (and a backward graph of the inputs that need gradients), recording with ``saved_tensors_hooks`` what the
forward saves for its backward. ``Replay.apply(captured, *inputs)`` copies a call's inputs in, replays, and copies
the output and those saved tensors out; its backward puts them back where another call of the signature has
loaded its own since, and returns copies of the gradients. Each capture has its own memory pool (its forward and
backward graphs share it), freed when the capture is dropped. One replay runs at a time (a lock; on CUDA an event,
on the capture's device, orders the streams).
"""
from __future__ import annotations

import contextlib
import threading

import torch

WARMUP_RUNS = 2          # eager runs on the capture stream before a capture (autotuners settle, caches fill)
replay_lock = threading.RLock()   # one replay at a time (the static buffers are shared by every call)


class Captured:
    """One signature's graphs and their static buffers."""

    def __init__(self, static, out, saved, fwd, bwd=None, grad_out=None, grads=None, tracked=()):
        self.static = static        # the graphs' inputs (gdn_layer/mix_graphs.py: try_layer, try_mix)
        self.tracked = tracked      # indices of the inputs the captured forward saved for its backward
        self.out = out              # the forward graph's output
        self.saved = saved          # what the forward saved for the backward, other than the inputs
        self.fwd, self.bwd = fwd, bwd
        self.grad_out, self.grads = grad_out, grads   # the backward graph's input and outputs (per input, or None)
        self.loaded = None          # the call whose inputs the static buffers now hold
        self.device = static[0].device
        self.cuda = self.device.type == "cuda"

    def load(self, inputs, owner) -> None:
        copy_all(self.static, inputs)
        self.loaded = owner

    def on_device(self):
        """The capture's device current (a layer on another GPU than the thread's current one)."""
        return torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext()

    def begin(self) -> None:
        if self.cuda:   # a replay enqueued on another stream must finish before these copies start
            torch.cuda.current_stream(self.device).wait_event(_last_event(self.device))

    def end(self) -> None:
        if self.cuda:
            _last_event(self.device).record(torch.cuda.current_stream(self.device))

    def forward(self, inputs, owner=None):
        """``(out, saved)``: copies of the output and, for a call that will run the backward (``owner``), of the
        saved tensors (else an empty list)."""
        with replay_lock, self.on_device():
            self.begin()
            self.load(inputs, owner)
            self.fwd.replay()
            out, *saved = clone_all([self.out, *(self.saved if owner is not None else ())])
            self.end()
        return out, saved


def copy_all(dst: list, src: list) -> None:
    """``d.copy_(s)`` for each pair, in one multi-tensor launch per dtype where the pairs allow it
    (``torch._foreach_copy_``; it copies pair by pair otherwise): a few launches instead of one per tensor."""
    groups: dict = {}
    for d, s in zip(dst, src):
        if d is None:
            continue
        same = d.dtype == s.dtype and d.device == s.device
        pair = groups.setdefault(d.dtype if same else None, ([], []))
        pair[0].append(d)
        pair[1].append(s)
    for dtype, (ds, ss) in groups.items():
        if dtype is None:
            for d, s in zip(ds, ss):
                d.copy_(s)
        else:
            torch._foreach_copy_(ds, ss)


def clone_all(tensors: list) -> list:
    """Clones (None stays None) by ``copy_all``."""
    out = [None if t is None else torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    copy_all(out, tensors)
    return out


_events: dict = {}


def _last_event(device) -> "torch.cuda.Event":
    """Per device: recorded after the last replay's copies out (the next replay's stream waits on it)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _events:
        _events[index] = torch.cuda.Event()
    return _events[index]


class Replay(torch.autograd.Function):
    """The forward and backward replays as one autograd node; the inputs' gradients are copies."""

    @staticmethod
    def forward(ctx, captured, *inputs):
        owner = object()
        out, saved = captured.forward(inputs, owner)
        ctx.captured, ctx.owner = captured, owner
        # the inputs the captured forward saved for its backward are saved as eager saves them (an in-place
        # change before the backward raises); the others are only held, to be loaded again if need be
        ctx.save_for_backward(*(inputs[i] for i in captured.tracked), *saved)
        ctx.held = tuple(None if i in captured.tracked else t for i, t in enumerate(inputs))
        return out

    @staticmethod
    def backward(ctx, grad):
        captured = ctx.captured
        tensors = ctx.saved_tensors
        n = len(captured.tracked)
        inputs, saved = list(ctx.held), tensors[n:]
        for i, t in zip(captured.tracked, tensors[:n]):
            inputs[i] = t
        grads = _backward_replay(ctx, captured, inputs, saved, grad)
        if torch.is_grad_enabled():   # create_graph=True: gradients whose own backward raises, as the op-by-op
            return (None, *_not_twice_differentiable(grads))   # call's custom ops do
        return (None, *grads)


def _not_twice_differentiable(grads):
    """``grads`` behind a node that raises when a backward reaches it (what ``once_differentiable`` attaches)."""
    from torch._C import _functions
    present = [g for g in grads if g is not None]
    if not present:
        return grads
    error = _functions.DelayedError(b"GatedDeltaNet is not twice differentiable (a backward through the gradients "
                                    b"of its replayed CUDA graph); its op-by-op custom ops have no second "
                                    b"derivative either", len(present))
    out = error(*[g.detach().requires_grad_(True) for g in present])
    out = iter(out if isinstance(out, tuple) else (out,))
    return [None if g is None else next(out) for g in grads]


def _backward_replay(ctx, captured, inputs, saved, grad):
    """The backward graph's replay for the call ``ctx.owner``, its inputs and saved tensors loaded again where
    another call of the signature loaded its own since; copies of the gradients."""
    with replay_lock, captured.on_device(), torch.no_grad():
        captured.begin()
        if captured.loaded is not ctx.owner:      # another call of this signature loaded its own since
            copy_all([*captured.static, *captured.saved, captured.grad_out], [*inputs, *saved, grad])
            captured.loaded = ctx.owner
        else:
            captured.grad_out.copy_(grad)
        captured.bwd.replay()
        grads = clone_all(captured.grads)
        captured.end()
    return grads


class _CudaCapture:
    """Makes the graphs of a function of the tensors ``static`` (the graphs' inputs): ``forward(run)`` captures
    ``run()`` (recording what autograd saves) and returns ``(graph, out, saved)``; ``backward(out, leaves,
    grad_out)`` captures the gradients of ``leaves`` and returns ``(graph, grads)``. The CPU tests put a
    stand-in with the same semantics in ``_capturer``."""

    def __init__(self, static: list):
        device = static[0].device
        self.pool = torch.cuda.graph_pool_handle()   # this capture's own (its two graphs share it)
        self.stream = torch.cuda.Stream(device=device)
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.device = device

    def warm(self, run, leaves, grad: bool) -> None:
        from gdn_layer.kernels.flash_qla_backend import as_in_capture
        with torch.cuda.stream(self.stream), as_in_capture():
            for _ in range(WARMUP_RUNS):
                out = run()
                if grad:
                    torch.autograd.grad(out, leaves, torch.zeros_like(out), allow_unused=True)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def _graph(self, graph):
        return torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local")

    def forward(self, run):
        graph, saved = torch.cuda.CUDAGraph(), []
        with self._graph(graph), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t,
                                                                         lambda t: t):
            out = run()
        return graph, out, saved

    def backward(self, out, leaves, grad_out):
        graph = torch.cuda.CUDAGraph()
        with self._graph(graph):
            grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
        return graph, grads


_capturer = _CudaCapture


def record(fn, inputs, grad: bool) -> Captured:
    """Capture ``fn(*inputs)`` (tensors; ``fn`` returns one tensor) on copies of ``inputs``: its forward graph
    and, with ``grad``, the backward graph of the inputs that require grad."""
    static = [t.detach().clone() for t in inputs]
    differentiable = [i for i, t in enumerate(inputs) if grad and t.requires_grad]
    for i in differentiable:
        static[i].requires_grad_(True)
    leaves = [static[i] for i in differentiable]

    def run():
        return fn(*static)

    capture = _capturer(static)
    capture.warm(run, leaves, grad)
    fwd, out, saved = capture.forward(run)
    if not grad:
        return Captured(static, out, [], fwd)
    grad_out = torch.zeros_like(out)
    bwd, found = capture.backward(out, leaves, grad_out)
    grads = [None] * len(inputs)
    for i, g in zip(differentiable, found):
        grads[i] = g
    kept = {t.detach().untyped_storage().data_ptr() for t in saved}
    tracked = tuple(i for i, t in enumerate(static) if t.untyped_storage().data_ptr() in kept)
    return Captured(static, out.detach(), _internal(saved, static), fwd, bwd, grad_out, grads, tracked)


def _internal(saved, static) -> list:
    """The saved tensors that are not (views of) the graphs' inputs, each once: what a call must keep a copy of."""
    inputs = {t.untyped_storage().data_ptr() for t in static}
    kept, seen = [], set()
    for t in saved:
        t = t.detach()
        if t.untyped_storage().data_ptr() in inputs:
            continue
        k = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if k not in seen:
            seen.add(k)
            kept.append(t)
    return kept


__all__ = ["record", "Replay", "Captured", "replay_lock", "WARMUP_RUNS"]
