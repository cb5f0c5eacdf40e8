"""Ulysses context parallelism for packed batches: ``gdn_layer.parallel``.

Knows nothing of GatedDeltaNet: the all-to-all pair (sequence-sharded <-> head-sharded, autograd), the
head partition for (Hk, Hv, P), padding/sharding/gathering along the sequence, SP gradient reduction,
and the cross-rank agreement check that lets every rank raise together. See docs/ulysses.md; the
state-passing context parallelism pieces (``context``, ``fragments``) and the load balancers' token
orders (``token_order``) are in docs/context_parallel.md.
"""
from .agree import DIGEST_LEN, agree_across_ranks, digest_of
from .all_to_all import head_to_seq, project_seq_to_head, seq_to_head
from .context import (SlicePlan, affine_scan, agree_across_groups, gather_from_ranks, plan_slice, rows_before_slice,
                      select_owned)
from .fragments import FragmentPlan, compose_chains, count_fragments, max_fragments_per_rank, plan_fragments
from .gather_heads import gather_heads
from .grads import reduce_sp_grads
from .groups import resolve_sp_group
from .heads import HeadPartition, partition_heads
from .packing import gather_sequence, pad_cu_seqlens, pad_for_sp, shard_sequence
from .token_order import check_token_order, head_tail_order, per_document_head_tail_order

__all__ = [
    "resolve_sp_group",
    "HeadPartition", "partition_heads",
    "seq_to_head", "head_to_seq", "project_seq_to_head",
    "pad_for_sp", "pad_cu_seqlens", "shard_sequence", "gather_sequence",
    "reduce_sp_grads",
    "gather_heads",
    "agree_across_ranks", "digest_of", "DIGEST_LEN",
    "SlicePlan", "plan_slice", "gather_from_ranks", "rows_before_slice", "affine_scan", "select_owned",
    "agree_across_groups",
    "head_tail_order", "per_document_head_tail_order", "check_token_order",
    "FragmentPlan", "plan_fragments", "compose_chains", "count_fragments", "max_fragments_per_rank",
]
