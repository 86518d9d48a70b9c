"""GSPO: Group Sequence Policy Optimization (Zheng et al., arXiv 2507.18071), --policy-loss gspo.

The importance ratio and its clipping move from tokens to sequences (Sec. 4.1):

    J_GSPO = E[ 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) ]
    s_i    = (pi_theta(y_i | x) / pi_old(y_i | x))^(1/|y_i|) = exp(1/|y_i| sum_t log r_it)

with A_i GRPO's group-normalised advantage (--advantage-estimator grpo, the default). We implement the
per-token form GSPO-token (Sec. 4.3):

    J_GSPO-token = E[ 1/G sum_i 1/|y_i| sum_t min(s_it A_it, clip(s_it, ...) A_it) ]
    s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]

s_it has the value s_i and the gradient of token t's own log-prob, so with A_it = A_i (the case here: one advantage
per response) its value and its gradient equal GSPO's exactly (tests/unit/algorithm/test_algorithm_losses.py checks
both against the sequence-level formula), and per-token advantages [B, S] also work.

The paper's clip ranges are far smaller than DAPO's (3e-4 / 4e-4, Sec. 5.1: a sequence ratio is a
geometric mean, near 1); this loss reads --clip-ratio-low / --clip-ratio-high as they are, so set them.

Deviations:
- the sequence log-ratio is clamped to [-20, 20] before exp, as the token log-ratio of the DAPO loss;
- TIS weights (--use-tis) multiply each token's term of the GSPO-token form; GSPO itself has no
  rollout-correction weights. The dual clip (--clip-ratio-c) has no sequence-level meaning here and is
  rejected;
- G counts the responses with at least one loss token in the mini-batch, as loss.aggregate's seq-mean modes.

Whole sequences: s_i needs all of response i's tokens in one place. They are: the loss sees one row per
response ([n, L], packed micro-batches are unpacked to rows by MicroBatch.unpack), the micro-batch plan
(actor/batching.plan_micro_batches) only groups whole samples and rejects a sample longer than the budget,
DP splits rows, and PP computes the loss on the last stage only. The mean log-ratio is taken per row, so
a packed micro-batch of several responses gets one s_i per response. Context parallelism (which would
split a sequence over ranks) is refused by the actor.
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

GSPO_AGG_MODE = "seq-mean-token-mean"
"""GSPO-token's aggregation: 1/G over sequences of 1/|y_i| over tokens (the only --loss-agg-mode accepted)."""


def sequence_log_ratio(log_probs: Tensor, old_log_probs: Tensor, mask: Tensor) -> Tensor:
    """[B] log s_i = the mean of log pi_theta - log pi_old over each row's loss tokens (0 for a row with
    none), clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP]. Rows are whole sequences."""
    tokens = mask.sum(dim=-1)
    mean = ((log_probs - old_log_probs) * mask).sum(dim=-1) / tokens.clamp(min=1.0)
    return torch.clamp(mean, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


@register_policy_loss("gspo", help="sequence-level ratio and clip, arXiv 2507.18071; set its small clip range, e.g. "
                                   "--clip-ratio-low 3e-4 --clip-ratio-high 4e-4")
def gspo_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
              config: PolicyLossConfig, *, entropy: Tensor | None = None,
              is_weights: Tensor | None = None) -> PolicyLossOutput:
    """GSPO (in its GSPO-token form) on a micro-batch of whole sequences, one per row.

    Arguments as `loss.policy_loss`. Numerator: sum over rows of 1/|y_i| sum_t of the clipped term;
    denominator: the number of rows with at least one loss token. s_i is computed per row and both sums
    are over rows, so any split of the rows (micro-batches, DP ranks, PP micro-batches) sums to the
    single-batch loss. Metrics as policy_loss's, with the ratio being s_i (each token of response i counts
    s_i; clipfrac_high/low count the tokens of clipped responses) and approx_kl the per-token k1 estimate.
    Rejects --clip-ratio-c and a --loss-agg-mode other than seq-mean-token-mean.
    """
    if config.dual_clip_c is not None:
        raise ValueError(f"--clip-ratio-c {config.dual_clip_c} does not apply to --policy-loss {config.name} "
                         "(the sequence-level ratio has no dual clip); drop --clip-ratio-c")
    config.require_agg_mode(GSPO_AGG_MODE)
    log_probs, old_log_probs, advantages, maskf = prepare_inputs(log_probs, old_log_probs, advantages, mask)
    seq_log_ratio = sequence_log_ratio(log_probs.detach(), old_log_probs, maskf)  # [B], sg[log s_i]
    # s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]: value s_i, gradient d log pi_theta(y_it)
    ratio = torch.exp(seq_log_ratio.unsqueeze(-1) + log_probs - log_probs.detach())
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    token_loss = apply_is_weights(torch.maximum(unclipped, clipped), is_weights)
    loss_sum, denominator = aggregate(token_loss, maskf, GSPO_AGG_MODE)
    token_log_ratio = torch.clamp(log_probs.detach() - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    terms = SurrogateTerms(ratio=ratio.detach(), log_ratio=token_log_ratio, advantages=advantages, mask=maskf,
                           dual_active=torch.zeros_like(maskf, dtype=torch.bool))
    return PolicyLossOutput(loss_sum=loss_sum, denominator=denominator,
                            metrics=token_metrics(token_loss, terms, config, entropy))
