"""Combine per-rank RowStats of a vocab-parallel row into full-vocabulary stats (as Megatron's
vocab_parallel_cross_entropy does): one MAX all-reduce of the row max, then one SUM all-reduce of the
rescaled (sum-exp, entropy accumulator, target logit). Traffic is 4 x [N] values per call, never [N, V].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_dapo.ops.stats import RowStats, rescale_to


def vocab_range(vocab_local: int, tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """[start, end) of this rank's slice in Megatron's VocabParallel layout (equal contiguous slices)."""
    if tp_group is None:
        return 0, vocab_local
    rank = dist.get_rank(group=tp_group)
    return rank * vocab_local, (rank + 1) * vocab_local


def global_vocab_size(vocab_local: int, tp_group: dist.ProcessGroup | None) -> int:
    return vocab_local if tp_group is None else vocab_local * dist.get_world_size(group=tp_group)


def combine_stats(stats: RowStats, tp_group: dist.ProcessGroup | None) -> RowStats:
    """Per-rank stats [N] -> stats of the whole row, identical on every rank of `tp_group`."""
    if tp_group is None or dist.get_world_size(group=tp_group) == 1:
        return stats
    global_max = stats.max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    local = rescale_to(stats, global_max)
    parts = [local.sumexp, local.target_logit] + ([] if local.ent_acc is None else [local.ent_acc])
    packed = torch.stack(parts)  # [2 or 3, N]: one collective instead of three
    dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=tp_group)
    return RowStats(max=global_max, sumexp=packed[0], target_logit=packed[1],
                    ent_acc=None if local.ent_acc is None else packed[2])
