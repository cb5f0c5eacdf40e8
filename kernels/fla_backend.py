"""``"fla"`` backend: fla-core's Triton chunk kernels (CUDA), our Triton kernels for the rest.

We call fla's chunk forward/backward functions (``fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_fwd``
/ ``_bwd``) directly: that skips fla's top-level dispatch only, so fla's backend registry never hands the
whole call to FlashQLA behind our back (``FLA_FLASH_QLA`` does not matter). The steps inside them still go
through fla's own dispatch (``fla.backends``): on an NPU (Triton's active target ``npu``) 11 of them run
fla's ``triton_ascend`` kernels (docs/kernels.md lists them); elsewhere fla decides by the packages it
finds (e.g. TileLang) and its ``FLA_*`` switches.
Grouped heads are native (fla's GVA: ``Hv % Hk == 0``, q/k never repeated). The q/k L2 norm is our
kernel (``triton/l2norm.py``): fla's buckets the row count into a compile-time autotune key.

Backward recomputes the cheap chunk-local parts (gate cumsum, the WY/UT ``A`` matrices, the L2 norm)
from the inputs instead of keeping them: only the op's inputs are saved for backward.

Reads nothing on the host: fla's chunk index (which sequence and which of its chunks each program of
a chunk kernel runs) is built on the device at the pack's *capacity* (``chunk_index``), so one packed
length T and one sequence count N give one grid whatever the lengths are. That is what lets a CUDA
graph captured on one packing replay any other of the same capacity (docs/performance.md, "CUDA
graphs"), and an eager step never waits for the GPU to drain. (The ``ascend`` backend passes
``index=exact_chunk_index``: fla's ``triton_ascend`` kernels are not made for padding rows.)
fla-core is imported lazily: this module imports anywhere.

Inside a capture (a CUDA graph, or ``torch.compile(mode="reduce-overhead")``'s graph trees) fla's own
identity-keyed ``tensor_cache`` is switched off for the call (``fla.utils.FLA_DISABLE_TENSOR_CACHE``):
it would keep what fla derives from ``cu_seqlens`` (its lengths and chunk offsets) alive in the graph's
memory pool, which the graph trees refuse ("tensors in the cudagraph pool not tracked as outputs").
"""
from __future__ import annotations

import contextlib
import functools
import threading

import torch

from . import cu_cache, reference
from .ops_library import _vjp
from .registry import Backend, register_backend
from .triton_ops import conv_bwd, conv_fwd, gate_bwd, gate_fwd, l2norm_qk_bwd, l2norm_qk_fwd, norm_bwd, norm_fwd

CHUNK = 64


@functools.lru_cache(maxsize=None)
def fla_importable() -> tuple[bool, str]:
    try:
        import fla.ops.gated_delta_rule.chunk  # noqa: F401
        import fla.ops.gated_delta_rule.fused_recurrent  # noqa: F401
    except Exception as e:  # ImportError, or a Triton / driver error at import
        return False, f"fla-core does not import ({type(e).__name__}: {e})"
    return True, ""


def available(device: torch.device) -> tuple[bool, str]:
    if device.type != "cuda":
        return False, "fla's kernels run on CUDA devices only"
    if not torch.cuda.is_available():
        return False, "this torch has no usable CUDA device"
    return fla_importable()


def chunk_index(cu: torch.Tensor, total_len: int, chunk: int = CHUNK) -> torch.Tensor:
    """fla's chunk index for a pack, built on ``cu``'s device with shapes fixed by ``(total_len, N)`` alone.

    Args:
        cu: ``[N + 1]`` integer ``cu_seqlens`` (non-decreasing, ``cu[0] == 0``, ``cu[-1] == total_len``;
            empty segments allowed) on any device. Its values are never read on the host.
        total_len: T, the packed length (a Python int: a shape, not a value).
        chunk: fla's chunk size BT.

    Returns:
        ``[cap, 2]`` int64 on ``cu``'s device, ``cap = (T + (BT - 1) * N) // BT`` (0 when T == 0): the most
        chunks N sequences of T tokens in total can have. Row ``j < real`` is ``(sequence, chunk within
        it)`` in pack order, the rows of ``fla.ops.utils.index.prepare_chunk_indices``; each row after them
        names the LAST sequence with a chunk number past its end. fla's GDN chunk kernels mask every load
        and store of such a program by the sequence length (``o_t < T``), so it writes nothing; its only
        unmasked read is the sequence's last token (``bos + T - 1``), in bounds because the last
        sequence ends at T > 0. (fla's own ``prepare_chunk_indices_static`` marks padding with sequence
        -1, which only its KDA kernels check for.) Cost: at most N more programs per chunk kernel than
        the exact index, each a chunk of masked work.
    """
    n = cu.numel() - 1
    cap = (total_len + (chunk - 1) * n) // chunk if total_len > 0 else 0
    lens = (cu[1:] - cu[:-1]).to(torch.int64)
    counts = (lens + (chunk - 1)).div(chunk, rounding_mode="floor")
    ends = counts.cumsum(0)
    slots = torch.arange(cap, device=cu.device, dtype=torch.int64)
    seq = torch.searchsorted(ends, slots, right=True).clamp_(max=max(n - 1, 0))
    return torch.stack([seq, slots - (ends - counts)[seq]], 1)


def _varlen(cu, total_len):
    """fla's chunk index for packed sequences (``chunk_index``), or None for a dense batch: built once
    per ``cu`` tensor and length (``cu_cache``; inside a CUDA graph capture, in the graph), reused by
    every layer and the backward."""
    if cu is None:
        return None
    return cu_cache.derived(cu, ("fla_chunk_index", CHUNK, total_len), lambda: chunk_index(cu, total_len))


def exact_chunk_index(cu, total_len):
    """fla's own exact chunk index (``prepare_chunk_indices``: one host read of ``cu`` per tensor), or None
    for a dense batch: for kernels not checked against ``chunk_index``'s padding rows. fla's
    ``triton_ascend`` chunk kernels (the ``ascend`` backend) find each task's sequence from the chunk
    offsets and would read past ``cu_seqlens`` for a padding row."""
    if cu is None:
        return None

    def build():
        from fla.ops.utils.index import prepare_chunk_indices
        return prepare_chunk_indices(cu, CHUNK, cu_seqlens_cpu=cu_cache.host_copy(cu))
    return cu_cache.derived(cu, ("fla_exact_chunk_index", CHUNK), build)


_switch_lock = threading.Lock()
_switch = {"depth": 0, "before": False}


@contextlib.contextmanager
def _fla_cache_off_in_capture(t: torch.Tensor):
    """fla's ``tensor_cache`` off for this call while ``t``'s device captures (see the module docstring);
    overlapping captures (other threads, nesting) share one switch: off from the first entry, put back
    as it was at the last exit."""
    if not cu_cache.capturing(t):
        yield
        return
    import fla.utils
    with _switch_lock:
        if _switch["depth"] == 0:
            _switch["before"] = getattr(fla.utils, "FLA_DISABLE_TENSOR_CACHE", False)
        fla.utils.FLA_DISABLE_TENSOR_CACHE = True   # (at every entry: someone may have switched it back meanwhile)
        _switch["depth"] += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch["depth"] -= 1
            if _switch["depth"] == 0:
                fla.utils.FLA_DISABLE_TENSOR_CACHE = _switch["before"]


def _fla_cache_policy(fn):
    """``fn(q, ...)`` run under ``_fla_cache_off_in_capture(q)`` (``q``: the first tensor argument)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if first is None:
            return fn(*args, **kwargs)
        with _fla_cache_off_in_capture(first):
            return fn(*args, **kwargs)
    return wrapper


def _prep(q, k, v, beta, use_qk_l2norm):
    if use_qk_l2norm:
        q, k = l2norm_qk_fwd(q, k)   # one launch for both
    return q.contiguous(), k.contiguous(), v.contiguous(), beta.contiguous()


def _state(initial_state):
    return None if initial_state is None else initial_state.float().contiguous()


@_fla_cache_policy
def chunk_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu=None,
              use_qk_l2norm=False, index=_varlen):
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    qn, kn, v, beta = _prep(q, k, v, beta, use_qk_l2norm)
    _, o, _, final, _, _ = chunk_gated_delta_rule_fwd(
        q=qn, k=kn, v=v, g=g.float().contiguous(), beta=beta, scale=scale, initial_state=_state(initial_state),
        output_final_state=output_final_state, cu_seqlens=cu, chunk_indices=index(cu, q.shape[1]), chunk_size=CHUNK)
    return o, final


@_fla_cache_policy
def chunk_bwd(do, dfinal, q, k, v, g, beta, scale=None, initial_state=None, cu=None, use_qk_l2norm=False,
              index=_varlen):
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2
    qn, kn, v, beta = _prep(q, k, v, beta, use_qk_l2norm)
    ci = index(cu, q.shape[1])
    g_cum = chunk_local_cumsum(g.float().contiguous(), chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu,
                               chunk_indices=ci)
    _, _, A = chunk_gated_delta_rule_fwd_intra(k=kn, v=v, g=g_cum, beta=beta, cu_seqlens=cu, chunk_indices=ci,
                                               chunk_size=CHUNK)
    dq, dk, dv, db, dg, dh0, _, _ = chunk_gated_delta_rule_bwd(
        q=qn, k=kn, v=v, g=g_cum, beta=beta, A=A, scale=scale, initial_state=_state(initial_state),
        do=do.contiguous(), dht=None if dfinal is None else dfinal.float().contiguous(), cu_seqlens=cu,
        chunk_indices=ci, chunk_size=CHUNK)
    if use_qk_l2norm:
        dq, dk = l2norm_qk_bwd(q, k, dq, dk)
    return dq, dk, dv, dg, db, dh0


@_fla_cache_policy
def recurrent_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu=None,
                  use_qk_l2norm=False):
    from fla.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule_fwd
    return fused_recurrent_gated_delta_rule_fwd(
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.float().contiguous(), beta=beta.contiguous(),
        scale=scale, initial_state=_state(initial_state), output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu)


def recurrent_bwd(do, dfinal, q, k, v, g, beta, scale=None, initial_state=None, cu=None, use_qk_l2norm=False):
    """fla's fused recurrent kernel has no backward: gradients of the torch reference (decode-sized inputs)."""
    out_state = dfinal is not None

    def f(q, k, v, g, beta, h0):
        o, fin = reference.recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=h0,
                                                      output_final_state=out_state, cu=cu,
                                                      use_qk_l2norm=use_qk_l2norm)
        return (o, fin) if out_state else (o,)

    return _vjp(f, (q, k, v, g, beta, initial_state), (do, dfinal)[:1 + out_state])


# The split conv (one launch for q, k and v, ``conv_splits``) stays off: its masked per-part kernels take 1.80x
# the forward and 1.11x the backward of the whole conv (H200, C = 8192, 32k tokens, 2026-12-02:
# ``python benchmarks/bench_triton_conv.py --quick``; docs/performance.md). Addressing the parts by a select of
# pointers per column instead is slower still (8.7x in the layer's forward).
CONV_SPLITS = False


def make_backend():
    return Backend(
        name="fla", chunk_gated_delta_rule=chunk_fwd, recurrent_gated_delta_rule=recurrent_fwd,
        causal_conv1d=conv_fwd, gated_rms_norm=norm_fwd, available=available, priority=10,
        gdn_gate=gate_fwd, chunk_gated_delta_rule_bwd=chunk_bwd, recurrent_gated_delta_rule_bwd=recurrent_bwd,
        causal_conv1d_bwd=conv_bwd, gdn_gate_bwd=gate_bwd, gated_rms_norm_bwd=norm_bwd, dense_as_packed=True,
        grads_into=True, conv_splits=CONV_SPLITS, conv_l2norm=True)


register_backend(make_backend())
