"""One decode step of N sequences (one token each) read from and written into a state pool, in two launches.

A step's math around the projections is the causal conv's update (W taps over the W-1 kept inputs and the
new one, SiLU), the gate (``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``), the q / k L2
norm and one step of the gated delta rule (``S <- S exp(g)``; ``S <- S + k (beta (v - S^T k))^T``;
``o = S^T q scale``; kernels/reference.py). Run op by op it is some twenty launches plus the gathers and
scatters of the pool rows, each a host-side cost that dwarfs its GPU time at decode sizes. Here:

- ``_conv_update_kernel`` (programs over rows x channel blocks): reads row ``slots[i]`` of the pool's conv
  state, writes the conv output ``qkv [N, C]`` (the activation dtype, rounded as the op-by-op path rounds
  it) and the shifted window back into the same row, in place;
- ``_recurrent_step_kernel`` (programs over rows x value heads x Dv blocks): the gate, the L2 norm of q and
  k (recomputed by each of a k head's Hv / Hk value heads: a few hundred flops), and the delta-rule step on
  the ``[Dk, BV]`` block of row ``slots[i]`` of the recurrent state, written back in place.

Two kernels rather than one because the conv state of a k head's channels is shared by Hv / Hk value heads:
one program updating it while another still reads it would race. Rows with ``slots[i] < 0`` (padding) read
and write nothing and output zeros. The slots are never read on the host: a step of fixed N is captured by a
CUDA graph and replayed with new slots. Rows are persistent per program (``_grid``: at most 65 535 programs,
the NPU's limit); N is a runtime argument, so no N compiles anything new. The strides and C are the layer's
and the pool's (never N's): Triton specializes them (a multiple of 16 lets it vectorize the state rows' loads and
stores; as runtime values the H100 moved the rows at 1.8 TB/s; specialized, not yet measured).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _grid
from ..reference import L2NORM_EPS
from ._math import compute_tl_dtype, rne, sigmoid, softplus, tl_dtype

# The recurrent step's tile and warps: ``[Dk, BV]`` state blocks, BV = min(BV_MAX, Dv), one program each
# (benchmarks/bench_decode.py --kernels sweeps them on a GPU); the conv update's channel block.
BV_MAX, NUM_WARPS, CONV_BC = 32, 4, 128


@triton.jit(do_not_specialize=["N"])
def _conv_update_kernel(mixed, weight, pool_conv, slots, qkv, N, C, stride_m, stride_ps, stride_pc, stride_wc,
                        W: tl.constexpr, WP: tl.constexpr, BC: tl.constexpr, DTYPE: tl.constexpr,
                        CT: tl.constexpr):
    cb = tl.program_id(1)
    ch = cb * BC + tl.arange(0, BC)
    cm = ch < C
    w = tl.arange(0, WP)
    wt = tl.load(weight + ch[:, None] * stride_wc + w[None, :], mask=cm[:, None] & (w[None, :] < W),
                 other=0.0).to(CT)
    for row in range(tl.program_id(0), N, tl.num_programs(0)):
        slot = tl.load(slots + row)
        valid = slot >= 0
        base = pool_conv + tl.maximum(slot, 0) * stride_ps + ch[:, None] * stride_pc
        x = tl.load(mixed + row * stride_m + ch, mask=cm, other=0.0).to(CT)
        kept = tl.load(base + w[None, :], mask=valid & cm[:, None] & (w[None, :] < W - 1), other=0.0).to(CT)
        window = tl.where(w[None, :] == W - 1, x[:, None], kept)               # oldest first, the new input last
        out = tl.sum(window * wt, 1)
        out = out * sigmoid(out)
        tl.store(qkv + row * C + ch, rne(out, DTYPE).to(DTYPE), mask=cm)
        shifted = tl.load(base + w[None, :] + 1, mask=valid & cm[:, None] & (w[None, :] < W - 2), other=0.0).to(CT)
        shifted = tl.where(w[None, :] == W - 2, x[:, None], shifted)
        tl.store(base + w[None, :], shifted.to(pool_conv.dtype.element_ty),
                 mask=valid & cm[:, None] & (w[None, :] < W - 1))


@triton.jit(do_not_specialize=["N"])
def _recurrent_step_kernel(qkv, mixed, A_log, dt_bias, pool_rec, slots, o, N, C, stride_m, stride_rs, stride_rh,
                           stride_rk, scale, eps, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr,
                           DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DTYPE: tl.constexpr,
                           CT: tl.constexpr):
    NV: tl.constexpr = (DV + BV - 1) // BV
    hv = tl.program_id(1) // NV
    vb = tl.program_id(1) % NV
    hk = hv // (HV // HK)
    kk = tl.arange(0, BK)
    km = kk < DK
    vv = vb * BV + tl.arange(0, BV)
    vm = vv < DV
    decay = -tl.exp(tl.load(A_log + hv).to(CT))
    bias = tl.load(dt_bias + hv).to(CT)
    for row in range(tl.program_id(0), N, tl.num_programs(0)):
        slot = tl.load(slots + row)
        valid = slot >= 0
        line = qkv + row * C
        q = tl.load(line + hk * DK + kk, mask=km, other=0.0).to(CT)
        k = tl.load(line + HK * DK + hk * DK + kk, mask=km, other=0.0).to(CT)
        v = tl.load(line + 2 * HK * DK + hv * DV + vv, mask=vm, other=0.0).to(CT)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + eps)) * scale
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + eps))
        a = tl.load(mixed + row * stride_m + C + hv).to(CT)
        b = tl.load(mixed + row * stride_m + C + HV + hv).to(CT)
        g = decay * softplus(a + bias)
        beta = rne(sigmoid(b), DTYPE)                                          # beta in b's dtype, as the gate op
        block = pool_rec + tl.maximum(slot, 0) * stride_rs + hv * stride_rh + kk[:, None] * stride_rk + vv[None, :]
        m = valid & km[:, None] & vm[None, :]
        S = tl.load(block, mask=m, other=0.0).to(CT) * tl.exp(g)
        u = beta * (v - tl.sum(S * k[:, None], 0))
        S = S + k[:, None] * u[None, :]
        out = tl.sum(S * q[:, None], 0)
        tl.store(block, S.to(pool_rec.dtype.element_ty), mask=m)
        tl.store(o + (row * HV + hv) * DV + vv, tl.where(valid, rne(out, DTYPE), 0.0).to(DTYPE), mask=vm)


def decode_step(mixed: torch.Tensor, weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                conv_state: torch.Tensor, recurrent_state: torch.Tensor, slots: torch.Tensor, num_k_heads: int,
                num_v_heads: int, head_k_dim: int, head_v_dim: int, scale: float | None = None) -> torch.Tensor:
    """One token per sequence from pool rows ``slots``, the rows updated in place (inputs already checked).

    Args:
        mixed: ``[N, C + 2 Hv]`` the in-projection's output of each sequence's token (q | k | v channels, then
            a, b), unit stride along the channels; C = ``2 Hk Dk + Hv Dv``. bf16 / fp16 / fp32 / fp64.
        weight: ``[C, W]`` the conv's taps (unit stride along W); A_log, dt_bias: ``[Hv]``.
        conv_state: the pool's ``[S, C, W - 1]`` (unit stride along W - 1), recurrent_state ``[S, Hv, Dk, Dv]``
            (unit stride along Dv): fp32, or fp64 for fp64 inputs.
        slots: int64 ``[N]`` distinct rows, or -1 (padding: nothing read or written, output zeros).
        scale: q's scale, default ``Dk ** -0.5``.

    Returns:
        ``o [N, Hv, Dv]`` in mixed's dtype: the delta rule's output before the gated norm.
    """
    N, C = mixed.shape[0], conv_state.shape[1]
    W = weight.shape[1]
    o = mixed.new_empty(N, num_v_heads, head_v_dim)
    if N == 0:
        return o
    qkv = mixed.new_empty(N, C)
    dt, ct = tl_dtype(mixed.dtype), compute_tl_dtype(mixed, recurrent_state)
    BC = CONV_BC
    blocks = _grid.cdiv(C, BC)
    _conv_update_kernel[(_grid.programs(N, blocks), blocks)](
        mixed, weight, conv_state, slots, qkv, N, C, mixed.stride(0), conv_state.stride(0), conv_state.stride(1),
        weight.stride(0), W=W, WP=_grid.next_power_of_2(W), BC=BC, DTYPE=dt, CT=ct)
    BV = min(BV_MAX, _grid.next_power_of_2(head_v_dim))
    heads = num_v_heads * _grid.cdiv(head_v_dim, BV)
    _recurrent_step_kernel[(_grid.programs(N, heads), heads)](
        qkv, mixed, A_log, dt_bias, recurrent_state, slots, o, N, C, mixed.stride(0), recurrent_state.stride(0),
        recurrent_state.stride(1), recurrent_state.stride(2), head_k_dim ** -0.5 if scale is None else scale,
        L2NORM_EPS, HK=num_k_heads, HV=num_v_heads, DK=head_k_dim, DV=head_v_dim,
        BK=_grid.next_power_of_2(head_k_dim), BV=BV, DTYPE=dt, CT=ct, num_warps=NUM_WARPS)
    return o


__all__ = ["decode_step"]
