#!/usr/bin/env bash
# Sets up a fresh CPU machine for gdn-layer: Debian packages (MPI for the pytest-mpi tests, fortunes
# for the example's text), a virtual environment in .venv, and the project with its test, hf and
# example extras. Idempotent: a second run installs nothing new (pip finds every package present).
set -euo pipefail
cd "$(dirname "$0")/.."

sudo_if_needed() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }
# Debian packages, only those missing: MPI, fortunes, and venv's ensurepip (stock Debian / Ubuntu ship python3
# without it: package python3-venv)
pkgs=()
if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1 || [ ! -d /usr/share/games/fortunes ]; then
  pkgs+=(openmpi-bin libopenmpi-dev fortunes)
fi
python3 -c "import ensurepip, venv" >/dev/null 2>&1 || pkgs+=(python3-venv)
if [ ${#pkgs[@]} -gt 0 ]; then
  sudo_if_needed apt-get update -q
  DEBIAN_FRONTEND=noninteractive sudo_if_needed apt-get install -y -q --no-install-recommends "${pkgs[@]}"
fi

echo "setup: .venv (torch 2.13.0 CPU, the project with its test, hf and example extras, fla-core) ..."
[ -x .venv/bin/python ] || python3 -m venv .venv
# torch first, pinned: 2.13.0 is the CPU wheel this machine's pip finds locally; an unpinned
# torch would pull a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
# transformers 5.24 in the venv (the newest release the hf extra allows is 5.25, tested beside it below)
.venv/bin/pip install -q --disable-pip-version-check -e ".[test,hf,example]" "transformers==5.24.0"
# transformers 5.25 for the adapter's second test run (tests/test_hf*.py, scripts/test.sh), outside the venv's
# path like fla-site, with the Hugging Face `kernels` package it requires (and its own one dependency missing here)
[ -d .venv/hf525-site/transformers-5.25.0.dist-info ] && [ -d .venv/hf525-site/kernels ] && [ -d .venv/hf525-site/tomlkit ] \
  || .venv/bin/pip install -q --disable-pip-version-check --no-deps --upgrade --target .venv/hf525-site \
       transformers==5.25.0 "kernels>=0.19.1,<0.20" "tomlkit>=0.13.3"
# fla-core for tests/test_triton_compile.py only, kept out of the venv's site-packages: installed there,
# transformers would pick fla's CUDA kernels for its own GatedDeltaNet on this CPU machine.
[ -d .venv/fla-site/fla ] || .venv/bin/pip install -q --disable-pip-version-check --no-deps --target .venv/fla-site fla-core==0.6.0
# triton-ascend for tests/test_ascend_compile.py, in its own environment: it replaces the `triton`
# package (so it cannot sit next to CUDA Triton) and needs pybind11 to build its launcher stubs. The
# probe runs our kernels and fla-core's Ascend kernels through its compiler with a stand-in NPU driver;
# 3.2.0 is the version this machine's package index offers (fla-core 0.6's Ascend kernels want 3.6.0:
# see the `npu` extra in pyproject.toml and docs/kernels.md).
echo "setup: .venv-ascend (triton-ascend 3.2.0 for the NPU compile tests) ..."
[ -x .venv-ascend/bin/python ] || python3 -m venv .venv-ascend
.venv-ascend/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv-ascend/bin/pip install -q --disable-pip-version-check triton-ascend==3.2.0 pybind11 numpy packaging einops
.venv-ascend/bin/pip install -q --disable-pip-version-check --no-deps -e .
