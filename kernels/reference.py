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

Inputs run in fp32 (float64 when any input is float64; floating dtypes may mix), also under
``torch.autocast`` (switched off inside each op: it would run the matmuls in bf16); outputs come back in
v's dtype, states in the compute dtype. Grouped heads: value head ``j`` reads q/k head ``j // r``; q/k
are never repeated in memory (the Gram matrices ``q k^T``, ``k k^T`` are formed once per k head).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from einops import rearrange

from .varlen import ChunkPlan, ConvPlan, StepPlan, sequence_lengths

def _no_autocast(fn):
    """Run ``fn`` with autocast off on its first argument's device: the compute dtype is the reference's own."""
    @functools.wraps(fn)
    def run(x, *args, **kwargs):
        with torch.autocast(x.device.type, enabled=False):
            return fn(x, *args, **kwargs)
    return run


CHUNK_SIZE = 64
WINDOW = 16  # chunks whose C x C matrices exist at once: bounds the memory of a no-grad forward


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64, else float32."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


L2NORM_EPS = 1e-6   # fla's l2norm


def l2norm_rstd(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``rsqrt(sum(x^2, -1) + eps)``: ``x.shape[:-1]``, in x's dtype."""
    return torch.rsqrt(x.pow(2).sum(-1) + eps)


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x * rsqrt(sum(x^2, -1) + eps)``, computed in x's dtype (callers pass fp32/fp64)."""
    return x * l2norm_rstd(x, eps)[..., None]


def l2norm_bwd_from_output(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """Gradient of ``y = x * rstd`` (``l2norm``, ``rstd = l2norm_rstd(x)``) w.r.t. x from the output and the
    factor alone: ``(dy - y sum(dy y, -1)) rstd``, in the inputs' promoted dtype."""
    return (dy - y * (dy * y).sum(-1, keepdim=True)) * rstd[..., None]


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm, initial_state=None):
    """Cast to the compute dtype, normalise and scale: packed rows ``[B * T, H, ...]``."""
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    Dk = k.shape[-1]
    q, k, v, g, beta = (x.to(dt).reshape(-1, *x.shape[2:]) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (Dk ** -0.5 if scale is None else scale), k, v, g, beta, dt


def _intra_chunk(q, k, v, g, beta):
    """Everything inside each chunk that does not depend on the state entering it.

    ``q, k [c, Hk, 1, C, Dk]``, ``v [c, Hk, r, C, Dv]``, ``g, beta [c, Hk, r, C]`` for c chunks.
    """
    C, r, Dv = g.shape[-1], v.shape[2], v.shape[-1]
    # Decays inside each chunk, each a sum of only the g's it spans: never a difference of two
    # cumulative sums, which in fp32 loses the small g's next to a large one and turns a reset
    # (g = -inf) into inf - inf. segsum[i, j] = g_{j+1} + ... + g_i for i >= j (Mamba2's segsum).
    idx = torch.arange(C, device=g.device)
    causal = idx[:, None] >= idx[None, :]
    spans = torch.where(idx[:, None] > idx[None, :], g[..., :, None], torch.zeros_like(g[..., :1, None]))
    segsum = spans.cumsum(-2)                                                 # [c h r t t]
    decay = torch.exp(torch.where(causal, segsum, torch.full_like(segsum[..., :1, :1], -float("inf"))))
    gamma = torch.exp(g.cumsum(-1))                                           # decay from chunk start, incl. token i
    after = torch.cat([g.flip(-1).cumsum(-1).flip(-1)[..., 1:], torch.zeros_like(g[..., :1])], -1)
    to_end = torch.exp(after)                                                 # decay from token j to chunk end

    kk = k @ k.transpose(-1, -2)                                              # per k head: [c h 1 t t]
    strict = ~torch.eye(C, dtype=torch.bool, device=g.device)
    A = torch.eye(C, dtype=g.dtype, device=g.device) + beta[..., :, None] * kk * decay * strict  # I + L
    rhs = torch.cat([v * beta[..., None], (k * (beta * gamma)[..., None]).expand(-1, -1, r, -1, -1)], -1)
    u, w = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split([Dv, k.shape[-1]], -1)
    attn = (q @ k.transpose(-1, -2)) * decay                                  # includes the diagonal
    return u, w, q * gamma[..., None], attn, (k * to_end[..., None]).transpose(-1, -2), gamma, decay


def _state_rows(initial_state, n, Hk, Dk, Hv, Dv, dt, device):
    """Rows appended to the packed q, k, v, g, beta: the virtual tokens of the initial states, one zero row.

    State ``S_i`` enters as Dk tokens after the reset that starts sequence i, token j with ``k = e_j``,
    ``v = S_i[j]``, ``beta = 1``, ``g = 0``, ``q = 0``: it finds row j still zero and writes ``S_i[j]``
    there, and the keys being orthonormal, touches nothing else; exact in any precision.
    """
    m = 0 if initial_state is None else n
    zeros = lambda *shape: torch.zeros(*shape, dtype=dt, device=device)  # noqa: E731
    k = torch.eye(Dk, dtype=dt, device=device).repeat(m, 1)[:, None].expand(m * Dk, Hk, Dk)
    v = zeros(0, Hv, Dv) if m == 0 else rearrange(initial_state.to(dt), "n h k v -> (n k) h v")
    return (zeros(m * Dk + 1, Hk, Dk), torch.cat([k, zeros(1, Hk, Dk)]), torch.cat([v, zeros(1, Hv, Dv)]),
            zeros(m * Dk + 1, Hv), torch.cat([torch.ones(m * Dk, Hv, dtype=dt, device=device), zeros(1, Hv)]))


@_no_autocast
def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu=None, use_qk_l2norm=False):
    """Chunked gated delta rule in plain torch (inputs already validated; see the public wrapper).

    Layout (``varlen.ChunkPlan``): the sequences one after another, cut into chunks of 64 at fixed
    positions, a reset (g = -inf) at each sequence start; an initial state enters as Dk virtual tokens
    before its sequence (``k = e_j``, ``v = S[j]``, ``beta = 1``, ``g = 0``, ``q = 0``: each writes row j
    of the state exactly). Chunks that do not start a sequence wait for the state of the chunk before
    them; the Python loop runs over the chunks of the longest such chain, vectorised over chains.

    Cost: O(T' * C * (Dk + Dv) * Hv) flops with ``T' = T + N * Dk`` with an initial state, else T
    (C = 64), whatever the mix of lengths; memory O(T' * (Dk + Dv) * Hv) plus the C x C matrices of
    ``WINDOW`` chunks at a time (of every chunk when autograd records, as backward needs them).
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    r, C, out_dtype = Hv // Hk, CHUNK_SIZE, v.dtype
    q, k, v, g, beta, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, initial_state)
    lengths = sequence_lengths(cu, B, T)
    N, dev = len(lengths), q.device
    plan = ChunkPlan(lengths, 0 if initial_state is None else Dk, C, WINDOW, dev)
    extra = _state_rows(initial_state, N, Hk, Dk, Hv, Dv, dt, dev)
    q, k, v, g, beta = (torch.cat([x, rows])[plan.index] for x, rows in zip((q, k, v, g, beta), extra))
    g = torch.where(plan.reset[:, None], torch.full_like(g[:1], -float("inf")), g)
    q, k = (rearrange(x, "(c t) h d -> c h 1 t d", t=C) for x in (q, k))
    v = rearrange(v, "(c t) (h r) d -> c h r t d", t=C, r=r)
    g, beta = (rearrange(x, "(c t) (h r) -> c h r t", t=C, r=r) for x in (g, beta))

    # Slices come from split (never from indexing in the loop), so backward joins them in one cat
    # instead of adding one full-size zero gradient per slice.
    outs, finals, S_next = [], [], []
    S = q.new_zeros(plan.active[0] if plan.active else 0, Hk, r, Dk, Dv)     # chains start at a reset
    windows = zip(*(x.split([n for n, _ in plan.windows]) for x in (q, k, v, g, beta)))
    for (_, pieces), window in zip(plan.windows, windows):
        per_chunk = _intra_chunk(*window) + (window[1],)                     # + k, for the final states
        for piece, u, w, q_dec, attn, k_dec_t, gamma, decay, k_p in zip(
                pieces, *(x.split([p.hi - p.lo for p in pieces]) for x in per_chunk)):
            if piece.lo == 0:                                                 # a new level
                S_in = iter(S.split(plan.level_pieces[piece.level]))
            S_p = next(S_in)
            delta = u - w @ S_p                                               # [c h r t Dv]
            outs.append(q_dec @ S_p + attn @ delta)
            S_next.append(gamma[..., -1, None, None] * S_p + k_dec_t @ delta)
            if output_final_state and piece.ends is not None:                 # the state right after `row`
                c, row = piece.ends
                finals.append(gamma[c, :, :, row][..., None, None] * S_p[c]
                              + (k_p[c] * decay[c, :, :, row][..., None]).transpose(-1, -2) @ delta[c])
            if piece.hi == plan.active[piece.level]:                          # level done: chains that go on
                S = torch.cat(S_next)[:(plan.active + [0])[piece.level + 1]]
                S_next = []
    o = torch.cat(outs) if outs else q.new_zeros(0, Hk, r, C, Dv)
    o = rearrange(o, "c h r t d -> (c t) (h r) d")[plan.out_index]
    final = None
    if output_final_state:
        no_rows = plan.final_order.numel() - sum(f.shape[0] for f in finals)  # empty sequences, no state
        final = torch.cat(finals + [q.new_zeros(no_rows, Hk, r, Dk, Dv)])[plan.final_order]
        final = rearrange(final, "n h r k v -> n (h r) k v")
    return o.reshape(B, T, Hv, Dv).to(out_dtype), final


@_no_autocast
def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu=None, use_qk_l2norm=False):
    """Token-by-token gated delta rule (inputs already validated).

    Cost: a Python loop over the tokens of the longest sequence; step t updates the states of the
    sequences longer than t only (``varlen.StepPlan``), so time and memory are O(T) for any mix of
    lengths. Used for decoding (T = 1 per sequence) and, in float64, as the ground truth of tests.
    """
    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    r, out_dtype = Hv // Hk, v.dtype
    q, k, v, g, beta, dt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, initial_state)
    plan = StepPlan(sequence_lengths(cu, B, T), q.device)
    N = plan.order.numel()
    S = (q.new_zeros(N, Hk, r, Dk, Dv) if initial_state is None
         else rearrange(initial_state.to(dt), "n (h r) k v -> n h r k v", r=r)[plan.order])  # longest first
    q, k = (rearrange(x, "t h d -> t h 1 d") for x in (q, k))
    v = rearrange(v, "t (h r) d -> t h r d", r=r)
    g, beta = (rearrange(x, "t (h r) -> t h r", r=r) for x in (g, beta))
    steps = zip(plan.active, *(x[plan.index].split(plan.active) for x in (q, k, v, g, beta)))
    outs, done = [], []
    for a, q_t, k_t, v_t, g_t, b_t in steps:
        if a < S.shape[0]:                                                   # sequences that ended
            done.append(S[a:])
            S = S[:a]
        S = S * torch.exp(g_t)[..., None, None]
        pred = (k_t[..., None, :] @ S).squeeze(-2)                             # S^T k: [a h r Dv]
        S = S + k_t[..., :, None] * (b_t[..., None] * (v_t - pred))[..., None, :]
        outs.append((q_t[..., None, :] @ S).squeeze(-2))
    o = torch.cat(outs) if outs else q.new_zeros(0, Hk, r, Dv)
    o = rearrange(o, "t h r d -> t (h r) d")[plan.unsort]
    final = None
    if output_final_state:
        final = rearrange(torch.cat([S, *reversed(done)])[plan.inverse_order], "n h r k v -> n (h r) k v")
    return o.reshape(B, T, Hv, Dv).to(out_dtype), final


@_no_autocast
def causal_conv1d(x, weight, bias=None, activation="silu", cu=None, initial_state=None, output_final_state=False):
    """Depthwise causal conv over T per sequence, ``y_t = act(bias + sum_w weight[:, w] * x_{t-W+1+w})``.

    Each sequence of a pack sees only its own tokens, preceded by its row of ``initial_state``
    (zeros when None): one convolution over the stream of every sequence behind its W-1 state rows
    (``varlen.ConvPlan``), O((T + N W) C). Computed in fp32 (float64 for float64 x); y in x's dtype,
    the final state (the last W-1 inputs of each sequence, oldest first) in the compute dtype.
    """
    B, T, C = x.shape
    W = weight.shape[1]
    dt = compute_dtype(x, weight, bias, initial_state)
    lengths = sequence_lengths(cu, B, T)
    plan = ConvPlan(lengths, W, initial_state is None, x.device)
    state_rows = (x.new_zeros(0, C, dtype=dt) if initial_state is None
                  else rearrange(initial_state.to(dt), "n c w -> (n w) c"))
    stream = torch.cat([x.reshape(B * T, C).to(dt), state_rows, x.new_zeros(1, C, dtype=dt)])[plan.index]
    if T == 0:  # nothing to convolve (conv1d rejects inputs shorter than the kernel)
        y = stream[:0]
    else:
        y = F.conv1d(stream.T[None], weight.to(dt)[:, None, :], None if bias is None else bias.to(dt), groups=C)
        y = y[0].T[plan.out_index]
    if activation in ("silu", "swish"):
        y = F.silu(y)
    final = stream[plan.final_index].transpose(1, 2) if output_final_state else None
    return y.reshape(B, T, C).to(x.dtype), final


@_no_autocast
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


@_no_autocast
def gdn_gate(a, b, A_log, dt_bias):
    """The GatedDeltaNet gate: ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``.

    ``a, b: [B, T, H]`` (any strides), ``A_log, dt_bias: [H]``. g in the compute dtype (fp32, or
    float64 when any input is float64), ``g <= 0``; beta in b's dtype. Source: transformers'
    Qwen3NextGatedDeltaNet (Mamba2's discretisation ``dt = softplus(a + dt_bias)``, ``A = -exp(A_log)``).
    """
    dt = compute_dtype(a, A_log, dt_bias)
    g = -A_log.to(dt).exp() * F.softplus(a.to(dt) + dt_bias.to(dt))
    return g, b.sigmoid()
