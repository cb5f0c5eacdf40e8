"""Test-session setup shared by every test module.

Triton kernels run on CPU through Triton's interpreter; ``TRITON_INTERPRET`` is read when a kernel is
decorated (at import), so it is set here, before any test imports ``gdn_layer``.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def pool2():
    """Two gloo worker processes for a test module (tests/dist_utils.py)."""
    from dist_utils import DistributedPool
    with DistributedPool(2) as p:
        yield p


@pytest.fixture(scope="module")
def pool4():
    """Four gloo worker processes for a test module."""
    from dist_utils import DistributedPool
    with DistributedPool(4) as p:
        yield p
