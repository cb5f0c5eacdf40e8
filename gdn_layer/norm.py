"""Gated RMSNorm module (parameter ``weight [Dv]``, as transformers' Qwen3NextRMSNormGated)."""
from __future__ import annotations

import torch
from torch import nn

from gdn_layer.kernels import gated_rms_norm


class GatedRMSNorm(nn.Module):
    """``weight * x * rsqrt(mean(x^2) + eps) * silu(z)`` over the last dim ``Dv`` of ``x, z [..., Dv]``,
    computed by ``gdn_layer.kernels.gated_rms_norm`` on ``backend`` (a GatedDeltaNet sets its own)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None, backend: str = "auto"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
