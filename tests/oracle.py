"""Independent float64 oracles, written as literally as possible (loops over sequences, heads, tokens).

They share no code with the package, so a bug in the package's shared preprocessing (head grouping,
scale, l2norm, packing) cannot hide in both sides of a comparison.
"""
import torch
import torch.nn.functional as F


def naive_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, use_qk_l2norm=False):
    """Returns (o [B, T, Hv, Dv] float64, final [N, Hv, Dk, Dv] float64). Value head j reads q/k head j // r."""
    q, k, v, g, beta = (x.detach().double() for x in (q, k, v, g, beta))
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    r = Hv // Hk
    scale = Dk ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(x) for x in cu_seqlens]
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    o = torch.zeros(B, T, Hv, Dv, dtype=torch.float64)
    finals = []
    for n, (b, start, end) in enumerate(spans):
        per_head = []
        for j in range(Hv):
            h = j // r
            S = (torch.zeros(Dk, Dv, dtype=torch.float64) if initial_state is None
                 else initial_state[n, j].detach().double().clone())
            for t in range(start, end):
                qt, kt = q[b, t, h], k[b, t, h]
                if use_qk_l2norm:
                    qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                    kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                S = S * torch.exp(g[b, t, j])
                S = S + beta[b, t, j] * torch.outer(kt, v[b, t, j] - S.T @ kt)
                o[b, t, j] = S.T @ (qt * scale)
            per_head.append(S)
        finals.append(torch.stack(per_head))
    return o, torch.stack(finals) if finals else torch.zeros(0, Hv, Dk, Dv, dtype=torch.float64)


def naive_causal_conv1d(x, weight, bias=None, cu_seqlens=None, initial_state=None, silu=True):
    """Per sequence: prepend its initial state (or zeros) and run torch's own nn.functional.conv1d."""
    B, T, C = x.shape
    W = weight.shape[1]
    spans = ([(b, 0, T) for b in range(B)] if cu_seqlens is None
             else [(0, int(cu_seqlens[n]), int(cu_seqlens[n + 1])) for n in range(len(cu_seqlens) - 1)])
    y = torch.zeros(B, T, C, dtype=torch.float64)
    finals = []
    for n, (b, s, e) in enumerate(spans):
        init = torch.zeros(C, W - 1, dtype=torch.float64) if initial_state is None else initial_state[n].double()
        buf = torch.cat([init, x[b, s:e].double().T], 1)
        if e > s:
            out = F.conv1d(buf[None], weight.double()[:, None, :], None if bias is None else bias.double(), groups=C)[0]
            y[b, s:e] = (F.silu(out) if silu else out).T
        finals.append(buf[:, buf.shape[1] - (W - 1):])
    return y, torch.stack(finals)


def rel_err(a, b) -> float:
    """``||a - b|| / ||b||`` in float64 (the tests' tolerance measure)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
