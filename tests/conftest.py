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


@pytest.fixture
def triton_cpu_backend():
    """The torch backend with our Triton kernels (conv, gate, gated norm) bound as the CUDA backends bind
    them (``kernels/triton_ops.py``), registered as ``"triton_cpu"``: on CPU they run under Triton's
    interpreter. fla's chunk kernels do not, so the chunk / recurrent ops stay the torch ones."""
    import dataclasses

    from gdn_layer.kernels import registry, triton_ops
    b = dataclasses.replace(
        registry.backend_by_name("torch"), name="triton_cpu", priority=-1,
        causal_conv1d=triton_ops.conv_fwd, causal_conv1d_bwd=triton_ops.conv_bwd,
        gdn_gate=triton_ops.gate_fwd, gdn_gate_bwd=triton_ops.gate_bwd,
        gated_rms_norm=triton_ops.norm_fwd, gated_rms_norm_bwd=triton_ops.norm_bwd, conv_splits=True,
        grads_into=True, conv_l2norm=True)
    registry.register_backend(b)
    yield b.name
    registry._BACKENDS.pop(b.name)
