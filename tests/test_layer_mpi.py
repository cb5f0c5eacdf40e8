"""The core SP parity test, launched by MPI: mpirun -n 2 python -m pytest --with-mpi -m mpi tests.

Without ``--with-mpi`` pytest-mpi skips these (the same checks run in test_layer_sp.py over spawned
gloo groups).
"""
import pytest

from dist_utils import init_from_mpi
from test_layer_sp import CASES, _parity


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["straddling_pack", "empty_segment"])
def test_mpi_sp_matches_single_process(case):
    rank, world = init_from_mpi()
    errs = _parity(rank, world, world, *CASES[case])
    assert max(errs.values()) <= 1e-5, errs


@pytest.mark.mpi(min_size=2)
def test_mpi_sp_odd_length_through_pad_for_sp():
    rank, world = init_from_mpi()
    errs = _parity(rank, world, world, 2, 4, 13, [0, 5, 13])
    assert max(errs.values()) <= 1e-5, errs
