"""Packed (``cu_seqlens``) <-> padded ``[N, L, ...]`` layout, for the torch reference backend.

The reference kernels run every sequence of a pack side by side in one padded batch, so that
heads, chunks and sequences are all vectorised. Padding goes at the end of each sequence, where it
cannot influence the real tokens; the kernels fill it with inputs that leave the state unchanged.
Building the index costs one host read of ``cu_seqlens`` (a sync on accelerators).
"""
from __future__ import annotations

import torch


class VarlenLayout:
    """Index maps between a packed ``[T_total, ...]`` tensor and a padded ``[N, L, ...]`` one.

    Args:
        lengths: host list of the N sequence lengths (zeros allowed).
        padded_len: L, at least ``max(lengths)``.
        device: where the index tensors live.
    """

    def __init__(self, lengths: list[int], padded_len: int, device: torch.device):
        self.n = len(lengths)
        self.padded_len = padded_len
        total = sum(lengths)
        starts = torch.tensor([0, *lengths[:-1]], dtype=torch.int64).cumsum(0)[:len(lengths)]
        lens = torch.tensor(lengths, dtype=torch.int64)
        pos = torch.arange(padded_len, dtype=torch.int64)
        valid = pos[None, :] < lens[:, None]                              # [N, L]
        # gather index into the packed tensor; padding points one past the end (a zero row)
        self.gather_index = torch.where(valid, starts[:, None] + pos[None, :],
                                        torch.full_like(pos[None, :], total)).reshape(-1).to(device)
        # for each packed token, its flat position in [N * L]
        self.scatter_index = torch.nonzero(valid.reshape(-1)).reshape(-1).to(device)
        self.lengths_t = lens.to(device)

    @classmethod
    def from_cu_seqlens(cls, cu: torch.Tensor | None, batch: int, seqlen: int, device: torch.device,
                        multiple: int = 1) -> "VarlenLayout":
        """Layout for ``cu_seqlens`` (B == 1), or for a plain ``[B, T]`` batch when ``cu`` is None.

        ``multiple`` rounds the padded length up (the chunk size, for the chunked kernel).
        """
        lengths = [seqlen] * batch if cu is None else [int(x) for x in (cu[1:] - cu[:-1]).tolist()]
        longest = max(lengths, default=0)
        return cls(lengths, -(-longest // multiple) * multiple, device)

    def pad(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """``[T_total, *rest]`` -> ``[N, L, *rest]``; padding positions hold ``fill``."""
        extra = torch.full((1, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        return torch.cat([x, extra], 0)[self.gather_index].reshape(self.n, self.padded_len, *x.shape[1:])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """``[N, L, *rest]`` -> ``[T_total, *rest]`` (padding dropped)."""
        return y.reshape(self.n * self.padded_len, *y.shape[2:])[self.scatter_index]
