"""Group-relative advantages (GRPO / DAPO, arXiv 2503.14476 Eq. 9).

    A_i = (R_i - mean({R_j}_{j=1..G})) / (std({R_j}_{j=1..G}) + eps)

one scalar per response, broadcast over its response tokens, eps = 1e-6. The std is the unbiased
(Bessel-corrected, divide by G - 1) sample standard deviation of the group, as verl's DAPO recipe computes
it (`torch.std` in `compute_grpo_outcome_advantage`); the paper's Eq. 9 writes "std" without saying which.
The population std (`unbiased=False`, divide by G) would make every advantage sqrt(G / (G - 1)) larger,
1.033x at G = 16. Groups of size 1 get advantage 0 (verl: the raw score; unreachable with dynamic
sampling, which needs G >= 2).

Registered estimators (--advantage-estimator: `@register_advantage_estimator` below; algorithm/registry.py chooses
one), each fn(rewards, group_ids) -> [N]:
- grpo: the formula above (`grpo_advantages`); GSPO (arXiv 2507.18071, Sec. 4.1) uses it unchanged;
- dr_grpo: Dr. GRPO (arXiv 2503.20783, Sec. 3.2), A_i = R_i - mean({R_j}): no division by the group's std,
  which the paper shows weights questions by their difficulty (`dr_grpo_advantages`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch
from torch import Tensor

from megatron_dapo.dotted_path import Registry

ADV_EPS = 1e-6

AdvantageFn = Callable[[Tensor, Sequence[Hashable]], Tensor]
"""fn(rewards: Tensor [N] float64, group_ids: Sequence[Hashable] [N]) -> Tensor [N]: one advantage per response,
broadcast over its response tokens; the signature of every --advantage-estimator (docs/ALGORITHMS.md)."""

ADVANTAGE_ESTIMATOR_SIGNATURE = "fn(rewards: Tensor[N], group_ids: Sequence[Hashable]) -> Tensor[N]"

ADVANTAGE_ESTIMATORS = Registry("--advantage-estimator", ADVANTAGE_ESTIMATOR_SIGNATURE, "megatron_dapo.algorithm")
"""--advantage-estimator's names: every estimator of megatron_dapo/algorithm/ registered with
`register_advantage_estimator("name", help=...)` (help: its description in the flag's help)."""
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register


def group_advantages(
    rewards: Tensor | Sequence[float],
    group_ids: Tensor | Sequence[int] | Sequence[str],
    *,
    eps: float = ADV_EPS,
    unbiased: bool = True,
    normalize_std: bool = True,
) -> Tensor:
    """Per-response advantage [N] from rewards [N] and the prompt group of each response.

    Groups may have different sizes and appear in any order. unbiased=True (default) divides the group's
    squared deviations by G - 1, as verl does; normalize_std=False gives Dr. GRPO's mean-centred R - mean.
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


@register_advantage_estimator("grpo", help="(R - mean) / (std + 1e-6) within each prompt group; what GSPO uses")
def grpo_advantages(rewards: Tensor | Sequence[float], group_ids: Sequence[Hashable]) -> Tensor:
    """GRPO / DAPO Eq. 9: (R_i - mean) / (std + 1e-6) within each prompt group, unbiased std
    (--advantage-estimator grpo, the default; also GSPO's)."""
    return group_advantages(rewards, group_ids)


@register_advantage_estimator("dr_grpo", help="R - mean, no std division")
def dr_grpo_advantages(rewards: Tensor | Sequence[float], group_ids: Sequence[Hashable]) -> Tensor:
    """Dr. GRPO (arXiv 2503.20783, Sec. 3.2): R_i - mean within each prompt group, no std normalisation
    (--advantage-estimator dr_grpo)."""
    return group_advantages(rewards, group_ids, normalize_std=False)


def broadcast_to_tokens(advantages: Tensor, response_lengths: Sequence[int]) -> list[Tensor]:
    """Repeat each response's scalar advantage over its tokens: [N] -> N tensors of [len_i]."""
    if advantages.numel() != len(response_lengths):
        raise ValueError(f"{advantages.numel()} advantages for {len(response_lengths)} responses")
    return [torch.full((int(n),), float(a)) for a, n in zip(advantages.tolist(), response_lengths, strict=True)]
