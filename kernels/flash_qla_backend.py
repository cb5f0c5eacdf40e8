"""``"flash_qla"`` backend: FlashQLA's fused TileLang chunk kernels (Hopper SM90 / Blackwell SM100).

FlashQLA is eligible per call when q, k, v are bf16/fp16 with ``Dk == Dv == 128``; any other call of
this backend's chunk op runs fla's Triton chunk kernel instead (logged once), so ``backend="auto"``
on a Hopper GPU means "FlashQLA where eligible, else fla". Inside a CUDA graph capture the chunk op is
fla's too (FlashQLA reads ``cu_seqlens`` on the host). Conv, gate, norms: our Triton kernels.

Intra-card context parallelism is OFF (``auto_cp=False``), always: FlashQLA's automatic choice reads
``cu_seqlens`` on the host and switches between kernel variants that each compile for about 100 s on
first use, so a training run met a compile stall the first time the packed layout flipped its
decision. One variant means ``warmup()`` builds everything this backend can run.

flash-qla (and tilelang) import lazily: on a machine without a Hopper/Blackwell GPU its import raises,
and this backend reports itself unavailable with the reason.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import sys

import torch

from . import cu_cache, fla_backend, varlen
from .registry import Backend, register_backend
from .triton_ops import conv_bwd, conv_fwd, gate_bwd, gate_fwd, l2norm_qk_bwd, l2norm_qk_fwd, norm_bwd, norm_fwd

log = logging.getLogger("gdn_layer.kernels")
_FALLBACK_LOGGED: set[str] = set()


@functools.lru_cache(maxsize=None)
def _importable(capability: tuple[int, int]) -> tuple[bool, str]:
    if capability[0] not in (9, 10):
        return False, f"FlashQLA runs forward and backward on SM90/SM100 only, this GPU is SM{capability[0]}{capability[1]}"
    try:
        import flash_qla  # noqa: F401
        from flash_qla.ops.gated_delta_rule import chunk  # noqa: F401
    except Exception as e:
        return False, f"flash-qla does not import ({type(e).__name__}: {e})"
    return True, ""


def available(device: torch.device) -> tuple[bool, str]:
    if torch.device(device).type != "cuda":
        return False, "FlashQLA's kernels run on CUDA devices only (Hopper SM90 / Blackwell SM100)"
    ok, why = fla_backend.available(device)     # a CUDA device, and fla for the calls FlashQLA cannot run
    return _importable(torch.cuda.get_device_capability(device)) if ok else (ok, why)


def eligible(q, k, v) -> str:
    """Empty string when FlashQLA can run these inputs, else the reason it cannot."""
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16)):
        return f"FlashQLA needs q, k, v in one of bf16/fp16 (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return f"FlashQLA needs Dk = Dv = 128 (got Dk = {q.shape[-1]}, Dv = {v.shape[-1]})"
    return ""


_AS_IN_CAPTURE = 0


@contextlib.contextmanager
def as_in_capture():
    """Run the chunk op as during a CUDA graph capture (fla's kernels): ``warmup()`` builds them this way."""
    global _AS_IN_CAPTURE
    _AS_IN_CAPTURE += 1
    try:
        yield
    finally:
        _AS_IN_CAPTURE -= 1


def _why_not(q, k, v) -> str:
    """Why this call runs fla's chunk kernels instead (empty when FlashQLA runs it): inputs FlashQLA cannot
    take (``eligible``), or a CUDA graph capture -- FlashQLA reads ``cu_seqlens`` on the host (its chunk
    layout, and our compaction of empty segments), so a captured graph would keep one packing's layout."""
    why = eligible(q, k, v)
    if not why and (_AS_IN_CAPTURE or cu_cache.capturing(q)):
        why = "a CUDA graph capture: FlashQLA reads cu_seqlens on the host, fla's kernels run in the graph"
    return why


def _compact(cu):
    """FlashQLA 0.1.3 gave NaN outputs for packs with zero-length segments on an H200
    (``cu = [0, 100, 100, 257, 700]``): it is handed the pack without them (``varlen.without_empty_segments``,
    one host read of cu per tensor: ``cu_cache``) and the dropped sequences' states pass through."""
    return None if cu is None else cu_cache.derived(cu, "without_empty_segments",
                                                    lambda: varlen.without_empty_segments(cu))


def _with_layout(cu):
    """``cu`` with FlashQLA's chunk layout attached (its ``prepare_varlen_metadata``, from cu's host values),
    once per tensor: FlashQLA's kernels then read nothing back (its own fallback reads cu on the host at each
    new tensor). The host values cost nothing where they are known (a ``cu_seqlens`` the layer copied from
    the CPU, ``pad_cu_seqlens`` of one, a compaction), else one read per tensor."""
    if cu is None or cu.device.type == "cpu":
        return cu

    def build():
        from flash_qla.utils.index import prepare_varlen_metadata
        prepare_varlen_metadata(cu, cu_cache.host_copy(cu).to(torch.int64))
        return True
    cu_cache.derived(cu, "flash_qla_layout", build)
    return cu


def _kept(t, c):
    """The rows of a per-sequence tensor (state, state gradient) that FlashQLA sees after ``_compact``."""
    return t if t is None or c is None else t.index_select(0, c.keep)


def _fallback(why: str) -> None:
    if why not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(why)
        log.info("flash_qla backend: %s; this call runs fla's Triton chunk kernel", why)


def _prep(q, k, v, g, beta, use_qk_l2norm):
    if use_qk_l2norm:
        q, k = l2norm_qk_fwd(q, k)   # one launch for both
    return q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.contiguous()


def chunk_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu=None,
              use_qk_l2norm=False, residuals=False):
    """The gated delta rule's forward (``reference.chunk_gated_delta_rule``'s signature). ``residuals=True``:
    returns ``(o, final, residuals)``, residuals FlashQLA's chunk-local gate cumsum ``[B, T, Hv]`` fp32 and UT
    matrices ``A [B, T, Hv, 64]`` (q's dtype; B = 1 for a pack, and for a dense call, which ``ops`` hands on as a
    pack) for ``chunk_bwd``, as FlashQLA's own autograd saves them, or ``()`` where fla's kernels or no kernel ran
    (the backward then recomputes)."""
    why = _why_not(q, k, v)
    if why:
        _fallback(why)
        out = fla_backend.chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu, use_qk_l2norm)
        return (*out, ()) if residuals else out
    from flash_qla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    h0 = fla_backend._state(initial_state)
    if q.shape[1] == 0:
        # no tokens at all (a pack of empty segments, or a dense [B, 0] batch, which the op hands on
        # unpacked): FlashQLA is not called, every state passes through (zeros without one, N rows)
        final = None
        if output_final_state:
            n = q.shape[0] if cu is None else cu.numel() - 1
            final = h0.clone() if h0 is not None else torch.zeros(n, v.shape[2], q.shape[-1], v.shape[-1],
                                                                  device=v.device)
        out = v.new_zeros(v.shape), final
        return (*out, ()) if residuals else out
    c = _compact(cu)
    qn, kn, v, g, beta = _prep(q, k, v, g, beta, use_qk_l2norm)
    g_cum, A, o, _, final, _ = chunk_gated_delta_rule_fwd(
        qn, kn, v, g, beta, scale=scale, initial_state=_kept(h0, c), cu_seqlens=_with_layout(cu if c is None else c.cu),
        output_final_state=output_final_state, auto_cp=False)
    if c is not None and output_final_state:
        final = varlen.expand_states(c, final, h0)
    return (o, final, (g_cum, A)) if residuals else (o, final)


def chunk_bwd(do, dfinal, q, k, v, g, beta, scale=None, initial_state=None, cu=None, use_qk_l2norm=False,
              residuals=None):
    """The gradients ``(dq, dk, dv, dg, dbeta, dh0)``; ``residuals``: ``chunk_fwd``'s (gate cumsum, A) for these
    inputs, or None to recompute them. fla's kernels (``_why_not``) ignore them: another layout than fla's."""
    if _why_not(q, k, v):
        return fla_backend.chunk_bwd(do, dfinal, q, k, v, g, beta, scale, initial_state, cu, use_qk_l2norm)
    from flash_qla.ops.gated_delta_rule import chunk as qla
    h0 = fla_backend._state(initial_state)
    dht = None if dfinal is None else dfinal.float().contiguous()
    if q.shape[1] == 0:                             # no tokens (as chunk_fwd): d initial = d final
        dh0 = None if h0 is None else (dht.clone() if dht is not None else torch.zeros_like(h0))
        return (*(torch.zeros_like(t) for t in (q, k, v, g, beta)), dh0)
    c = _compact(cu)
    cu = _with_layout(cu if c is None else c.cu)
    qn, kn, v, g, beta = _prep(q, k, v, g, beta, use_qk_l2norm)
    if residuals is not None:       # the forward's (FlashQLA's autograd saves the same two)
        g_cum, A = residuals
    else:                           # recomputed: the chunk-local cumsum of g and the UT matrices A
        g_cum = qla.chunk_local_cumsum(g=g, cu_seqlens=cu, chunk_size=qla.CHUNK_SIZE)
        A = qla.kkt_solve(k=kn, b=beta, cu_seqlens=cu, chunk_size=qla.CHUNK_SIZE)
    dq, dk, dv, db, dg, dh0 = qla.chunk_gated_delta_rule_bwd(
        qn, kn, v, g_cum, beta, A, do.contiguous(), _kept(dht, c),
        scale=scale, initial_state=_kept(h0, c), cu_seqlens=cu, auto_cp=False)
    if use_qk_l2norm:
        dq, dk = l2norm_qk_bwd(q, k, dq, dk)
    if c is not None and initial_state is not None:
        dh0 = varlen.expand_states(c, dh0, dht)
    return dq, dk, dv, dg, db, dh0


def _target_ctas() -> int:
    """FlashQLA's ``TARGET_NUM_CTAS`` for this GPU (its forward module's constant, 70% of the SMs in 0.1.3)."""
    try:
        from flash_qla.ops.gated_delta_rule import chunk as qla
        return int(sys.modules[qla.fused_gdr_fwd.__module__].TARGET_NUM_CTAS)
    except (ImportError, AttributeError, KeyError):
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count * 0.7)


def warmup_sequence_counts(num_v_heads: int) -> tuple[int, ...]:
    """Sequence counts N that make FlashQLA's forward build each of its kernel variants.

    FlashQLA 0.1.3's forward compiles its V block size (a TileLang compile-time parameter) from the
    number of sequences: 128 when ``N * Hv >= target`` CTAs, 64 when ``2 N Hv >= target``, else 32
    (``target`` = 70% of the SMs, 92 on an H200). A pack of one long document, of two, and of many each
    meet another variant (each ~15-20 s to build cold): ``warmup()`` runs one pack per count returned.
    """
    h, target = max(1, num_v_heads), _target_ctas()
    return tuple(sorted({1, -(-target // (2 * h)), -(-target // h)}))


def make_backend():
    return Backend(
        name="flash_qla", chunk_gated_delta_rule=chunk_fwd, recurrent_gated_delta_rule=fla_backend.recurrent_fwd,
        causal_conv1d=conv_fwd, gated_rms_norm=norm_fwd, available=available, priority=20,
        gdn_gate=gate_fwd, chunk_gated_delta_rule_bwd=chunk_bwd,
        recurrent_gated_delta_rule_bwd=fla_backend.recurrent_bwd, causal_conv1d_bwd=conv_bwd,
        gdn_gate_bwd=gate_bwd, gated_rms_norm_bwd=norm_bwd, dense_as_packed=True, grads_into=True,
        conv_splits=fla_backend.CONV_SPLITS, conv_l2norm=True, chunk_residuals=True,
        warmup_sequence_counts=warmup_sequence_counts, as_in_capture=as_in_capture)


register_backend(make_backend())
