"""GRPO's sample-level loss and Dr. GRPO's constant-normalised loss (--policy-loss grpo | dr_grpo).

Both keep DAPO's per-token clipped surrogate (`loss.clipped_token_loss`,
l_it = -min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i), r_it = pi_theta / pi_old per token)
and change only how the token terms become one number.

GRPO (DeepSeekMath, arXiv 2402.03300, Eq. 3; restated as Eq. 4 of DAPO, arXiv 2503.14476):

    L_GRPO = 1/G sum_i 1/|o_i| sum_t l_it

every response weighs the same, whatever its length (DAPO Sec. 3.3 argues this under-weights the tokens
of long responses).

Dr. GRPO (Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv 2503.20783,
Sec. 3.2): dropping 1/|o_i| removes the length bias (a wrong long answer is penalised less per token under
GRPO); the authors' code divides the token sums by a constant, the generation budget L_max, instead:

    L_DrGRPO = 1/G sum_i 1/L_max sum_t l_it

Dr. GRPO's other change, advantages without the std division, is the advantage estimator's
(--advantage-estimator dr_grpo, algorithm/advantages.py): the two flags are independent.

Deviations from the papers, shared with DAPO's loss:
- no KL term (beta = 0, as in DAPO and Dr. GRPO);
- the clip range is the flags' decoupled one (--clip-ratio-low/high, default 0.2 / 0.28); GRPO's symmetric
  eps = 0.2 is --clip-ratio-high 0.2;
- the dual clip (--clip-ratio-c) and TIS weights (--use-tis) apply to l_it as in the DAPO loss;
- G counts the responses with at least one loss token in the mini-batch (all groups together), as
  loss.aggregate's seq-mean modes do: a response masked out entirely (--overlong-filter) is not counted.
"""

from __future__ import annotations

from torch import Tensor

from megatron_dapo.algorithm.loss import (
    PolicyLossConfig,
    PolicyLossOutput,
    aggregate,
    clipped_token_loss,
    register_policy_loss,
    token_metrics,
)

GRPO_AGG_MODE = "seq-mean-token-mean"
"""The --loss-agg-mode GRPO's loss is defined with (the only one --policy-loss grpo accepts)."""


@register_policy_loss("grpo", help="mean over each response's tokens, then over responses")
def grpo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
              config: PolicyLossConfig, *, entropy: Tensor | None = None,
              is_weights: Tensor | None = None) -> PolicyLossOutput:
    """GRPO's sample-level loss: mean over each sequence's tokens, then mean over sequences.

    Arguments and metrics as `loss.policy_loss`. Numerator: sum over rows of the row's token-mean loss;
    denominator: the number of rows with at least one loss token. Both are sums of per-row terms and a
    row is a whole sequence, so any split of the rows over micro-batches, DP ranks or PP micro-batches
    sums to the single-batch loss. --loss-agg-mode must be unset or seq-mean-token-mean.
    """
    config.require_agg_mode(GRPO_AGG_MODE)
    token_loss, terms = clipped_token_loss(log_probs, old_log_probs, advantages, mask, config, is_weights=is_weights)
    loss_sum, denominator = aggregate(token_loss, terms.mask, GRPO_AGG_MODE)
    return PolicyLossOutput(loss_sum=loss_sum, denominator=denominator,
                            metrics=token_metrics(token_loss, terms, config, entropy))


@register_policy_loss("dr_grpo", help="token sums / --max-response-length")
def dr_grpo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
                 config: PolicyLossConfig, *, entropy: Tensor | None = None,
                 is_weights: Tensor | None = None) -> PolicyLossOutput:
    """Dr. GRPO's loss: each sequence's token sum divided by the constant L_max = config.max_response_length
    (--max-response-length), then the mean over sequences.

    Arguments and metrics as `loss.policy_loss`. Numerator: sum over rows of sum_t l_it / L_max (L_max is
    one constant for the run, so it factors out of any sum); denominator: the number of rows with at
    least one loss token, an integer. Both are sums of per-row terms over whole sequences: any split into
    micro-batches, DP ranks or PP micro-batches sums to the single-batch loss. Rejects --loss-agg-mode.
    """
    if config.agg_mode is not None:
        raise ValueError(f"--loss-agg-mode {config.agg_mode} contradicts --policy-loss {config.name}, whose "
                         "token sums are divided by --max-response-length; drop --loss-agg-mode")
    if config.max_response_length is None:
        raise ValueError(f"--policy-loss {config.name} divides by L_max: PolicyLossConfig.max_response_length "
                         "(--max-response-length) must be set")
    token_loss, terms = clipped_token_loss(log_probs, old_log_probs, advantages, mask, config, is_weights=is_weights)
    seq_sums, seqs = aggregate(token_loss, terms.mask, "seq-mean-token-sum")
    return PolicyLossOutput(loss_sum=seq_sums / config.max_response_length, denominator=seqs,
                            metrics=token_metrics(token_loss, terms, config, entropy))


__all__ = ["GRPO_AGG_MODE", "dr_grpo_loss", "grpo_loss"]
