"""Group-relative advantages (GRPO / DAPO, arXiv 2503.14476 Eq. 9).

    A_i = (R_i - mean({R_j}_{j=1..G})) / (std({R_j}_{j=1..G}) + eps)

one scalar per response, broadcast over its response tokens. The std is the population standard
deviation (unbiased=False) of the group; verl uses the unbiased one (torch.std default). With G = 16
the two differ by a factor sqrt(16/15); pick with `unbiased`. Groups of size 1 get advantage 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

ADV_EPS = 1e-6


def group_advantages(
    rewards: Tensor | Sequence[float],
    group_ids: Tensor | Sequence[int] | Sequence[str],
    *,
    eps: float = ADV_EPS,
    unbiased: bool = False,
    normalize_std: bool = True,
) -> Tensor:
    """Per-response advantage [N] from rewards [N] and the prompt group of each response.

    Groups may have different sizes and appear in any order. normalize_std=False gives Dr. GRPO's
    mean-centred advantage R - mean.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    keys = [g.item() if isinstance(g, Tensor) else g for g in group_ids]
    if len(keys) != rewards.numel():
        raise ValueError(f"got {rewards.numel()} rewards but {len(keys)} group ids; they must pair up")
    index: dict[object, list[int]] = {}
    for i, key in enumerate(keys):
        index.setdefault(key, []).append(i)
    adv = torch.zeros_like(rewards)
    for members in index.values():
        idx = torch.tensor(members)
        group = rewards[idx]
        if group.numel() == 1:
            continue
        centred = group - group.mean()
        if normalize_std:
            centred = centred / (group.std(unbiased=unbiased) + eps)
        adv[idx] = centred
    return adv.float()


def broadcast_to_tokens(advantages: Tensor, response_lengths: Sequence[int]) -> list[Tensor]:
    """Repeat each response's scalar advantage over its tokens: [N] -> N tensors of [len_i]."""
    if advantages.numel() != len(response_lengths):
        raise ValueError(f"{advantages.numel()} advantages for {len(response_lengths)} responses")
    return [torch.full((int(n),), float(a)) for a, n in zip(advantages.tolist(), response_lengths)]
