"""Test-session setup shared by every test module.

Triton kernels run on CPU through Triton's interpreter; ``TRITON_INTERPRET`` is read when a kernel is
decorated (at import), so it is set here, before any test imports ``gdn_layer``.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
