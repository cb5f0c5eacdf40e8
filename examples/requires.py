"""What the multi-rank examples and the GPU benchmarks (benchmarks/) need, checked before they start: a
message naming the missing piece instead of a traceback deep inside torch (a CPU-only torch) or an
ImportError (fla-core off the path). It lives beside the examples so that they run from their own folder
with nothing else on the path; the benchmarks put examples/ on theirs (some also import graph_step or
finetune)."""
from __future__ import annotations

import importlib.util
import os
import sys

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


def help_if_asked(doc: str) -> None:
    """For scripts without argparse: prints ``doc`` and exits (status 0) when -h or --help is given, so the
    usage shows on any machine (before a check that refuses this one)."""
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(doc.strip())
        raise SystemExit(0)


def require_torchrun(script: str, command: str) -> None:
    """SystemExit (status 1, message on stderr) unless launched by torchrun (``RANK`` set): these scripts
    run one process per rank."""
    if "RANK" not in os.environ:
        raise SystemExit(f"{script} runs one process per rank: launch it with torchrun, e.g. {command}")
