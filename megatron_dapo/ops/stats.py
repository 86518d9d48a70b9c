"""Named steps of the token log-prob / entropy maths, shared by every backend.

For one row of logits x [V] (the full vocabulary, possibly split over TP ranks) with max m:

    s = sum_j e^(x_j - m)                  (sum-exp, shifted)
    a = sum_j e^(x_j - m) (x_j - m)        (shifted entropy accumulator)
    lse = m + log s,  log p_t = x_t - lse,  H = log s - a / s

H = log s - a/s is the textbook H = lse - sum_j p_j x_j rewritten around the max: both terms stay O(1)
instead of cancelling two O(|x|) numbers, which loses ~1e-4 in fp32 at V=32000.

Backward (per logit j, with upstream gradients g_lp for log p_t and g_h for H):

    d/dx_j = g_lp (1[j = t] - p_j) - g_h p_j (log p_j + H)

so it needs only lse and H per row; under vocab parallelism each rank computes its own slice with the
*global* lse and H, and no communication happens in backward.

Partial statistics (`RowStats`) over disjoint vocab slices are merged by rescaling to a common max
(`rescale_to`), exactly as the online log-sum-exp of the Triton kernel merges vocab tiles and as the
vocab-parallel combine merges TP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# x - m is clamped here before exp/multiply so that -inf logits give e=0 and e*(x-m)=0, not 0*inf=nan.
NEG_FINITE = -1e30


@dataclass(frozen=True)
class RowStats:
    """Per-row partial statistics over a vocab slice; all [N], in the compute dtype (fp32 or fp64).

    max: running max m of the slice (-inf for an empty or all -inf slice).
    sumexp: s = sum e^(x - m_safe), where m_safe is m with -inf replaced by 0.
    ent_acc: a = sum e^(x - m_safe)(x - m_safe), or None when entropy is not requested.
    target_logit: x_t if the target id lies in this slice, else 0 (so slices combine by summation).
    """

    max: Tensor
    sumexp: Tensor
    ent_acc: Tensor | None
    target_logit: Tensor


def concat_stats(parts: list[RowStats]) -> RowStats:
    """Stats of consecutive row chunks -> stats of all rows (concatenated along N)."""
    def cat(name: str) -> Tensor | None:
        first = getattr(parts[0], name)
        return None if first is None else torch.cat([getattr(p, name) for p in parts])
    return RowStats(max=cat("max"), sumexp=cat("sumexp"), ent_acc=cat("ent_acc"),
                    target_logit=cat("target_logit"))


def safe_max(m: Tensor) -> Tensor:
    """m with -inf (empty/all -inf rows) replaced by 0, so x - m_safe never forms -inf - -inf."""
    return torch.where(torch.isneginf(m), torch.zeros_like(m), m)


def rescale_to(stats: RowStats, new_max: Tensor) -> RowStats:
    """Express `stats` relative to `new_max` [N] (>= stats.max): s' = s e^d, a' = e^d (a + d s), d = m - M."""
    shift = safe_max(stats.max) - safe_max(new_max)  # <= 0
    scale = torch.exp(shift)
    sumexp = stats.sumexp * scale
    ent_acc = None
    if stats.ent_acc is not None:
        # A slice whose max sits far below M (e.g. a TP shard of padded vocab only, filled with finfo.min / 2)
        # has scale == 0 while shift * s overflows to -inf: 0 * inf = nan in the value and in its gradient.
        # e^d d -> 0 as d -> -inf, so such a slice contributes 0; the shift is zeroed before it is multiplied.
        shift = torch.where(scale > 0, shift, torch.zeros_like(shift))
        # Rows with s == 0 contribute nothing; the where avoids (-inf) * 0 when the slice was empty.
        moved = scale * (stats.ent_acc + shift * stats.sumexp)
        ent_acc = torch.where(stats.sumexp > 0, moved, torch.zeros_like(moved))
    return RowStats(max=new_max, sumexp=sumexp, ent_acc=ent_acc, target_logit=stats.target_logit)


def finalize(stats: RowStats) -> tuple[Tensor, Tensor, Tensor | None]:
    """Full-vocabulary stats -> (lse [N], log p_t [N], entropy [N] or None)."""
    log_s = torch.log(stats.sumexp)
    lse = safe_max(stats.max) + log_s
    logp = stats.target_logit - lse
    entropy = None if stats.ent_acc is None else log_s - stats.ent_acc / stats.sumexp
    return lse, logp, entropy


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 stays fp64 (gradcheck), every other float dtype accumulates in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def local_targets(targets: Tensor, vocab_start: int, vocab_local: int) -> Tensor:
    """Global ids [N] -> ids local to the slice [vocab_start, vocab_start + vocab_local), -1 if elsewhere."""
    local = targets.long() - vocab_start
    inside = (local >= 0) & (local < vocab_local)
    return torch.where(inside, local, torch.full_like(local, -1))
