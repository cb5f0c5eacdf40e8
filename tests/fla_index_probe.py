"""Run fla's chunk-grid GDN kernels under Triton's interpreter twice: with fla's exact chunk index and with
the capacity-sized one of ``gdn_layer.kernels.fla_backend.chunk_index``; print one JSON line naming every
output that differs.

Run as a script with fla-core on ``PYTHONPATH`` and ``TRITON_INTERPRET=1`` (tests/test_fla_chunk_index.py
does, in a subprocess). The per-sequence kernels (state passing ``chunk_gated_delta_rule_fwd_h`` /
``_bwd_dhu``) do not run in the interpreter and take no chunk index; the chunk states ``h`` / ``dh`` they
would produce are random here, and their rows for the padding programs are NaN: a padding program that
let anything through would put NaN into an output.
"""
from __future__ import annotations

import json
import sys

import torch
import triton.runtime.autotuner as autotuner

_run = autotuner.Autotuner.run


def _first_config(self, *args, **kwargs):
    """The interpreter has no benchmarker: every autotuned kernel runs its first config."""
    self.configs = self.configs[:1]
    return _run(self, *args, **kwargs)


autotuner.Autotuner.run = _first_config

from fla.ops.common.chunk_o import chunk_bwd_dqkwg, chunk_bwd_dv_local, chunk_fwd_o  # noqa: E402
from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra  # noqa: E402
from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd  # noqa: E402
from fla.ops.utils import chunk_local_cumsum  # noqa: E402
from fla.ops.utils.index import prepare_chunk_indices  # noqa: E402

from gdn_layer.kernels.fla_backend import CHUNK, chunk_index  # noqa: E402


def chunk_steps(ci, cu, inputs, real):
    """Every chunk-grid step of fla's GDN forward and backward, in order; returns their outputs by name."""
    q, k, v, g, beta, h, dh, do = inputs
    h, dh = h[:, :len(ci)].clone(), dh[:, :len(ci)].clone()
    h[:, real:], dh[:, real:] = float("nan"), float("nan")
    kw = dict(cu_seqlens=cu, chunk_indices=ci)
    out = {"g_cumsum": chunk_local_cumsum(g, chunk_size=CHUNK, **kw)}
    out["w"], out["u"], out["A"] = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=out["g_cumsum"], beta=beta,
                                                                   chunk_size=CHUNK, **kw)
    out["o"] = chunk_fwd_o(q=q, k=k, v=v, h=h, g=out["g_cumsum"], scale=0.25, chunk_size=CHUNK, **kw)
    out["dv_local"] = chunk_bwd_dv_local(q=q, k=k, g=out["g_cumsum"], do=do, scale=0.25, chunk_size=CHUNK, **kw)
    out["dq"], out["dk"], out["dw"], out["dg"] = chunk_bwd_dqkwg(
        q=q, k=k, v=v, w=out["w"], g=out["g_cumsum"], h=h, dv=out["dv_local"], do=do, dh=dh, scale=0.25,
        chunk_size=CHUNK, **kw)
    out["dk_wy"], out["dv_wy"], out["dbeta"], out["dg_wy"] = prepare_wy_repr_bwd(
        k=k, v=v, beta=beta, g=out["g_cumsum"], A=out["A"], dw=out["dw"], du=out["dv_local"], **kw)
    out["dg_reverse_cumsum"] = chunk_local_cumsum(out["dg_wy"], chunk_size=CHUNK, reverse=True, **kw)
    return out


def main(lengths):
    T, Hk, Hv, D = sum(lengths), 1, 2, 16
    cu = torch.tensor([0] + lengths).cumsum(0)
    gen = torch.Generator().manual_seed(sum(lengths) * 7 + len(lengths))
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    exact, capacity = prepare_chunk_indices(cu, CHUNK), chunk_index(cu, T)
    nt = len(capacity)
    inputs = (rnd(1, T, Hk, D), torch.nn.functional.normalize(rnd(1, T, Hk, D), dim=-1), rnd(1, T, Hv, D),
              -0.1 * torch.rand(1, T, Hv, generator=gen), torch.rand(1, T, Hv, generator=gen),
              rnd(1, nt, Hv, D, D), rnd(1, nt, Hv, D, D), rnd(1, T, Hv, D))
    a = chunk_steps(exact, cu, inputs, len(exact))
    b = chunk_steps(capacity, cu, inputs, len(exact))
    print("RESULT " + json.dumps({"exact_rows": len(exact), "capacity_rows": nt, "outputs": sorted(a),
                                  "differ": [n for n in a if not torch.equal(a[n], b[n])]}), flush=True)


if __name__ == "__main__":
    main([int(x) for x in sys.argv[1:]])
