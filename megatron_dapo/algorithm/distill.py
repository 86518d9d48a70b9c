"""On-policy distillation: a frozen teacher scores the student's own samples (--teacher-load, --distill-coef,
--distill-only).

The student samples o ~ pi_theta; the teacher (the same tokenizer) gives log pi_T(o_t) of every sampled token. The
per-token reverse KL, estimated at the student's own tokens,

    rkl_t = log pi_old(o_t) - log pi_T(o_t)

(pi_old: the student's policy that sampled them, the actor's recomputed old log-probs) is a per-token cost; its
negative is a per-token advantage that pushes up what the teacher prefers over the student and down what it does not
(on-policy distillation: Agarwal et al. 2024, "On-Policy Distillation of Language Models", arXiv 2306.13649, GKD
with the reverse KL and on-policy data; Thinking Machines, "On-Policy Distillation", 2025, the per-token reverse KL
as the advantage with no discount). Here

    A_t = A_i + coef * (log pi_T(o_t) - log pi_old(o_t))              (--distill-coef coef)
    A_t =       coef * (log pi_T(o_t) - log pi_old(o_t))              (--distill-only: no verifier term)

with A_i the verifier's group advantage, trained by the --policy-loss as any per-token advantage (detached: the
teacher term carries no gradient of its own; the gradient is the policy loss's, A_t r_t d log pi_theta, so each
token's reverse KL is pushed down through the importance ratio, clipped like any advantage). The same descent as a
loss term instead of an advantage is --ref-load TEACHER --kl-estimator k2 --kl-coef coef (k2's gradient
(log pi_theta - log pi_T) d log pi_theta is the per-token reverse KL's), for a teacher of the actor's architecture.

Metrics (token means over the step's loss tokens, all DP ranks): distill/reverse_kl (rkl_t), distill/teacher_logprob
(log pi_T), distill/advantage (coef * -rkl_t).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

DISTILL_SUM_KEYS: tuple[str, ...] = ("reverse_kl", "teacher_logprob", "advantage", "tokens")
"""The token sums `distill_sums` returns, in the order the trainer all-reduces them."""


@dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """--distill-coef, --distill-only (with --teacher-load)."""

    coef: float
    """> 0: the weight of the teacher's per-token advantage."""
    only: bool = False
    """No verifier advantage: the teacher's term alone."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.coef) and self.coef > 0.0):
            raise ValueError(f"coef (--distill-coef) must be a finite number > 0 with --teacher-load, got {self.coef}")


def distill_advantages(old_log_probs: Tensor, teacher_log_probs: Tensor, coef: float) -> Tensor:
    """coef * (log pi_T - log pi_old) per response token ([response_len] or any shape, fp32 or wider), detached."""
    if old_log_probs.shape != teacher_log_probs.shape:
        raise ValueError(f"old_log_probs {tuple(old_log_probs.shape)} and teacher_log_probs "
                         f"{tuple(teacher_log_probs.shape)} must have the same shape")
    dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
    return coef * (teacher_log_probs.detach().to(dtype) - old_log_probs.detach().to(dtype))


def distill_sums(old_log_probs: Tensor, teacher_log_probs: Tensor, mask: Tensor, coef: float) -> dict[str, float]:
    """Token sums over `mask` of the module's metrics (DISTILL_SUM_KEYS): add over samples and DP ranks, then divide
    by 'tokens'."""
    m = mask.to(torch.float64)
    rkl = old_log_probs.detach().to(torch.float64) - teacher_log_probs.detach().to(torch.float64)
    return {"reverse_kl": float((rkl * m).sum()), "teacher_logprob": float((teacher_log_probs.double() * m).sum()),
            "advantage": float((-coef * rkl * m).sum()), "tokens": float(m.sum())}


__all__ = ["DISTILL_SUM_KEYS", "DistillConfig", "distill_advantages", "distill_sums"]
