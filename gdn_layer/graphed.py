"""Each GatedDeltaNet of a model in its own CUDA graph at a fixed capacity; the rest of the model stays eager.

A GDN layer's eager forward+backward launches tens of small kernels, and at a few thousand tokens the host
(Python, autograd, launches) takes longer than the GPU does (docs/performance.md: about 6.6 ms of host time per
fine-tune-shape layer call at 8 192 tokens against 1 ms of kernels). Capturing the whole training step removes
that cost, but many models cannot be captured whole (host-side control flow, data-dependent shapes, hooks).
``make_graphed_layers`` captures only the GDN layers: each one's forward and backward become one CUDA-graph
replay each, at a fixed *capacity* (``hidden_states [1, tokens, hidden]``, ``cu_seqlens`` padded on the device to
``max_num_seqs + 1`` entries with empty segments, ``gdn_layer.parallel.pad_cu_seqlens``). Every packing of that
capacity (any number of documents up to ``max_num_seqs``, any lengths) replays the same graphs with no host read.

The capture is ``torch.cuda.make_graphed_callables`` (all layers together, one memory pool, in the order given).
Around it this module adds what that API leaves to the caller, each of which would otherwise be a silent error:

- **Gradients are the caller's.** ``make_graphed_callables`` returns its static gradient buffers; autograd may
  keep such a buffer as a leaf's ``.grad``, and the next replay then overwrites it, so gradient accumulation over
  micro-batches (or ``zero_grad(set_to_none=False)``) gives wrong sums (PyTorch issue #181723), and
  ``torch.autograd.grad`` returns the buffers themselves. Here the input's gradient and every parameter gradient
  are copies.
- **The output is the caller's.** The replay writes a static buffer; the layer returns a copy of it.
- **Order.** The captures share one memory pool, so a replay may overwrite what an earlier forward of the
  same layer, or of a later-captured layer, saved for its backward (``_Order`` models which). A backward whose
  activations may have been overwritten raises ``RuntimeError`` instead of returning wrong gradients. Layers
  that run forward in capture order and backward in reverse (one forward and backward of a model) always pass,
  also under activation checkpointing of either kind.
- **Parameters.** The graphs read the captured parameters' memory: a parameter replaced since the capture, or
  changed in place between a forward and its backward, makes the call or the backward raise.

Calls outside the capacity run the layer's eager forward, with the same results: eval mode, no grad or
inference mode, another shape or dtype of ``hidden_states``, more than ``max_num_seqs`` sequences, a ``state``,
``output_state``, ``token_order``, autocast, inside ``torch.compile`` or another CUDA-graph capture.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from gdn_layer import mix_graphs
from gdn_layer.checks import check_local
from gdn_layer.parallel import pad_cu_seqlens
from gdn_layer.parallel.packing import positive_int


def _cuda_capture(wrappers: tuple, samples: tuple) -> tuple:
    """The capture: ``torch.cuda.make_graphed_callables`` over all layers at once (one memory pool)."""
    return torch.cuda.make_graphed_callables(wrappers, samples)


_capture = _cuda_capture   # the CPU tests put a stand-in here that keeps the API's static-buffer semantics


class _Positional(nn.Module):
    """The eager layer as ``forward(x, cu)``: ``make_graphed_callables`` passes positional tensors and takes the
    module's parameters (the layer's) as the graph's other inputs."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, cu):
        from gdn_layer.layer import GatedDeltaNet
        # the base class's forward, also for subclasses (the transformers adapter's takes other arguments); it
        # runs only during the capture, before the layer is marked graphed, so it is the eager layer
        return GatedDeltaNet.forward(self.layer, x, cu_seqlens=cu)


class _Order:
    """Which forward replay's saved activations each capture's memory holds intact, modelling the shared pool.

    The forwards were captured in order 0..N-1 and the backwards in order N-1..0, so what forward k saves for
    its backward lies in memory that the temporaries of every capture outside the span fwd_k..bwd_k may use:
    those of the layers captured before k. A replay of capture k (forward or backward) therefore overwrites
    what the layers captured after k saved; a backward replay also frees what its own forward saved (the
    backward capture released it as it went). A backward checks that its forward's replay is the one whose
    activations are still there."""

    def __init__(self):
        self.valid: dict[int, int] = {}   # capture index -> id of the forward replay whose activations are intact
        self.count = 0

    def _overwrite_after(self, index: int) -> None:
        self.valid = {i: r for i, r in self.valid.items() if i <= index}

    def forward(self, index: int) -> int:
        self.count += 1
        self._overwrite_after(index)
        self.valid[index] = self.count
        return self.count

    def backward(self, index: int, replay: int) -> None:
        if self.valid.get(index) != replay:
            raise RuntimeError(
                f"graphed GatedDeltaNet (capture index {index}): the activations this backward needs were "
                "overwritten by a later replay (a forward of this layer or of one captured before it, or a "
                "backward of one captured before it), or this forward's backward already ran. With "
                "gdn_layer.make_graphed_layers, run each forward's backward before its layer runs forward again, "
                "and the layers forward in capture order (docs/layer.md, 'CUDA graphs per layer').")
        self._overwrite_after(index - 1)


class _InputCopy(torch.autograd.Function):
    """Identity forward; the backward hands on a copy of the static input-gradient buffer."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.clone()


class _OutputCopy(torch.autograd.Function):
    """A copy of the static output buffer; the backward first checks that the forward's state is intact and
    that no parameter was changed in place since the forward (the replayed backward reads the live weights)."""

    @staticmethod
    def forward(ctx, y, order, index, replay, params):
        ctx.order, ctx.index = order, index
        ctx.params, ctx.versions = params, [p._version for p in params]
        # the replay's id is saved like an activation: non-reentrant activation checkpointing recomputes it
        # with the layer and hands this node the id of the recompute, the replay whose activations it reads
        ctx.save_for_backward(torch.tensor(replay))
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        if [p._version for p in ctx.params] != ctx.versions:
            raise RuntimeError(
                f"graphed GatedDeltaNet (capture index {ctx.index}): a parameter was modified in place between "
                "this forward and its backward (an optimizer step?); the backward would mix the new weights "
                "with the old activations. Step the optimizer after the backward.")
        replay, = ctx.saved_tensors
        ctx.order.backward(ctx.index, int(replay))     # a CPU tensor: no device sync
        return grad, None, None, None, None


def _none():
    return None


class GraphedCall:
    """One layer's captured forward/backward and its capacity (``layer._graphed``; ``make_graphed_layers``)."""

    def __init__(self, graphed, order: _Order, index: int, params: list, sample: torch.Tensor, max_num_seqs: int,
                 whole: torch.Tensor):
        self.graphed, self.order, self.index = graphed, order, index
        self.params = params          # the objects the graphs' autograd Function takes (and their memory)
        self.signature = [(p.data_ptr(), p.requires_grad) for p in params]
        self.shape, self.dtype, self.device = sample.shape, sample.dtype, sample.device   # hidden_states captured
        self.max_num_seqs = max_num_seqs
        self.whole = whole            # [0, T, T, ...]: the padded cu_seqlens of one sequence (cu_seqlens=None)
        self.hooks = [p.register_hook(_copy_grad) for p in params if p.requires_grad]
        self.replays = 0              # forward replays since the capture (count_replays)

    def applies(self, layer, x, cu, state, output_state, token_order) -> bool:
        """Whether this call is one of the capacity (else the layer runs eagerly). A training call with a
        state warns (once per process): it is most likely a transformers model trained with
        ``use_cache=True``, whose every step would otherwise run eagerly without a word."""
        if state is not None and layer.training and torch.is_grad_enabled():
            warnings.warn(_STATE_IN_TRAINING, UserWarning, stacklevel=3)
        return (layer.training and torch.is_grad_enabled() and state is None and output_state is False
                and token_order is None and isinstance(x, torch.Tensor) and x.shape == self.shape
                and x.dtype == self.dtype and x.device == self.device
                and (cu is None or (isinstance(cu, torch.Tensor) and cu.dim() == 1
                                    and cu.numel() <= self.max_num_seqs + 1))
                and not torch.is_autocast_enabled(self.device.type)
                and not torch.compiler.is_compiling()
                and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()))

    def __call__(self, layer, x, cu):
        now = list(layer.parameters())
        if (len(now) != len(self.params) or any(p is not q for p, q in zip(now, self.params))
                or [(p.data_ptr(), p.requires_grad) for p in now] != self.signature):
            raise RuntimeError(
                "graphed GatedDeltaNet: a parameter was replaced, moved or had requires_grad changed since "
                "gdn_layer.make_graphed_layers captured it (the graphs read the old memory): call "
                "make_graphed_layers again, or release_graphed_layers to run eagerly.")
        cu = self.whole if cu is None else pad_cu_seqlens(check_local(layer, x, cu, None, False), self.max_num_seqs)
        replay = self.order.forward(self.index)
        self.replays += 1
        y = self.graphed(_InputCopy.apply(x), cu)
        return _OutputCopy.apply(y, self.order, self.index, replay, self.params)

    def release(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    # a copy or a pickle of the model is not graphed: its parameters are other tensors
    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (_none, ())


_STATE_IN_TRAINING = (
    "graphed GatedDeltaNet: a training call with a state runs eagerly, not from the captured graphs. A transformers "
    "model passes its cache as the state when use_cache=True (its config's default): set model.config.use_cache = "
    "False (or pass use_cache=False) to train from the graphs; gdn_layer.count_replays(model) counts the replays.")


def _copy_grad(grad: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient hook: the replayed backward hands on a static buffer, which autograd would keep as
    ``.grad`` (when it is None) or return from ``torch.autograd.grad``, and which the next replay overwrites."""
    return grad.clone()


def _layers_of(module: nn.Module) -> list:
    from gdn_layer.layer import GatedDeltaNet
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module (a model or a GatedDeltaNet), got {type(module).__name__}")
    return [m for m in module.modules() if isinstance(m, GatedDeltaNet)]


def make_graphed_layers(module: nn.Module, tokens: int, max_num_seqs: int) -> list:
    """Capture every ``GatedDeltaNet`` in ``module`` (forward and backward) in CUDA graphs at one capacity.

    After this, a training-mode call ``layer(hidden_states, cu_seqlens=cu)`` with grad enabled, ``hidden_states``
    ``[1, tokens, hidden]`` in the dtype of the layer's ``out_proj.weight`` on the layers' GPU and ``cu``
    ``[N + 1]`` int32/int64 with ``N <= max_num_seqs`` (or None: one sequence) replays the layer's captured forward, and its backward replays
    the captured backward: no host read of ``cu``, a few kernel launches instead of the layer's tens. Results
    equal eager calls up to the kernels' rounding (the same kernels run). Other calls run eagerly (module
    docstring). Layers must run forward in the order of ``module.modules()`` and backward in reverse, as one
    forward+backward of a model does (else ``RuntimeError`` at the backward, never wrong gradients).

    Call it after the model is on its GPU in its final dtype, after ``gdn_layer.kernels.warmup()`` if the kernels
    are not compiled yet (the capture warms up too: 3 forward+backward calls per layer), after setting which
    parameters require grad, and before building the optimizer is fine (parameters keep their memory).
    Replacing a parameter afterwards (``.to()``, ``load_state_dict(assign=True)``, FSDP resharding, accelerate
    offload) makes the next replay raise; ``load_state_dict`` (copying in place) and optimizer steps are fine,
    between a backward and the next forward (a parameter changed in place between a forward and its backward
    makes that backward raise, as autograd's version check does in eager mode).
    Forward hooks on the layer's submodules run once, at capture. Calling it again re-captures (e.g. for another
    capacity); ``release_graphed_layers`` returns the layers to eager mode.

    Memory: the graphs' pool keeps one layer's temporaries plus, per layer, its saved activations, its
    static input / output / gradient buffers (``tokens x hidden`` each) and one copy of its parameters' gradients.

    Args:
        module: a model holding GatedDeltaNet layers, or one layer. Layers with ``sp_group`` / ``cp_group`` are
            refused (their all-to-alls and state passing are not captured).
        tokens: ``T``, the packed length of every replayed call.
        max_num_seqs: ``N_max``, the most sequences (documents) a replayed pack may hold.

    Returns:
        The graphed layers, in capture order.

    Raises:
        TypeError / ValueError: a bad argument (``max_num_seqs > tokens`` too), no GatedDeltaNet in ``module``,
            layers not on one CUDA device, a parameter with a gradient hook (register it after the capture), or
            a layer under SP / CP; raised before anything is captured.

    Source: ``torch.cuda.make_graphed_callables`` (PyTorch's per-callable capture); the copies around it follow
    PyTorch issue #181723.
    """
    layers = _layers_of(module)
    tokens = positive_int("tokens", tokens)
    max_num_seqs = positive_int("max_num_seqs", max_num_seqs)
    if max_num_seqs > tokens:
        raise ValueError(f"max_num_seqs must be at most tokens ({tokens}): a pack of {tokens} tokens holds at most "
                         f"{tokens} non-empty sequences, got {max_num_seqs}")
    if not layers:
        raise ValueError(f"module holds no GatedDeltaNet layer ({type(module).__name__})")
    for i, layer in enumerate(layers):
        if layer.sp_size * layer.cp_size > 1:
            raise ValueError(f"layer {i} of module runs under sp_group / cp_group: make_graphed_layers captures "
                             "layers without SP / CP only (their collectives are not captured)")
    devices = {p.device for layer in layers for p in layer.parameters()}
    if _capture is _cuda_capture and (len(devices) != 1 or next(iter(devices)).type != "cuda"):
        raise ValueError("make_graphed_layers captures CUDA graphs: every GatedDeltaNet parameter must be on one "
                         f"CUDA device, got {sorted(str(d) for d in devices)}")
    device = next(iter(devices))
    release_graphed_layers(module)
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if p._backward_hooks:
                raise ValueError(f"layer {i} of module: parameter {name} has a gradient hook (Tensor.register_hook): "
                                 "the capture would bake it into the backward graph and it would run again at every "
                                 "replay; register parameter hooks after make_graphed_layers")

    wrappers = tuple(_Positional(layer) for layer in layers)
    # N_max segments of about equal length
    cu0 = torch.div(torch.arange(max_num_seqs + 1, device=device) * tokens, max_num_seqs,
                    rounding_mode="floor").to(torch.int32)
    samples = [(torch.randn(1, tokens, layer.hidden_size, device=device, dtype=layer.out_proj.weight.dtype,
                            requires_grad=True), cu0.clone()) for layer in layers]
    with mix_graphs.paused():       # its eager warm-up would capture the token mixing for nothing
        graphed = _capture(wrappers, tuple(samples))
    order = _Order()
    whole = pad_cu_seqlens(torch.tensor([0, tokens], dtype=torch.int32, device=device), max_num_seqs)
    for i, (layer, g, (x, _)) in enumerate(zip(layers, graphed, samples)):
        layer._graphed = GraphedCall(g, order, i, list(layer.parameters()), x, max_num_seqs, whole)
    return layers


def release_graphed_layers(module: nn.Module) -> int:
    """Return every graphed GatedDeltaNet in ``module`` to eager calls (its graphs are freed with it).
    Returns the number released."""
    n = 0
    for layer in _layers_of(module):
        entry = layer.__dict__.pop("_graphed", None)
        if entry is not None:
            entry.release()
            n += 1
    return n


def count_replays(module: nn.Module) -> int:
    """The number of forward replays of the graphed GatedDeltaNet layers in ``module`` since their capture (each
    replayed layer call counts one; eager calls count nothing): a check that training calls do replay, e.g.
    that autocast or another ``hidden_states`` shape does not send them to the eager layer."""
    return sum(layer._graphed.replays for layer in _layers_of(module) if layer._graphed is not None)


__all__ = ["make_graphed_layers", "release_graphed_layers", "count_replays", "GraphedCall"]
