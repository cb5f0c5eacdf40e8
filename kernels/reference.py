"""Torch reference backend: the oracle for every other backend and the path that runs on CPU.

Math: the gated delta rule (Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", ICLR 2025), per value head with state ``S [Dk, Dv]``::

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + beta_t * k_t (v_t - S_t^T k_t)^T
    o_t = S_t^T (scale * q_t)

The chunked form follows the WY / UT-transform of fla's ``chunk_gated_delta_rule`` (chunk size 64):
inside a chunk with cumulative decay ``G`` the corrections ``delta = (I + L)^{-1} (beta*v - beta*exp(G)*K S0)``
solve a unit lower-triangular system, ``L_ij = beta_i (k_i . k_j) exp(G_i - G_j)`` for ``i > j``.
Every decay is a sum of the g's it spans (no difference of cumulative sums), so a ``g = -inf`` (reset)
gives exactly zero across it and small g's next to a huge one keep their precision.

Inputs run in fp32 (float64 when any input is float64; floating dtypes may mix); outputs come back in
v's dtype, states in the compute dtype. Grouped heads: value head ``j`` reads q/k head ``j // r``; q/k
are never repeated in memory (the Gram matrices ``q k^T``, ``k k^T`` are formed once per k head).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from .varlen import VarlenLayout

CHUNK_SIZE = 64


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)``, computed in x's dtype (callers pass fp32/fp64)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, cu, use_qk_l2norm, multiple, initial_state=None):
    """Cast, normalise, and lay out ``[B, T, H, D]`` packed inputs as padded ``[N, L, ...]``."""
    dt = compute_dtype(*(t for t in (q, k, v, g, beta, initial_state) if t is not None))
    B, T, Hk, Dk = k.shape
    Hv = v.shape[2]
    layout = VarlenLayout.from_cu_seqlens(cu, B, T, q.device, multiple=multiple)
    q, k, v, g, beta = (x.to(dt).reshape(B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (Dk ** -0.5 if scale is None else scale)
    # padding: k = v = beta = g = 0 leaves the state as it is
    q, k, v, g, beta = (layout.pad(x) for x in (q, k, v, g, beta))
    r = Hv // Hk
    v = rearrange(v, "n l (h r) d -> n h r l d", r=r)
    g, beta = (rearrange(x, "n l (h r) -> n h r l", r=r) for x in (g, beta))
    q, k = (rearrange(x, "n l h d -> n h 1 l d") for x in (q, k))
    return q, k, v, g, beta, layout, dt


def _finish(o, layout, B, T, out_dtype):
    """``[N, Hk, r, L, Dv]`` -> packed ``[B, T, Hv, Dv]``."""
    o = layout.unpad(rearrange(o, "n h r l d -> n l (h r) d"))
    return o.reshape(B, T, *o.shape[1:]).to(out_dtype)


def _initial(initial_state, N, Hk, r, Dk, Dv, dt, device):
    if initial_state is None:
        return torch.zeros(N, Hk, r, Dk, Dv, dtype=dt, device=device)
    return rearrange(initial_state.to(dt), "n (h r) k v -> n h r k v", r=r)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu=None, use_qk_l2norm=False):
    """Chunked gated delta rule in plain torch (inputs already validated; see the public wrapper).

    Cost: O(T * C * (Dk + Dv) * Hv) flops for the intra-chunk part (C = 64), vectorised over
    sequences, heads and chunks, plus a Python loop over the ``ceil(T_max / 64)`` chunks of the longest
    sequence for the state hand-off (a few batched matmuls each). Memory O(T * C * Hv) for the
    per-chunk ``C x C`` matrices.
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    r = Hv // Hk
    out_dtype = v.dtype
    q, k, v, g, beta, layout, dt = _prepare(q, k, v, g, beta, scale, cu, use_qk_l2norm, CHUNK_SIZE,
                                            initial_state)
    N, L, C = layout.n, layout.padded_len, CHUNK_SIZE
    S = _initial(initial_state, N, Hk, r, Dk, Dv, dt, q.device)
    nc = L // C
    if nc == 0:
        o = torch.zeros(N, Hk, r, 0, Dv, dtype=dt, device=q.device)
        return _finish(o, layout, B, T, out_dtype), (rearrange(S, "n h r k v -> n (h r) k v") if output_final_state else None)

    q, k, v = (rearrange(x, "n h r (c t) d -> n h r c t d", t=C) for x in (q, k, v))
    g, beta = (rearrange(x, "n h r (c t) -> n h r c t", t=C) for x in (g, beta))

    # Decays inside each chunk, each a sum of only the g's it spans: never a difference of two
    # cumulative sums, which in fp32 loses the small g's next to a large one and turns a reset
    # (g = -inf) into inf - inf. segsum[i, j] = g_{j+1} + ... + g_i for i >= j (Mamba2's segsum).
    idx = torch.arange(C, device=q.device)
    causal = idx[:, None] >= idx[None, :]
    spans = torch.where(idx[:, None] > idx[None, :], g[..., :, None], torch.zeros_like(g[..., :1, None]))
    segsum = spans.cumsum(-2)                                                 # [n h r c t t]
    decay = torch.exp(torch.where(causal, segsum, torch.full_like(segsum[..., :1, :1], -float("inf"))))
    gamma = torch.exp(g.cumsum(-1))                                           # decay from chunk start, incl. token i
    after = torch.cat([g.flip(-1).cumsum(-1).flip(-1)[..., 1:], torch.zeros_like(g[..., :1])], -1)
    to_end = torch.exp(after)                                                 # decay from token j to chunk end
    gamma_end = gamma[..., -1]                                                # [n h r c]

    kk = k @ k.transpose(-1, -2)                                              # per k head: [n h 1 c t t]
    qk = q @ k.transpose(-1, -2)
    strict = ~torch.eye(C, dtype=torch.bool, device=q.device)
    lower = beta[..., :, None] * kk * decay * strict                          # L_ij, i > j
    eye = torch.eye(C, dtype=dt, device=q.device)
    A = eye + lower
    rhs = torch.cat([v * beta[..., None], (k * (beta * gamma)[..., None]).expand(-1, -1, r, -1, -1, -1)], -1)
    u, w = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([Dv, Dk], -1)
    attn = qk * decay                                                         # includes the diagonal
    q_dec = q * gamma[..., None]
    k_dec_t = (k * to_end[..., None]).transpose(-1, -2)

    # unbind once: indexing chunk c in the loop would make autograd add a full-size zero
    # gradient per chunk (quadratic in the number of chunks)
    per_chunk = zip(*(x.unbind(3) for x in (u, w, q_dec, attn, k_dec_t, gamma_end[..., None, None])))
    outs = []
    for u_c, w_c, q_c, attn_c, kt_c, decay_c in per_chunk:
        delta = u_c - w_c @ S                                                 # [n h r t Dv]
        outs.append(q_c @ S + attn_c @ delta)
        S = decay_c * S + kt_c @ delta
    o = torch.stack(outs, 3).reshape(N, Hk, r, L, Dv)
    final = rearrange(S, "n h r k v -> n (h r) k v") if output_final_state else None
    return _finish(o, layout, B, T, out_dtype), final


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu=None, use_qk_l2norm=False):
    """Token-by-token gated delta rule (inputs already validated).

    Cost: a Python loop over the ``T_max`` tokens of the longest sequence, vectorised over sequences
    and heads. Used for decoding (T = 1 per sequence) and, in float64, as the ground truth of tests.
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    r = Hv // Hk
    out_dtype = v.dtype
    q, k, v, g, beta, layout, dt = _prepare(q, k, v, g, beta, scale, cu, use_qk_l2norm, 1, initial_state)
    N, L = layout.n, layout.padded_len
    S = _initial(initial_state, N, Hk, r, Dk, Dv, dt, q.device)
    outs = []
    for t in range(L):
        q_t, k_t = q[:, :, :, t], k[:, :, :, t]                                # [n h 1 Dk]
        S = S * torch.exp(g[:, :, :, t])[..., None, None]
        pred = (k_t[..., None, :] @ S).squeeze(-2)                             # S^T k: [n h r Dv]
        S = S + k_t[..., :, None] * (beta[:, :, :, t, None] * (v[:, :, :, t] - pred))[..., None, :]
        outs.append((q_t[..., None, :] @ S).squeeze(-2))
    o = torch.stack(outs, 3) if outs else torch.zeros(N, Hk, r, 0, Dv, dtype=dt, device=q.device)
    final = rearrange(S, "n h r k v -> n (h r) k v") if output_final_state else None
    return _finish(o, layout, B, T, out_dtype), final


def causal_conv1d(x, weight, bias=None, activation="silu", cu=None, initial_state=None, output_final_state=False):
    """Depthwise causal conv over T per sequence, ``y_t = act(bias + sum_w weight[:, w] * x_{t-W+1+w})``.

    Each sequence of a pack sees only its own tokens, preceded by its row of ``initial_state``
    (zeros when None). Computed in fp32 (float64 for float64 x); y in x's dtype, the final state
    (the last W-1 inputs of each sequence, oldest first) in the compute dtype.
    """
    B, T, C = x.shape
    W = weight.shape[1]
    dt = compute_dtype(*(t for t in (x, weight, bias, initial_state) if t is not None))
    layout = VarlenLayout.from_cu_seqlens(cu, B, T, x.device)
    N, L = layout.n, layout.padded_len
    xp = layout.pad(x.reshape(B * T, C).to(dt))                               # [N, L, C]
    init = (torch.zeros(N, C, W - 1, dtype=dt, device=x.device) if initial_state is None
            else initial_state.to(dt))
    buf = torch.cat([init, xp.transpose(1, 2)], -1)                          # [N, C, W-1+L]
    if L == 0:  # nothing to convolve (conv1d rejects inputs shorter than the kernel)
        y = buf[..., :0]
    else:
        y = F.conv1d(buf, weight.to(dt)[:, None, :], None if bias is None else bias.to(dt), groups=C)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    y = layout.unpad(y.transpose(1, 2)).reshape(B, T, C).to(x.dtype)
    final = None
    if output_final_state:
        # the last W-1 entries of [init | x_n] sit at buffer positions len_n .. len_n + W - 2
        pos = layout.lengths_t[:, None] + torch.arange(W - 1, device=x.device)[None, :]
        final = torch.gather(buf, 2, pos[:, None, :].expand(N, C, W - 1))
    return y, final


def gated_rms_norm(x, z, weight, eps=1e-6):
    """RMSNorm over the last dim, times ``silu(z)``, in the order of transformers' Qwen3NextRMSNormGated.

    ``x, z: [..., Dv]``, ``weight: [Dv]``. Normalisation in fp32, weight applied in x's dtype,
    gate in fp32, result in x's dtype.
    """
    in_dtype = x.dtype
    h = x.to(torch.float32) if in_dtype != torch.float64 else x
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(in_dtype)
    h = h * F.silu(z.to(h.dtype if in_dtype == torch.float64 else torch.float32))
    return h.to(in_dtype)


def gdn_gate(a, b, A_log, dt_bias):
    """The GatedDeltaNet gate: ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``.

    ``a, b: [B, T, H]`` (any strides), ``A_log, dt_bias: [H]``. g in the compute dtype (fp32, or
    float64 when any input is float64), ``g <= 0``; beta in b's dtype. Source: transformers'
    Qwen3NextGatedDeltaNet (Mamba2's discretisation ``dt = softplus(a + dt_bias)``, ``A = -exp(A_log)``).
    """
    dt = compute_dtype(a, A_log, dt_bias)
    g = -A_log.to(dt).exp() * F.softplus(a.to(dt) + dt_bias.to(dt))
    return g, b.sigmoid()
