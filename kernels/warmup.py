"""``warmup(layer)``: compile every kernel variant a layer configuration can need, before training.

Our kernels and the chunk libraries specialise only on head counts, head dims, dtypes and a few flags,
never on lengths or sequence counts; so one small run per flag combination builds everything, and a
later packed layout of any total length and count compiles nothing (``examples/compile_check.py``
shows it on a GPU; ``tests/test_triton_compile.py`` on CPU with Triton's real compiler).

The flag combinations: packed (``cu_seqlens``) and dense ``[B, T]`` inputs (the compiled CUDA backends
run a dense batch as a pack of B sequences, so for their chunk kernels this is one variant); with and
without an initial state and a returned state; the decode path (one token per sequence, the recurrent
kernel); each forward and backward. A backend that picks a compiled variant from the number of
sequences (FlashQLA's V block: ``Backend.warmup_sequence_counts``) also gets one pack per such count. Triton's (and tilelang's) disk caches make a second process start
warm.
"""
from __future__ import annotations

import time

import torch


def _backend(layer):
    """The registry entry the layer runs on (None for an unknown name)."""
    from .registry import backend_by_name
    try:
        return backend_by_name(layer.resolved_backend)
    except (KeyError, AttributeError):
        return None


def warmup(layer, dtype: torch.dtype | None = None, include_decode: bool = True, include_states: bool = True) -> float:
    """Run ``layer`` forward and backward over small inputs that cover every kernel variant.

    Args:
        layer: a ``gdn_layer.GatedDeltaNet`` (under SP every rank of its group must call this too: it
            runs the layer's collectives).
        dtype: activation dtype to build for (default: the layer's parameter dtype); another dtype runs
            under ``torch.autocast`` with it, as mixed-precision training does.
        include_decode: also build the decode path (one token per sequence; it carries states, so only
            with ``include_states``).
        include_states: also build the variants that take an initial state and/or return the final
            state (continuing sequences, decode). False builds only what training without states runs
            (one variant of each compiled kernel: FlashQLA's take ~70 s each to build cold on an H200);
            a layer with ``cp_group`` uses states internally, so it always builds them.

    Returns:
        seconds spent. Parameter ``.grad`` fields are left untouched (gradients are taken with
        ``torch.autograd.grad``).
    """
    from gdn_layer.state import GDNState  # the layer's own state type; imported here to keep kernels/ standalone

    p = next(layer.parameters())
    device, dtype = p.device, dtype or p.dtype
    P = layer.sp_size
    params = [q for q in layer.parameters() if q.requires_grad]
    t0 = time.perf_counter()

    def state(n):
        return GDNState(torch.randn(n, layer.conv_dim, layer.conv_kernel_size - 1, device=device),
                        torch.randn(n, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, device=device) * 0.1)

    autocast = (torch.autocast(device.type, dtype=dtype) if dtype != p.dtype
                 else torch.autocast(device.type, enabled=False))

    def run(x, cu, st, out_state, grad=True):
        x = x.requires_grad_(grad)
        with torch.set_grad_enabled(grad), autocast:
            res = layer(x, cu_seqlens=cu, state=st, output_state=out_state)
            y, new = (res if out_state else (res, None))
            if grad:
                loss = y.float().square().mean() + (0 if new is None else new.recurrent_state.square().mean())
                torch.autograd.grad(loss, [x, *params], allow_unused=True)

    T = 2 * 64 * P                                         # two chunks per rank, a boundary mid-chunk
    cu = torch.tensor([0, 37 * P, T], dtype=torch.int64, device=device)
    local = T // P
    combos = ((None, False), (None, True), ("given", True), ("given", False))
    if not include_states and getattr(layer, "cp_size", 1) == 1:
        combos = combos[:1]
    for st, out_state in combos:
        x = torch.randn(1, local, layer.hidden_size, device=device, dtype=dtype)
        run(x, cu, state(2) if st else None, out_state)
        xb = torch.randn(2, local, layer.hidden_size, device=device, dtype=dtype)   # dense batch
        run(xb, None, state(2) if st else None, out_state)
    # packs of other sequence counts where the backend picks a compiled variant from N (FlashQLA's V block)
    counts = getattr(_backend(layer), "warmup_sequence_counts", None)
    extra = [n for n in (counts(layer.heads.v_heads_per_rank) if counts else ()) if n != 2]
    for n in extra:
        Tn = 2 * 64 * P * max(1, -(-n // (2 * 64)))        # room for n sequences, divisible by P
        ncu = torch.div(torch.arange(n + 1, device=device) * Tn, n, rounding_mode="floor")
        for st, out_state in combos:
            run(torch.randn(1, Tn // P, layer.hidden_size, device=device, dtype=dtype), ncu,
                state(n) if st else None, out_state)
    if include_decode and include_states and P == 1:  # decode is one token per sequence: T = N is not split across ranks
        n = 3
        x = torch.randn(1, n, layer.hidden_size, device=device, dtype=dtype)
        dcu = torch.arange(n + 1, device=device)
        for grad in (False, True):
            run(x.clone(), dcu, state(n), True, grad=grad)
            run(x.clone(), dcu, state(n), False, grad=grad)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0
