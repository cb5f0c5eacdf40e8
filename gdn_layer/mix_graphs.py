"""The layer's token mixing (conv + gate, delta rule, gated norm) replayed from CUDA graphs, one per call signature.

An eager GatedDeltaNet call launches tens of small kernels, each through Python (fla's wrappers, Triton's
dispatch, our custom ops, autograd). At a few thousand tokens that host work takes several times the GPU's
(docs/performance.md, "Host cost per layer call"). This module removes it from the eager call without asking
anything of the caller: the part of the layer between its input projections and its output projection,

    ``mix(mixed [B, T, C + 2 Hv], z [B, T, Hv, Dv], cu_seqlens) -> o [B, T, Hv, Dv]``
    (causal conv + SiLU and the gate, the chunked delta rule, the gated RMSNorm),

is captured once per *signature* into a forward graph (and, with autograd recording, a backward graph), and
later calls of that signature replay them. Where the projections are plain bias-free ``nn.Linear`` modules of the
split layout (no SP), the graphs hold the whole call instead (``try_layer``: ``whole``, the projections and
``out_proj`` around ``mix``); else the projections run as modules around a replay of ``mix`` (``try_mix``).

**Signature.** The layer's configuration (class and ``extra_repr``: heads, dims, backend), the norm's eps, the
scope (whole call or mixing), the shapes, dtypes and device of the inputs and of the parameters the graph reads
(conv weight, ``A_log``, ``dt_bias``, norm weight; the projection weights), which of them need gradients, and
the packing's *capacity*: ``T`` and the number of
sequences rounded up to a power of two (at least 8). ``cu_seqlens`` is padded on the device to that capacity
(``pad_cu_seqlens``: empty segments, no host read), so every packing of the same ``T`` and a similar document
count replays one graph. Nothing of a layer *instance* is captured: the parameters are copied into the graph's
inputs at every call, so all layers of one configuration share one capture.

**What a replay costs on top of the kernels.** Copies in of the inputs (``hidden_states`` or ``mixed`` and ``z``),
``cu_seqlens`` and the parameters; a copy out of the output; with autograd recording, a copy out of every tensor
the captured forward saved for its backward (recorded at capture with ``saved_tensors_hooks``) and, in the
backward, the same copies back in plus the gradients out. The copies run on the GPU, one multi-tensor launch per
dtype (``mix_capture.copy_all``). Since each call keeps its own
copies, replays of one graph by many layers, in any order of forwards and backwards (activation checkpointing
included), give each call its own eager gradients.

**When a call replays** (else it runs eagerly, the same math): CUDA; graphs switched on (``enabled()``; the
environment variable ``GDN_MIX_GRAPHS=0`` or ``set_enabled(False)`` switches them off); one rank (no SP or CP);
no ``state``, ``output_state``, ``token_order`` or state pool; more than one token per sequence (decode steps
have ``DecodeGraph``); no autocast; not while ``torch.compile`` traces or another CUDA graph captures; the
layer's gate norm is the silu ``GatedRMSNorm`` without hooks; plain tensors and parameters (no DTensor or other
subclass); the signature was seen ``CAPTURE_AFTER`` times
before (a one-off shape never pays a capture). Not where FlashQLA runs the chunk op (Hopper, bf16/fp16,
``Dk = Dv = 128``): a graph would run fla's chunk kernels (FlashQLA reads ``cu_seqlens`` on the host), and at
Qwen3-Next's shape their GPU time exceeds the host time saved (docs/performance.md). At most ``MAX_SIGNATURES`` captures
are kept per process (least recently used dropped). A capture that fails (an op that cannot be captured) marks
its signature eager for good and warns once.

**Memory.** Each capture has its own CUDA memory pool: about one eager call's temporaries and saved tensors per
kept signature, given back when the signature is dropped (least recently used beyond ``MAX_SIGNATURES``, or
``clear()``).
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections import OrderedDict

import torch
import torch.nn.functional as F

from gdn_layer import mix_capture
from gdn_layer.derived import capturing
from gdn_layer.in_projection import plain_linear, split_projections
from gdn_layer.kernels import gated_rms_norm
from gdn_layer.kernels.ops_delta_rule import dense_cu
from gdn_layer.kernels.validation import validation_enabled
from gdn_layer.parallel import pad_cu_seqlens
from gdn_layer.state import autograd_records
from gdn_layer.submodules import conv_weight, unhooked

CAPTURE_AFTER = 2        # calls of a signature that run eagerly before it is captured
MAX_SIGNATURES = 8       # captures kept per process
MIN_CAPACITY = 8         # the smallest number of sequences a capture is made for

_enabled = os.environ.get("GDN_MIX_GRAPHS", "1") != "0"
_lock = threading.RLock()
_kept: OrderedDict = OrderedDict()   # signature -> mix_capture.Captured, or None (failed: eager for good)
_seen: OrderedDict = OrderedDict()   # signature -> calls so far, before its capture
_stats = {"captures": 0, "replays": 0}
_paused = [0]                        # open paused() blocks
_DEVICES = ("cuda",)   # the CPU tests add "cpu" (with a stand-in capture: gdn_layer.mix_capture._capturer)


def enabled() -> bool:
    """Whether eligible CUDA calls replay captured graphs (default True; ``GDN_MIX_GRAPHS=0`` at import: False;
    False inside ``paused()``)."""
    return _enabled and _paused[0] == 0


def set_enabled(on: bool) -> bool:
    """Switch the graphs on or off for every layer (the captures kept stay until ``clear()``); returns the
    previous setting. Raises TypeError: ``on`` not a bool."""
    global _enabled
    if not isinstance(on, bool):
        raise TypeError(f"on must be a bool, got {type(on).__name__}")
    before, _enabled = _enabled, on
    return before


@contextlib.contextmanager
def paused():
    """Every call op by op inside, in every thread (``make_graphed_layers`` warms its layers up eagerly before
    capturing them: no mix capture is made for calls that will replay the layer's own graphs). Nests."""
    with _lock:
        _paused[0] += 1
    try:
        yield
    finally:
        with _lock:
            _paused[0] -= 1


def clear() -> None:
    """Drop every capture and count, ``stats()`` included (frees their memory pool once nothing else holds it)."""
    with _lock:
        _stats.update(captures=0, replays=0)
        _kept.clear()
        _seen.clear()


def stats() -> dict:
    """``{"captures": n, "replays": n, "kept": n}`` since the last ``clear()`` (tests and benchmarks)."""
    return dict(_stats, kept=sum(c is not None for c in _kept.values()))


# ---------------------------------------------------------------------------------------------------------------
# the mix itself: the same calls as the layer's eager path, every parameter an argument


def mix(layer, mixed, z, cu, weight, A_log, dt_bias, norm_weight):
    """``o [B, T, Hv, Dv]``: conv + gate, delta rule and gated norm of one call (no states)."""
    q, k, v, g, beta, _ = layer._conv_gate(mixed, cu, None, False, params=(weight, A_log, dt_bias))
    o, _ = layer._delta_rule(q, k, v, g, beta, cu, None, False)
    return gated_rms_norm(o, z, norm_weight, layer.norm.eps, backend=layer.norm.backend)


def whole(layer, x, cu, w_qkv, w_a, w_b, w_z, weight, A_log, dt_bias, norm_weight, w_out):
    """``y [B, T, hidden]``: the layer's eager dataflow for the split layout without SP or states (projections,
    ``mix``, output projection), every parameter an argument."""
    mixed, z = split_projections(x, w_qkv, w_a, w_b, w_z)
    o = mix(layer, mixed, z.reshape(*x.shape[:2], layer.num_v_heads, layer.head_v_dim), cu, weight, A_log,
            dt_bias, norm_weight)
    return F.linear(o.flatten(2), w_out)


def _params(layer) -> tuple:
    """The tensors the mix reads: conv weight ``[C, W]`` (a view of ``conv1d.weight``), ``A_log``, ``dt_bias``,
    norm weight."""
    return conv_weight(layer.conv1d).squeeze(1), layer.A_log, layer.dt_bias, layer.norm.weight


def _capacity(n: int) -> int:
    """The number of sequences a capture for ``n`` is made for: a power of two, at least ``MIN_CAPACITY``."""
    return max(MIN_CAPACITY, 1 << max(n - 1, 0).bit_length())


def _plain_norm(norm) -> bool:
    """The silu ``GatedRMSNorm`` as the class defines it: the replay computes it without calling the module, so
    a hook (the module's or a global one) or a ``forward`` replaced on the instance would be skipped."""
    from gdn_layer.norm import GatedRMSNorm
    return type(norm) is GatedRMSNorm and norm.gate == "silu" and "forward" not in norm.__dict__ and unhooked(norm)


def _saved_tensor_hooks_active() -> bool:
    """Whether autograd packs saved tensors through hooks now (activation checkpointing, ``save_on_cpu``,
    offloading): such a caller may compare what a call saves with what its recomputation saves, and a capture
    would run the caller's hooks over the capture's own tensors."""
    query = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if query is None:            # torch before 2.8 has no such (private) query: assume hooks, run op by op
        return True
    try:
        return query(False) is not None
    except TypeError:            # a form without the argument
        return query() is not None


def may_replay(t: torch.Tensor) -> bool:
    """What every replay needs, the decode steps' too (gdn_layer/decode_replay.py): graphs on, a device that has
    them, no autocast, no capture under way, validation off (value checks do not run inside a capture)."""
    return (enabled() and t.device.type in _DEVICES and not torch.is_autocast_enabled(t.device.type)
            and not capturing(t) and not validation_enabled())


def _eligible(layer, mixed, capacity: int, state, output_state, held) -> bool:
    """Everything except the signature's count (module docstring); ``capacity``: the sequences a capture of this
    call holds (``_capacity``)."""
    if not (may_replay(mixed) and state is None and output_state is False and held is None
            and layer.sp_size == 1 and layer.cp_size == 1):
        return False
    if not _own_methods(layer, ("_conv_gate", "_delta_rule")):
        return False
    # more tokens than the capacity's sequences: no call inside the graph may take the decode path, whose
    # choice comes from the (padded) shapes
    if mixed.shape[0] * mixed.shape[1] <= capacity:
        return False
    if not _plain_norm(layer.norm) or _saved_tensor_hooks_active():
        return False
    if getattr(layer.conv1d, "_hf_hook", None) is not None:   # accelerate offload: the weight moves per call
        return False
    if _flash_qla_would_run(layer, mixed):   # a capture would run fla's chunk kernels, slower (docs/performance.md)
        return False
    return True


def _own_methods(layer, names) -> bool:
    """The layer's ``names`` are this library's (its classes', none replaced on the instance): the graph of a
    signature runs the methods of the call it was captured from, so a user's override (reading its own parameters
    or attributes, which are no graph input) would be baked into every layer sharing the signature."""
    return all(name not in layer.__dict__ and getattr(type(layer), name).__module__.startswith("gdn_layer.")
               for name in names)


def _flash_qla_would_run(layer, mixed) -> bool:
    from gdn_layer.kernels.registry import backend_name
    if backend_name(layer._backend, mixed.device) != "flash_qla":
        return False
    return mixed.dtype in (torch.bfloat16, torch.float16) and layer.head_k_dim == layer.head_v_dim == 128


def _signature(layer, scope: str, tensors, capacity: int, cu_dtype, grad: bool) -> tuple:
    def of(t):
        return (tuple(t.shape), t.dtype)
    return (type(layer), layer.extra_repr(), layer.norm.eps, layer.norm.backend, tensors[0].device, scope,
            tuple(of(t) for t in tensors), cu_dtype, capacity, grad,
            tuple(t.requires_grad for t in tensors) if grad else ())


def plain_tensors_on(device, tensors) -> bool:
    """Plain tensors and parameters on ``device``: DTensor (FSDP2), other subclasses, another device run op by op
    (the decode replays' rule too)."""
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.device == device for t in tensors)


def try_layer(layer, x, cu, state, output_state, held):
    """``y [B, T, hidden]`` of the whole call from a replay, the projections included (the split layout with plain
    bias-free ``nn.Linear`` projections, no SP), or None (then ``try_mix`` is asked after the
    projections). Raises nothing of its own: the inputs were checked."""
    if torch.compiler.is_compiling():   # (first: nothing below is traced)
        return None
    from gdn_layer.layer import GatedDeltaNet
    if (layer.projection_layout != "split" or layer.sp_size != 1 or "_project" in layer.__dict__
            or type(layer)._project is not GatedDeltaNet._project):
        return None                                 # (a subclass with projections of its own: OLMo-Hybrid's)
    projections = (layer.in_proj_qkv, layer.in_proj_a, layer.in_proj_b, layer.in_proj_z, layer.out_proj)
    if not all(plain_linear(m) for m in projections):   # (their dtypes are x's: check_inputs, outside autocast)
        return None
    B, T = x.shape[:2]
    capacity = _capacity(B if cu is None else cu.numel() - 1)
    if not _eligible(layer, x, capacity, state, output_state, held):
        return None
    params = (*(m.weight for m in projections[:4]), *_params(layer), projections[4].weight)
    if not plain_tensors_on(x.device, (x, *params)):
        return None
    if cu is None:   # B rows of T tokens: one pack [0, T, ..., B T] (every op is per token or per sequence)
        x, cu = x.reshape(1, B * T, -1), dense_cu(B, T, x.device)
    cu = pad_cu_seqlens(cu, capacity)
    y = _replay(layer, "layer", whole, (x, cu, *params), cu, capacity)
    return None if y is None else y.view(B, T, -1)


def try_mix(layer, mixed, z, cu, state, output_state, held):
    """The mix of this call from a replay, or None where the call runs eagerly (module docstring). ``B`` rows
    without ``cu_seqlens`` run as one pack of ``B`` sequences."""
    if torch.compiler.is_compiling():   # (first: nothing below is traced; a traced capacity would guard on N)
        return None
    B, T = mixed.shape[:2]
    capacity = _capacity(B if cu is None else cu.numel() - 1)
    if not _eligible(layer, mixed, capacity, state, output_state, held):
        return None
    params = _params(layer)
    if not plain_tensors_on(mixed.device, (z, *params)):
        return None
    if cu is None:   # [0, T, ..., B T], kept per shape (the graph reads its own copy, so it may be dropped)
        mixed, z, cu = mixed.reshape(1, B * T, -1), z.reshape(1, B * T, *z.shape[2:]), dense_cu(B, T, mixed.device)
    cu = pad_cu_seqlens(cu, capacity)
    o = _replay(layer, "mix", mix, (mixed, z, cu, *params), cu, capacity)
    return None if o is None else o.view(B, T, *o.shape[2:])


def _replay(layer, scope, fn, inputs, cu, capacity):
    """``fn(layer, *inputs)`` from its signature's capture, or None: not yet captured (the first
    ``CAPTURE_AFTER`` calls, and inside a backward) or a capture that failed. ``cu``: the padded ``cu_seqlens``,
    one of ``inputs`` (its values are no part of the signature; every other input's shape, dtype and
    ``requires_grad`` are)."""
    tensors = tuple(t for t in inputs if t is not cu)
    grad = autograd_records(tensors[0], tensors[1:])
    key = _signature(layer, scope, tensors, capacity, cu.dtype, grad)
    with _lock:
        captured = _kept.get(key, False)
        if captured is None:                        # a failed capture: eager for good
            return None
        if captured is False:
            count = _seen.pop(key, 0) + 1
            _seen[key] = count
            while len(_seen) > 4 * MAX_SIGNATURES:
                _seen.popitem(last=False)
            if count <= CAPTURE_AFTER or torch._C._current_graph_task_id() != -1:   # (no capture inside a backward)
                return None
            del _seen[key]
            captured = _capture(layer, fn, inputs, grad, key)
            if captured is None:
                return None
        _kept.move_to_end(key)
        _stats["replays"] += 1
    if not grad:
        with torch.no_grad():
            return captured.forward(inputs)[0]
    return mix_capture.Replay.apply(captured, *inputs)


def _capture(layer, fn, inputs, grad, key):
    """Capture ``key``'s graphs from this call's ``inputs`` (copies of them), keep and return them; None (and a
    warning, once per signature) where the capture fails."""
    try:
        with mix_capture.replay_lock, torch.inference_mode(False), torch.enable_grad() if grad else torch.no_grad():
            captured = mix_capture.record(lambda *t: fn(layer, *t), inputs, grad)
    except Exception as error:  # noqa: BLE001 - any op that cannot be captured: this signature runs eagerly
        _kept[key] = None
        failed = [k for k, c in _kept.items() if c is None]
        for k in failed[:-4 * MAX_SIGNATURES]:
            del _kept[k]
        what = "this call signature" if fn is whole else "the token mixing of this call signature"
        warnings.warn(f"GatedDeltaNet: {what} runs eagerly; its CUDA graph capture failed "
                      f"({type(error).__name__}: {error})", RuntimeWarning, stacklevel=5)
        return None
    _kept[key] = captured
    _stats["captures"] += 1
    while sum(c is not None for c in _kept.values()) > MAX_SIGNATURES:
        oldest = next(k for k, c in _kept.items() if c is not None)
        del _kept[oldest]
    return captured


__all__ = ["enabled", "set_enabled", "paused", "clear", "stats", "may_replay", "plain_tensors_on", "try_layer", "try_mix", "mix", "whole", "CAPTURE_AFTER",
           "MAX_SIGNATURES"]
