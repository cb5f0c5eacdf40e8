#!/usr/bin/env bash
# Sets up a fresh CPU machine for gdn-layer: Debian packages (MPI for the pytest-mpi tests, fortunes
# for the example's text), a virtual environment in .venv, and the project with its test, hf and
# example extras. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

sudo_if_needed() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1 || [ ! -d /usr/share/games/fortunes ]; then
  sudo_if_needed apt-get update -q
  DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -q --no-install-recommends \
    openmpi-bin libopenmpi-dev fortunes
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# torch first, pinned: 2.13.0 is the CPU wheel this machine's pip finds locally; an unpinned
# torch would pull a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e ".[test,hf,example]"
# fla-core for tests/test_triton_compile.py only, kept out of the venv's site-packages: installed there,
# transformers would pick fla's CUDA kernels for its own GatedDeltaNet on this CPU machine.
[ -d .venv/fla-site/fla ] || .venv/bin/pip install -q --disable-pip-version-check --no-deps --target .venv/fla-site fla-core==0.6.0
