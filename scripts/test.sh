#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh), then runs the whole test suite:
#   1. every test in one process (multi-rank tests spawn their own gloo process groups), and
#   2. the transformers adapter's tests (tests/test_hf*.py) again under transformers 5.25, and
#   3. the MPI-marked tests under `mpirun -n 2 ... pytest --with-mpi`.
# Exits non-zero if anything fails or if pytest collects no test (exit 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
.venv/bin/python -m pytest -q tests
# the transformers adapter's tests again under transformers 5.25 (.venv/hf525-site first on the path). -P keeps
# the checkout's folder off sys.path: its kernels/ would shadow the Hugging Face `kernels` package 5.25 imports.
PYTHONPATH=.venv/hf525-site .venv/bin/python -P -m pytest -q tests/test_hf*.py
mpirun -n 2 --oversubscribe .venv/bin/python -m pytest -q --color=no -p no:cacheprovider --with-mpi -m mpi tests
