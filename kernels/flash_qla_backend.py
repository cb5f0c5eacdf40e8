"""``"flash_qla"`` backend: FlashQLA's fused TileLang chunk kernels (Hopper SM90 / Blackwell SM100).

FlashQLA is eligible per call when q, k, v are bf16/fp16 with ``Dk == Dv == 128``; any other call of
this backend's chunk op runs fla's Triton chunk kernel instead (logged once), so ``backend="auto"``
on a Hopper GPU means "FlashQLA where eligible, else fla". Conv, gate, norms: our Triton kernels.

Intra-card context parallelism is OFF (``auto_cp=False``), always: FlashQLA's automatic choice reads
``cu_seqlens`` on the host and switches between kernel variants that each compile for about 100 s on
first use, so a training run met a compile stall the first time the packed layout flipped its
decision. One variant means ``warmup()`` builds everything this backend can run.

flash-qla (and tilelang) import lazily: on a machine without a Hopper/Blackwell GPU its import raises,
and this backend reports itself unavailable with the reason.
"""
from __future__ import annotations

import functools
import logging

import torch

from . import fla_backend
from .triton_ops import conv_bwd, conv_fwd, gate_bwd, gate_fwd, l2norm_bwd, l2norm_fwd, norm_bwd, norm_fwd

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
    ok, why = fla_backend.available(device)     # a CUDA device, and fla for the calls FlashQLA cannot run
    return _importable(torch.cuda.get_device_capability(device)) if ok else (ok, why)


def eligible(q, k, v, cu=None) -> str:
    """Empty string when FlashQLA can run these inputs, else the reason it cannot (one host read of
    ``cu``: FlashQLA 0.1.3 gave NaN outputs for packs with zero-length segments on an H200)."""
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.bfloat16, torch.float16)):
        return f"FlashQLA needs q, k, v in one of bf16/fp16 (got {q.dtype}, {k.dtype}, {v.dtype})"
    if q.shape[-1] != 128 or v.shape[-1] != 128:
        return f"FlashQLA needs Dk = Dv = 128 (got Dk = {q.shape[-1]}, Dv = {v.shape[-1]})"
    if cu is not None and bool(((cu[1:] - cu[:-1]).cpu() == 0).any()):
        return "FlashQLA gives NaN for zero-length segments"
    return ""


def _fallback(why: str) -> None:
    if why not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(why)
        log.info("flash_qla backend: %s; this call runs fla's Triton chunk kernel", why)


def _prep(q, k, v, g, beta, use_qk_l2norm):
    if use_qk_l2norm:
        q, k = l2norm_fwd(q), l2norm_fwd(k)
    return q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.contiguous()


def chunk_fwd(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu=None,
              use_qk_l2norm=False):
    why = eligible(q, k, v, cu)
    if why:
        _fallback(why)
        return fla_backend.chunk_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu, use_qk_l2norm)
    from flash_qla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    qn, kn, v, g, beta = _prep(q, k, v, g, beta, use_qk_l2norm)
    _, _, o, _, final, _ = chunk_gated_delta_rule_fwd(
        qn, kn, v, g, beta, scale=scale, initial_state=fla_backend._state(initial_state), cu_seqlens=cu,
        output_final_state=output_final_state, auto_cp=False)
    return o, final


def chunk_bwd(do, dfinal, q, k, v, g, beta, scale=None, initial_state=None, cu=None, use_qk_l2norm=False):
    if eligible(q, k, v, cu):
        return fla_backend.chunk_bwd(do, dfinal, q, k, v, g, beta, scale, initial_state, cu, use_qk_l2norm)
    from flash_qla.ops.gated_delta_rule import chunk as qla
    qn, kn, v, g, beta = _prep(q, k, v, g, beta, use_qk_l2norm)
    dht = None if dfinal is None else dfinal.float().contiguous()
    # recompute the chunk-local cumsum of g and the UT matrices A (cheap) instead of saving them
    g_cum = qla.chunk_local_cumsum(g=g, cu_seqlens=cu, chunk_size=qla.CHUNK_SIZE)
    A = qla.kkt_solve(k=kn, b=beta, cu_seqlens=cu, chunk_size=qla.CHUNK_SIZE)
    dq, dk, dv, db, dg, dh0 = qla.chunk_gated_delta_rule_bwd(
        qn, kn, v, g_cum, beta, A, do.contiguous(), dht,
        scale=scale, initial_state=fla_backend._state(initial_state), cu_seqlens=cu, auto_cp=False)
    if use_qk_l2norm:
        dq, dk = l2norm_bwd(q, dq), l2norm_bwd(k, dk)
    return dq, dk, dv, dg, db, dh0


def make_backend():
    from .registry import Backend
    return Backend(
        name="flash_qla", chunk_gated_delta_rule=chunk_fwd, recurrent_gated_delta_rule=fla_backend.recurrent_fwd,
        causal_conv1d=conv_fwd, gated_rms_norm=norm_fwd, available=available, priority=20,
        gdn_gate=gate_fwd, chunk_gated_delta_rule_bwd=chunk_bwd,
        recurrent_gated_delta_rule_bwd=fla_backend.recurrent_bwd, causal_conv1d_bwd=conv_bwd,
        gdn_gate_bwd=gate_bwd, gated_rms_norm_bwd=norm_bwd, dense_as_packed=True)
