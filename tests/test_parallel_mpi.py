"""The all-to-all pair across processes started by mpirun (gloo group initialised from MPI).

Run:  mpirun -n 2 --allow-run-as-root --oversubscribe \\
          /work/venv/bin/python -m pytest --with-mpi tests/test_parallel_mpi.py -q
Without ``--with-mpi`` pytest-mpi skips these tests.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dist_utils import init_from_mpi
from gdn_layer.parallel import head_to_seq, partition_heads, seq_to_head


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.mpi(min_size=2)
def test_seq_to_head_then_head_to_seq_matches_single_process_under_mpirun():
    rank, P = init_from_mpi()
    B, TL, D = 1, 3, 2
    hp = partition_heads(P, 2 * P, P)                               # Hk = P heads, Hv = 2P
    F = hp.num_v_heads * D
    x_full = _rand(11, B, TL * P, F).requires_grad_()              # same global tensor on every rank
    # rank d receives the features of its value heads
    idx = torch.stack([torch.cat([torch.arange(h * D, (h + 1) * D) for h in hp.v_heads(d)]) for d in range(P)])
    x = x_full.detach()[:, rank * TL:(rank + 1) * TL].clone().requires_grad_()
    heads = seq_to_head(x, idx, dist.group.WORLD)
    torch.testing.assert_close(heads, x_full.detach()[..., idx[rank]], rtol=0, atol=0)
    back = head_to_seq(heads * 2.0, dist.group.WORLD)
    torch.testing.assert_close(back, 2.0 * x.detach(), rtol=0, atol=0)
    w = _rand(12 + rank, *back.shape)
    (back * w).sum().backward()
    torch.testing.assert_close(x.grad, 2.0 * w, rtol=0, atol=0)
