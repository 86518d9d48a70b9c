"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585, Sec. 3.1, Eq. 4-5), --policy-loss
cispo.

PPO's clip (and DAPO's) zeroes the gradient of a token whose ratio left the clip range in the direction of its
advantage; the rare, low-probability tokens that fork a reasoning chain ("However", "Wait") are the first to go.
CISPO clips the importance-sampling weight instead and keeps every token's gradient:

    J_CISPO = E[ 1/sum_i |o_i| * sum_i sum_t sg(r^_it) A_it log pi_theta(o_it) ]
    r^_it   = clip(r_it, 1 - eps_low, 1 + eps_high),   r_it = pi_theta(o_it) / pi_old(o_it)

so d J / d theta = 1/N sum r^_it A_it d log pi_theta(o_it): a REINFORCE gradient weighted by the clipped ratio.

We minimise the per-token term l_it = -sg(r^_it / r_it) * r_it * A_it, whose gradient is CISPO's exactly
(d r_it = r_it d log pi_theta) and whose value, -r^_it A_it, is the clipped surrogate the other losses report as
pg_loss (the paper's -sg(r^) A log pi has the same gradient and a value that depends on log pi itself). A token
outside the clip range keeps the gradient -r^ A d log pi, where PPO's is 0: its loss value is flat in r there, so
the gradient is not the derivative of the value (by design; finite differences see 0).

Flags: the weight's range is --clip-ratio-low / --clip-ratio-high. The paper sets no lower bound ("we did not impose
a lower bound on the IS weight by setting eps_low to a large value; we only tuned eps_high"): --clip-ratio-low 1
gives r^ >= 0, i.e. none; the flags' defaults (0.2 / 0.28) are DAPO's, so give CISPO's range yourself. Token-mean
aggregation (Eq. 4's 1/sum_i |o_i|); --loss-agg-mode may choose another. --clip-ratio-c (the dual clip of a
min(.,.) surrogate) has no meaning here and is refused. TIS / IcePop weights (--use-tis, --use-icepop) multiply
each token's term, as in every loss.

Metrics: those of every loss (loss.token_metrics), with clipfrac_high / clipfrac_low the share of tokens whose weight
was clipped at 1 + eps_high / 1 - eps_low whatever the sign of their advantage (they keep their gradient).
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_dapo.algorithm.loss import (
    LOG_RATIO_CLAMP,
    PolicyLossConfig,
    PolicyLossOutput,
    SurrogateTerms,
    aggregate,
    apply_is_weights,
    prepare_inputs,
    register_policy_loss,
    token_metrics,
)


@register_policy_loss("cispo", help="clipped importance weight, detached, on every token (no token leaves the "
                                    "gradient), MiniMax-M1 arXiv 2506.13585; the paper: --clip-ratio-low 1 (no "
                                    "lower bound), tune --clip-ratio-high")
def cispo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
               config: PolicyLossConfig, *, entropy: Tensor | None = None,
               is_weights: Tensor | None = None) -> PolicyLossOutput:
    """CISPO on a micro-batch (module docstring). Arguments as `loss.policy_loss`; aggregated by --loss-agg-mode
    (token-mean, the paper's, when unset): the numerator and denominator are sums over rows, so any split of the
    rows sums to the single-batch loss. Rejects --clip-ratio-c."""
    if config.dual_clip_c is not None:
        raise ValueError(f"--clip-ratio-c {config.dual_clip_c} does not apply to --policy-loss {config.name} (it "
                         "caps a min(r A, clip(r) A) surrogate; CISPO clips the weight of a REINFORCE term); drop "
                         "--clip-ratio-c")
    log_probs, old_log_probs, advantages, maskf = prepare_inputs(log_probs, old_log_probs, advantages, mask)
    log_ratio = torch.clamp(log_probs - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio.detach())
    weight = torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)  # r^, detached
    # value r^, gradient r^ d log pi_theta: sg(r^ / r) * r with r = exp(log_ratio) kept in the graph
    token_loss = apply_is_weights(-advantages * weight * torch.exp(log_ratio - log_ratio.detach()), is_weights)
    loss_sum, denominator = aggregate(token_loss, maskf, config.agg_mode or "token-mean")
    terms = SurrogateTerms(ratio=ratio, log_ratio=log_ratio.detach(), advantages=advantages, mask=maskf,
                           dual_active=torch.zeros_like(maskf, dtype=torch.bool))
    metrics = token_metrics(token_loss, terms, config, entropy)
    with torch.no_grad():  # the weight is clipped whatever the advantage's sign
        metrics["clipfrac_high"] = ((ratio > 1.0 + config.eps_high).to(maskf.dtype) * maskf).sum()
        metrics["clipfrac_low"] = ((ratio < 1.0 - config.eps_low).to(maskf.dtype) * maskf).sum()
    return PolicyLossOutput(loss_sum=loss_sum, denominator=denominator, metrics=metrics)


__all__ = ["cispo_loss"]
