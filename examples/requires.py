"""What the GPU benchmarks and measurement scripts (examples/ and scripts/) need, checked before they start:
a message naming the missing piece instead of a traceback deep inside torch (a CPU-only torch) or an
ImportError (fla-core off the path)."""
from __future__ import annotations

import importlib.util

import torch


def require_cuda(script: str, fla: bool = False) -> None:
    """SystemExit (status 1, message on stderr) unless a CUDA GPU is visible and, with ``fla``, fla-core imports."""
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} measures CUDA kernels: it needs a CUDA GPU (none is visible). On the GPU "
                         "machine scripts/gpu_session.sh runs it (its steps are listed in that file).")
    if fla and importlib.util.find_spec("fla") is None:
        raise SystemExit(f"{script} compares with fla-core, which is not importable: scripts/setup.sh installs "
                         "it in .venv/fla-site, off the default path; add PYTHONPATH=.venv/fla-site "
                         "(scripts/gpu_session.sh does).")
