"""Dynamic micro-batching: group samples under a padded-token budget and build padded tensors.

A micro-batch of n rows padded to its longest row L costs n * L tokens; rows are sorted by length
(longest first) and packed greedily so each micro-batch stays under `max_tokens`. Right padding with
a causal mask leaves every real position's output unchanged, so log-probs do not depend on the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_dapo.actor.config import TrainSample


def plan_micro_batches(lengths: Sequence[int], *, max_tokens: int | None, micro_batch_size: int
                       ) -> list[list[int]]:
    """Index groups into `lengths`: each group's len(group) * max length <= max_tokens.

    max_tokens=None: consecutive groups of micro_batch_size rows (the fixed-size fallback).
    Raises ValueError naming --max-tokens-per-micro-batch when one sequence alone exceeds the budget.
    """
    if max_tokens is None:
        idx = list(range(len(lengths)))
        return [idx[i:i + micro_batch_size] for i in range(0, len(idx), micro_batch_size)]
    longest = max(lengths, default=0)
    if longest > max_tokens:
        raise ValueError(f"a sequence of {longest} tokens exceeds --max-tokens-per-micro-batch "
                         f"({max_tokens}); raise the budget to at least the longest prompt + response")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        # sorted longest-first, so the group's first row is its longest
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass
class MicroBatch:
    """Right-padded tensors of one micro-batch; position t predicts token t + 1."""

    indices: list[int]
    """Positions of these rows in the caller's sample list."""
    tokens: Tensor
    """[b, s] int64 input ids (0 in padding)."""
    position_ids: Tensor
    """[b, s] int64."""
    attention_mask: Tensor
    """[1, 1, s, s] bool, True = masked (strictly upper triangle: causal)."""
    targets: Tensor
    """[b, s] int64 next-token ids (0 where there is none)."""
    response_mask: Tensor
    """[b, s] bool: the target at this position is a response token."""
    loss_mask: Tensor
    """[b, s] fp32: response_mask times the sample's loss_mask."""
    old_log_probs: Tensor
    """[b, s] fp32 (0 where has_old is False or outside the response)."""
    has_old: Tensor
    """[b] bool: old log-probs were given (else on-policy)."""
    advantages: Tensor
    """[b] fp32."""
    response_lens: list[int]
    prompt_lens: list[int]

    def to(self, device: torch.device | str) -> MicroBatch:
        moved = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**moved)

    def gather_response(self, values: Tensor) -> list[Tensor]:
        """[b, s] per-position values -> per-row [response_len] tensors (response positions only)."""
        spans = zip(self.prompt_lens, self.response_lens)
        return [values[r, p - 1:p - 1 + n] for r, (p, n) in enumerate(spans)]


def build_micro_batch(samples: Sequence[TrainSample], indices: list[int]) -> MicroBatch:
    rows = [samples[i] for i in indices]
    b, s = len(rows), max(len(r.tokens) for r in rows)
    tokens = torch.zeros(b, s, dtype=torch.long)
    targets = torch.zeros(b, s, dtype=torch.long)
    response_mask = torch.zeros(b, s, dtype=torch.bool)
    loss_mask = torch.zeros(b, s, dtype=torch.float32)
    old = torch.zeros(b, s, dtype=torch.float32)
    for r, row in enumerate(rows):
        ids = torch.tensor(row.tokens, dtype=torch.long)
        n, p = len(row.tokens), row.prompt_len
        tokens[r, :n] = ids
        targets[r, :n - 1] = ids[1:]
        # logits at positions p-1 .. n-2 predict the response tokens p .. n-1
        response_mask[r, p - 1:n - 1] = True
        loss_mask[r, p - 1:n - 1] = 1.0 if row.loss_mask is None else row.loss_mask.float()
        if row.old_log_probs is not None:
            old[r, p - 1:n - 1] = row.old_log_probs.float()
    return MicroBatch(
        indices=list(indices),
        tokens=tokens,
        position_ids=torch.arange(s, dtype=torch.long).unsqueeze(0).expand(b, s).contiguous(),
        attention_mask=torch.ones(1, 1, s, s, dtype=torch.bool).triu(diagonal=1),
        targets=targets,
        response_mask=response_mask,
        loss_mask=loss_mask,
        old_log_probs=old,
        has_old=torch.tensor([row.old_log_probs is not None for row in rows], dtype=torch.bool),
        advantages=torch.tensor([float(row.advantage) for row in rows], dtype=torch.float32),
        response_lens=[row.response_len for row in rows],
        prompt_lens=[row.prompt_len for row in rows],
    )


def build_micro_batches(samples: Sequence[TrainSample], *, max_tokens: int | None, micro_batch_size: int
                        ) -> list[MicroBatch]:
    groups = plan_micro_batches([len(s.tokens) for s in samples], max_tokens=max_tokens,
                                micro_batch_size=micro_batch_size)
    return [build_micro_batch(samples, g) for g in groups]
