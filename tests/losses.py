"""Policy losses a user would add by dotted path (--policy-loss tests.losses:<name>), for the tests of a loss's own
metrics: one that declares an extra metric, one that reports a metric it does not declare, one whose metric takes the
KL term's name."""

from __future__ import annotations

from megatron_dapo.algorithm.loss import TOKEN_METRICS, policy_loss


def neg_adv_loss(log_probs, old_log_probs, advantages, mask, config, *, entropy=None, is_weights=None):
    """DAPO's loss, reporting one more token sum: 'neg_adv_tokens', the loss tokens whose advantage is negative."""
    out = policy_loss(log_probs, old_log_probs, advantages, mask, config, entropy=entropy, is_weights=is_weights)
    adv = advantages if advantages.dim() == mask.dim() else advantages[:, None].expand_as(mask)
    out.metrics["neg_adv_tokens"] = ((adv < 0).to(mask.dtype) * mask).sum().detach()
    return out


neg_adv_loss.metrics = (*TOKEN_METRICS, "neg_adv_tokens")


def undeclared_metric_loss(log_probs, old_log_probs, advantages, mask, config, *, entropy=None, is_weights=None):
    """neg_adv_loss without declaring 'neg_adv_tokens' (it has no `metrics` attribute: TOKEN_METRICS)."""
    return neg_adv_loss(log_probs, old_log_probs, advantages, mask, config, entropy=entropy, is_weights=is_weights)


def kl_named_loss(log_probs, old_log_probs, advantages, mask, config, *, entropy=None, is_weights=None):
    """DAPO's loss declaring a metric 'kl', the name the KL term's own metric takes (refused)."""
    out = policy_loss(log_probs, old_log_probs, advantages, mask, config, entropy=entropy, is_weights=is_weights)
    out.metrics["kl"] = out.metrics["approx_kl"]
    return out


kl_named_loss.metrics = (*TOKEN_METRICS, "kl")


POLICY_LOSS = ("--policy-loss", "tests.losses:neg_adv_loss")
"""Trainer flags that select neg_adv_loss."""
