"""KL to a frozen reference policy: the per-token estimators, the loss term and the reward penalty (--kl-coef,
--kl-estimator, --kl-in-reward).

GRPO (DeepSeekMath, arXiv 2402.03300, Eq. 3-4) adds -beta * D_KL(pi_theta || pi_ref) inside its objective and
estimates it per sampled token o_t ~ pi_theta with Schulman's unbiased, always non-negative estimator (Eq. 4):

    k3 = pi_ref(o_t) / pi_theta(o_t) - log(pi_ref(o_t) / pi_theta(o_t)) - 1 = exp(-d) + d - 1,
    d  = log pi_theta(o_t) - log pi_ref(o_t)

The other two of Schulman's "Approximating KL Divergence" (http://joschu.net/blog/kl-approx.html), by the names
verl and OpenRLHF give them:

    k1 = d                  unbiased, any sign, high variance               ("k1", verl "kl")
    k2 = d^2 / 2            biased, low variance, >= 0                      ("k2", verl "mse")
    k3 = exp(-d) + d - 1    unbiased, low variance, >= 0 (GRPO's)           ("k3", verl "low_var_kl")

Each is differentiated as written (the gradient flows through log pi_theta; log pi_ref is a constant). d is clamped
to [-20, 20] before exp, as every log-ratio here (loss.LOG_RATIO_CLAMP), so k3 cannot overflow.

Two placements of beta * KL, as in verl (`actor.use_kl_loss` / `algorithm.use_kl_in_reward`):

- in the loss (--kl-coef beta, the default placement; `kl_loss_term`): beta times the estimator of log pi_theta -
  log pi_ref aggregated like the policy loss's own terms, so the sum shares the loss's denominator and stays exact
  under any split into micro-batches and DP ranks: token-mean when the loss's denominator counts tokens (dapo,
  cispo, decoupled: DAPO's 1/sum|o_i|), seq-mean-token-mean when it counts responses (grpo, gspo, dr_grpo: GRPO's
  1/G sum_i 1/|o_i| sum_t, where Eq. 3 puts the KL), or --loss-agg-mode when given (`kl_agg_mode`);
- in the reward (--kl-in-reward; `kl_response_sum`, `kl_penalized_advantages`): no loss term; each response's reward
  (verifier + overlong shaping) becomes

      r_i' = r_i - beta * sum_t m_it k(log pi_old(o_it) - log pi_ref(o_it))

  over its loss tokens (m_it, the loss mask), with pi_old the pre-update policy that scored the batch (no gradient),
  and the --advantage-estimator recomputes every advantage from the r_i'. verl puts -beta * k_t on each token's
  reward (`apply_kl_penalty`) and its GRPO outcome advantage sums the token rewards over the response: the same r_i'.
  Deviations from verl: beta is fixed (verl's kl_ctrl "fixed"; no adaptive controller), and k3 is clamped through d
  as above (verl clamps k3 itself to [-10, 10]).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_dapo.algorithm.advantages import AdvantageFn
from megatron_dapo.algorithm.loss import AGG_MODES, LOG_RATIO_CLAMP, AggMode, aggregate

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def kl_estimate(log_probs: Tensor, ref_log_probs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) at tokens sampled from pi_theta, [B, S] (any shape), in the
    wider of the inputs' dtype and fp32; the gradient flows through `log_probs` only (module docstring)."""
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} must "
                         f"have the same shape")
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    d = torch.clamp(log_probs.to(dtype) - ref_log_probs.detach().to(dtype), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"estimator (--kl-estimator) must be one of {KL_ESTIMATORS}, got {estimator!r}")


@dataclass(frozen=True, kw_only=True)
class KLConfig:
    """The KL term to the reference model (--kl-coef, --kl-estimator); coef 0 with a reference model logs train/kl
    without adding it to the loss."""

    coef: float = 0.0
    """beta (--kl-coef), >= 0."""
    estimator: str = "k3"
    """--kl-estimator: k1, k2 or k3 (GRPO's, the default)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.coef) and self.coef >= 0.0):
            raise ValueError(f"coef (--kl-coef) must be a finite number >= 0, got {self.coef}")
        if self.estimator not in KL_ESTIMATORS:
            raise ValueError(f"estimator (--kl-estimator) must be one of {KL_ESTIMATORS}, got {self.estimator!r}")


def kl_agg_mode(counts_tokens: bool, agg_mode: AggMode | None) -> AggMode:
    """How the KL term aggregates beside a policy loss: --loss-agg-mode when given, else token-mean when the loss's
    denominator counts tokens and seq-mean-token-mean when it counts responses (module docstring)."""
    if agg_mode is not None:
        if agg_mode not in AGG_MODES:
            raise ValueError(f"agg_mode (--loss-agg-mode) must be one of {AGG_MODES}, got {agg_mode!r}")
        return agg_mode
    return "token-mean" if counts_tokens else "seq-mean-token-mean"


def kl_loss_term(log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor, config: KLConfig, agg_mode: AggMode
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """(coef x the aggregated estimator's numerator, its denominator, the estimator's token sum) of a micro-batch of
    [B, S] rows under `mask`: add the first to the policy loss's numerator (the denominators agree by `kl_agg_mode`);
    the token sum over mask is the train/kl metric (divided by the token count)."""
    kl = kl_estimate(log_probs, ref_log_probs, config.estimator)
    numerator, denominator = aggregate(kl, mask, agg_mode)
    with torch.no_grad():
        token_sum = (kl.detach() * mask.to(kl.dtype)).sum()
    return config.coef * numerator, denominator, token_sum


def kl_response_sum(old_log_probs: Tensor, ref_log_probs: Tensor, mask: Tensor, estimator: str) -> float:
    """sum_t mask_t k(log pi_old - log pi_ref) over one response's tokens ([response_len] each), in float64, no
    gradient: the KL that --kl-in-reward takes from the response's reward (times beta; module docstring)."""
    with torch.no_grad():
        kl = kl_estimate(old_log_probs.detach().double(), ref_log_probs.double(), estimator)
        return float((kl * mask.double()).sum())


def kl_penalized_advantages(rewards: Tensor, group_ids: Sequence[Hashable], kl_sums: Tensor, coef: float,
                            advantage_fn: AdvantageFn) -> Tensor:
    """The advantages [N] of the step's N responses under --kl-in-reward: `advantage_fn` (the --advantage-estimator)
    of the penalised rewards r_i - coef * kl_sums_i (float64 [N] each; group_ids [N], the prompt group of each), as
    the estimator would compute them from plain rewards. A response without tokens has kl_sums_i = 0: it keeps its
    reward and still counts in its group's statistics."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    kl_sums = torch.as_tensor(kl_sums, dtype=torch.float64)
    if rewards.shape != kl_sums.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and kl_sums {tuple(kl_sums.shape)} must both be [N]")
    return advantage_fn(rewards - coef * kl_sums, group_ids)


__all__ = ["KL_ESTIMATORS", "KLConfig", "kl_agg_mode", "kl_estimate", "kl_loss_term", "kl_penalized_advantages",
           "kl_response_sum"]
