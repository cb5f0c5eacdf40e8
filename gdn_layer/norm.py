"""Gated RMSNorm module (parameter ``weight [Dv]``, as transformers' Qwen3NextRMSNormGated)."""
from __future__ import annotations

import torch
from torch import nn

from gdn_layer.kernels import gated_rms_norm


class GatedRMSNorm(nn.Module):
    """``weight * x * rsqrt(mean(x^2) + eps) * act(z)`` over the last dim ``Dv`` of ``x, z [..., Dv]``.

    ``gate="silu"`` (Qwen3-Next / Qwen3.5): computed by ``gdn_layer.kernels.gated_rms_norm`` on
    ``backend`` (a GatedDeltaNet sets its own). ``gate="sigmoid"`` (transformers' Qwen4-Exp with
    ``output_gate_type="sigmoid"``): plain torch in transformers' order (normalisation in fp32, weight
    applied in x's dtype, gate in fp32, result in x's dtype).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None, backend: str = "auto",
                 gate: str = "silu"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps
        self.backend = backend
        if gate not in ("silu", "sigmoid"):
            raise ValueError(f"gate must be 'silu' or 'sigmoid', got {gate!r}")
        self.gate = gate

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.gate == "silu":
            return gated_rms_norm(x, z, self.weight, self.eps, backend=self.backend)
        dtype = x.dtype
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        h = x.to(compute)
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * torch.sigmoid(z.to(compute))).to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + ("" if self.gate == "silu" else f", gate={self.gate!r}")
