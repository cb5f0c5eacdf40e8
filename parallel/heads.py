"""Which heads each rank of the SP group owns after the sequence->head all-to-all.

Grouped heads: value head ``j`` reads q/k head ``j // r`` with ``r = Hv / Hk``. Ranks own contiguous
blocks of value heads, and with them the q/k heads those value heads read, so a rank never needs a
q/k head it does not hold and never repeats q/k heads locally:

- ``P <= Hk``: rank ``i`` owns q/k heads ``[i*Hk/P, (i+1)*Hk/P)`` and value heads
  ``[i*Hv/P, (i+1)*Hv/P)`` (whole k-groups; needs ``Hk % P == 0``).
- ``P > Hk``: ``P / Hk`` ranks share each q/k head (replication), each holding ``Hv / P`` of its value
  heads; rank ``i`` owns q/k head ``i // (P / Hk)`` (needs ``P % Hk == 0`` and ``Hv % P == 0``).

Any other ``(Hk, Hv, P)`` would split a k-group unevenly and is rejected by ``partition_heads``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadPartition:
    """Head ownership for ``num_k_heads`` q/k heads, ``num_v_heads`` value heads over ``sp_size`` ranks.

    Build it with ``partition_heads``, which validates the triple; the properties below assume it is valid.
    """

    num_k_heads: int
    num_v_heads: int
    sp_size: int

    @property
    def k_heads_per_rank(self) -> int:
        """q/k heads each rank holds: ``Hk // P``, or 1 when heads are replicated (``P > Hk``)."""
        return self.num_k_heads // self.sp_size if self.sp_size <= self.num_k_heads else 1

    @property
    def v_heads_per_rank(self) -> int:
        """Value heads (and gates ``g``/``beta``) each rank holds: ``Hv // P``."""
        return self.num_v_heads // self.sp_size

    @property
    def replication(self) -> int:
        """How many ranks hold each q/k head: ``P // Hk`` when ``P > Hk``, else 1."""
        return self.sp_size // self.num_k_heads if self.sp_size > self.num_k_heads else 1

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.sp_size:
            raise ValueError(f"rank must be an int in [0, sp_size = {self.sp_size}), got {rank!r}")

    def k_heads(self, rank: int) -> range:
        """Global q/k head indices rank ``rank`` holds (contiguous). Raises ValueError for a bad rank."""
        self._check_rank(rank)
        if self.sp_size > self.num_k_heads:
            head = rank // self.replication
            return range(head, head + 1)
        n = self.k_heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def v_heads(self, rank: int) -> range:
        """Global value head indices rank ``rank`` holds: ``[rank*Hv/P, (rank+1)*Hv/P)``."""
        self._check_rank(rank)
        n = self.v_heads_per_rank
        return range(rank * n, (rank + 1) * n)


def _is_positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0


def partition_heads(num_k_heads: int, num_v_heads: int, sp_size: int) -> HeadPartition:
    """Validate ``(num_k_heads, num_v_heads, sp_size)`` and return the ``HeadPartition``.

    Rules: all three positive ints; ``Hv % Hk == 0``; if ``P <= Hk`` then ``Hk % P == 0``; if ``P > Hk``
    then ``P % Hk == 0`` and ``Hv % P == 0`` (each q/k head replicated on ``P / Hk`` ranks).

    Raises:
        ValueError: any rule broken; the message names num_k_heads, num_v_heads and the SP size with
            their values, and the rule.
    """
    what = f"num_k_heads = {num_k_heads!r}, num_v_heads = {num_v_heads!r}, SP size = {sp_size!r}"

    def fail(rule: str):
        raise ValueError(f"cannot partition heads over the SP group ({what}): {rule}")

    if not (_is_positive_int(num_k_heads) and _is_positive_int(num_v_heads) and _is_positive_int(sp_size)):
        fail("all three must be positive ints")
    if num_v_heads % num_k_heads != 0:
        fail("num_v_heads must be a multiple of num_k_heads (each value head reads q/k head j // (Hv/Hk))")
    if sp_size <= num_k_heads:
        if num_k_heads % sp_size != 0:
            fail("when SP size <= num_k_heads, num_k_heads must be divisible by the SP size "
                 "(each rank owns whole k-groups)")
    else:
        if sp_size % num_k_heads != 0:
            fail("when SP size > num_k_heads, the SP size must be a multiple of num_k_heads "
                 "(each q/k head replicated on SP size / num_k_heads ranks)")
        if num_v_heads % sp_size != 0:
            fail("when SP size > num_k_heads, num_v_heads must be divisible by the SP size "
                 "(each rank owns Hv / P value heads)")
    return HeadPartition(num_k_heads, num_v_heads, sp_size)


__all__ = ["HeadPartition", "partition_heads"]
