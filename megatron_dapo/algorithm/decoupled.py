"""Decoupled PPO (AReaL, Fu et al. 2025, arXiv 2505.24298, the "decoupled PPO objective"),
--policy-loss decoupled.

Asynchronous rollouts sample a response's tokens from a behaviour policy pi_behav, possibly several weight
versions behind the actor and different from token to token. The decoupled objective separates the policy the
update is kept close to (the proximal policy pi_prox) from the one that sampled the data:

    J(theta) = E[ 1 / sum_i |o_i| * sum_i sum_t  w_it * min(u_it A_it, clip(u_it, 1 - eps, 1 + eps) A_it) ]
    u_it = pi_theta(o_it) / pi_prox(o_it),    w_it = pi_prox(o_it) / pi_behav(o_it)

Here pi_prox is our pi_old, the actor's log-probs recomputed before the step (`MegatronActor.compute_log_probs`,
so `old_log_probs` below), and pi_behav the rollout's per-token log-probs (`Sample.rollout_log_probs`, each token's
from whatever weight version made it). The trainer passes w_it as `is_weights`, uncapped, because this loss is
registered with behaviour_weights=True (`OffPolicyConfig.behaviour_weights`, trainer/loop.py `Trainer._mismatch`).

Deviations, all as AReaL's implementation (areal/utils/functional.py `ppo_actor_loss_fn`):
- the clip is DAPO's decoupled one (--clip-ratio-low / --clip-ratio-high), the dual clip (--clip-ratio-c) applies
  before the weight;
- --behav-weight-cap C (> 1, unset = the paper's uncapped weight): a token with w_it > C gets weight 0 (it leaves
  the numerator and stays in the denominator, AReaL's behav_imp_weight_cap), not min(w, C) as TIS;
- the log-ratios are clamped to [-20, 20] before exp (mismatch.py, loss.py).

How it differs from --use-tis with the dapo loss (docs/ALGORITHMS.md, "TIS and the decoupled objective"): the
same weighted token term, the same detached weight and the same token-mean, with TIS's weight truncated,
min(w, C) for a finite C >= 1, where this one is w uncapped or zeroed above C.

Metrics: TOKEN_METRICS plus `behav_weight` (sum of the weight applied, after the cap; as a mean: the mean weight)
and `behav_capped` (tokens whose weight the cap zeroed; as a mean: the share capped). The maximum of w over the
step is `mismatch/is_ratio_max` (the same ratio, algorithm/mismatch.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dapo.algorithm.loss import (
    TOKEN_METRICS,
    PolicyLossConfig,
    PolicyLossOutput,
    aggregate,
    apply_is_weights,
    clipped_token_loss,
    register_policy_loss,
    token_metrics,
)

DECOUPLED_AGG_MODE = "token-mean"
"""The aggregation of the decoupled objective (1 / sum_i |o_i|): the only --loss-agg-mode it accepts."""
DECOUPLED_METRICS: tuple[str, ...] = (*TOKEN_METRICS, "behav_weight", "behav_capped")


def behaviour_weights(is_weights: Tensor | None, like: Tensor, cap: float | None) -> tuple[Tensor, Tensor]:
    """(weight applied [B, S], capped [B, S] bool): w (1 where is_weights is None) with tokens above `cap`
    set to 0; detached, in `like`'s dtype."""
    w = torch.ones_like(like) if is_weights is None else is_weights.detach().to(like.dtype)
    if w.shape != like.shape:
        raise ValueError(f"is_weights {tuple(w.shape)} must have the [B, S] shape of log_probs {tuple(like.shape)}")
    capped = torch.zeros_like(w, dtype=torch.bool) if cap is None else w > cap
    return torch.where(capped, 0.0, w), capped


@register_policy_loss("decoupled", behaviour_weights=True, metrics=DECOUPLED_METRICS,
                      help="AReaL's decoupled PPO: clip against pi_old (the proximal policy), each token weighted "
                           "by pi_old / pi_rollout, uncapped or zeroed above --behav-weight-cap; token-mean")
def decoupled_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
                   config: PolicyLossConfig, *, entropy: Tensor | None = None,
                   is_weights: Tensor | None = None) -> PolicyLossOutput:
    """The decoupled PPO objective (module docstring) on a micro-batch: token-mean of w_it times the clipped
    term against pi_old, `is_weights` = w_it = pi_old / pi_rollout (None: w = 1, the on-policy case).

    Arguments as `loss.policy_loss`. Numerator: sum over loss tokens of w_it * l_it; denominator: the loss tokens
    (capped ones included): both token sums, so any split of the rows sums to the single-batch loss. Metrics:
    policy_loss's plus behav_weight and behav_capped (module docstring). Rejects a --loss-agg-mode other than
    token-mean."""
    config.require_agg_mode(DECOUPLED_AGG_MODE)
    token_loss, terms = clipped_token_loss(log_probs, old_log_probs, advantages, mask, config)
    weight, capped = behaviour_weights(is_weights, token_loss.detach(), config.behav_weight_cap)
    token_loss = apply_is_weights(token_loss, weight)
    loss_sum, denominator = aggregate(token_loss, terms.mask, DECOUPLED_AGG_MODE)
    metrics = token_metrics(token_loss, terms, config, entropy)
    metrics["behav_weight"] = (weight * terms.mask).sum()
    metrics["behav_capped"] = (capped.to(terms.mask.dtype) * terms.mask).sum()
    return PolicyLossOutput(loss_sum=loss_sum, denominator=denominator, metrics=metrics)


__all__ = ["DECOUPLED_AGG_MODE", "DECOUPLED_METRICS", "behaviour_weights", "decoupled_loss"]
