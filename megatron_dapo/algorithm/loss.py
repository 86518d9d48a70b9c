"""DAPO policy loss: decoupled clip (Clip-Higher) with token-level aggregation.

Paper: DAPO, arXiv 2503.14476, Eq. 8 (objective) and Eq. 10 (Clip-Higher):

    J(theta) = E[ 1 / sum_i |o_i| * sum_i sum_t min(r_it * A_it,
                                                    clip(r_it, 1 - eps_low, 1 + eps_high) * A_it) ]

with r_it = pi_theta(o_it | q, o_i,<t) / pi_old(o_it | q, o_i,<t). We minimise the negative.

Deviations, all off by default or numerically motivated:
- the log-ratio is clamped to [-20, 20] before exp, so one badly off token cannot overflow;
- optional dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"): for A < 0 the loss is
  capped at -c * A, c > 1. DAPO does not use it (dual_clip_c=None);
- two other aggregations are kept for comparison (--loss-agg-mode): `seq-mean-token-mean` (GRPO, Eq. 4 of
  the paper; also --policy-loss grpo) and `seq-mean-token-sum` (Dr. GRPO style, no length normalisation
  inside a sequence; --policy-loss dr_grpo further divides by L_max).

Why the loss is returned as (numerator, denominator) rather than a mean: a mini-batch is split into
micro-batches (and, with PP, pipelined; with DP, spread over ranks). The token-level mean needs the
mini-batch's *global* token count, which no micro-batch knows. Every aggregation here is a sum of
per-item terms divided by a count of items (tokens or sequences), so each micro-batch contributes
`loss_sum` and `denominator` and

    loss = sum over micro-batches and DP ranks of loss_sum / sum of denominator

is exactly the single-batch loss for any split. Megatron's `calculate_per_token_loss=True` performs
precisely this reduction when the loss function returns (loss_sum, denominator, metrics); it sums the
denominator as an integer, so every denominator here counts something (tokens or sequences).

This module also holds what every registered loss shares (docs/ALGORITHMS.md): the config, the output
type, `aggregate`, the per-token clipped surrogate `clipped_token_loss` that GRPO and Dr. GRPO
(algorithm/grpo_loss.py) reuse, and the registry the losses join with `@register_policy_loss("name", help=...,
metrics=...)` beside their definition (--policy-loss; GSPO is in algorithm/gspo.py). algorithm/registry.py
chooses one for the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from megatron_dapo.dotted_path import Registry, qualified_name

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    eps_low: float = 0.2
    """Lower clip range: ratio is clipped at 1 - eps_low (--clip-ratio-low); 1 = no lower clip (CISPO's paper)."""
    eps_high: float = 0.28
    """Upper clip range: ratio is clipped at 1 + eps_high (--clip-ratio-high). DAPO's Clip-Higher."""
    dual_clip_c: float | None = None
    """Dual-clip constant c > 1 for negative advantages (--clip-ratio-c); None disables it, as in DAPO."""
    agg_mode: AggMode | None = None
    """How DAPO's loss turns token losses into one number (--loss-agg-mode); None = token-mean, DAPO's
    token-level loss. The other registered losses fix their own aggregation and reject a different one."""
    max_response_length: int | None = None
    """L_max (--max-response-length): the constant Dr. GRPO divides token sums by; only dr_grpo reads it."""
    behav_weight_cap: float | None = None
    """Cap of the behaviour weight pi_prox / pi_behav (--behav-weight-cap, > 1): a token whose weight exceeds it
    leaves the numerator (weight 0), as AReaL's behav_imp_weight_cap; None = uncapped, the paper's objective. Only
    a loss registered with behaviour_weights=True (--policy-loss decoupled) reads it."""
    name: str = "dapo"
    """The --policy-loss value (a registered name or a dotted path): what `fn` is, for messages."""
    counts_tokens: bool | None = None
    """What the loss's denominator counts: True tokens, False responses, None unknown (a dotted-path loss whose
    trial denominator is neither). Found by algorithm.registry.policy_loss_config's trial batch (DAPO's own loss:
    from agg_mode); the KL term aggregates to the same denominator (algorithm/kl.py: kl_agg_mode)."""
    fn: PolicyLossFn | None = field(default=None, repr=False, compare=False)
    """The loss function, chosen once when the run is built (algorithm.registry.policy_loss_config);
    None = DAPO's `policy_loss` (name must then be 'dapo'). The actor calls `config.fn(..., config)`."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eps_low <= 1.0:
            raise ValueError(f"eps_low (--clip-ratio-low) must be in [0, 1] (1: no lower clip, the ratio is >= 0), "
                             f"got {self.eps_low}")
        if self.eps_high < 0.0:
            raise ValueError(f"eps_high (--clip-ratio-high) must be >= 0, got {self.eps_high}")
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(f"dual_clip_c (--clip-ratio-c) must be > 1 or unset, got {self.dual_clip_c}")
        if self.agg_mode is not None and self.agg_mode not in AGG_MODES:
            raise ValueError(f"agg_mode (--loss-agg-mode) must be one of {AGG_MODES}, got {self.agg_mode!r}")
        if self.max_response_length is not None and self.max_response_length < 1:
            raise ValueError(f"max_response_length (--max-response-length) must be >= 1, got "
                             f"{self.max_response_length}")
        if self.behav_weight_cap is not None and not (math.isfinite(self.behav_weight_cap)
                                                      and self.behav_weight_cap > 1.0):
            raise ValueError(f"behav_weight_cap (--behav-weight-cap) must be a finite number > 1 or unset, got "
                             f"{self.behav_weight_cap}")
        if self.fn is None:
            if self.name != "dapo":
                raise ValueError(f"PolicyLossConfig(name={self.name!r}) needs its fn: build it with "
                                 "megatron_dapo.algorithm.registry.policy_loss_config (--policy-loss)")
            object.__setattr__(self, "fn", policy_loss)  # frozen: set once, here
        if self.counts_tokens is None and self.fn is policy_loss:
            object.__setattr__(self, "counts_tokens", self.agg_mode in (None, "token-mean"))

    @property
    def metrics(self) -> tuple[str, ...]:
        """The token sums `fn` reports (`declared_metrics`): the keys the actor reduces and logs."""
        return declared_metrics(self.fn)

    def require_agg_mode(self, own: str) -> None:
        """Raise ValueError naming --loss-agg-mode and --policy-loss when --loss-agg-mode was set to something
        other than `own`, the aggregation that loss `self.name` is defined with (never ignore a flag)."""
        if self.agg_mode is not None and self.agg_mode != own:
            raise ValueError(f"--loss-agg-mode {self.agg_mode} contradicts --policy-loss {self.name}, which "
                             f"aggregates {own} by definition; drop --loss-agg-mode, or use --policy-loss dapo "
                             f"--loss-agg-mode {self.agg_mode}")


@dataclass
class PolicyLossOutput:
    loss_sum: Tensor
    """Scalar numerator of this micro-batch's share of the loss."""
    denominator: Tensor
    """Scalar: this micro-batch's share of the normaliser, an integer count (tokens or sequences, by agg_mode);
    megatron sums it as an int over micro-batches and DP ranks."""
    metrics: dict[str, Tensor] = field(default_factory=dict)
    """Sums over loss tokens (divide by metrics['tokens'] for a mean); reduce by summing. Exactly the names the
    loss declares (`declared_metrics`), so the actor knows them before the step."""


PolicyLossFn = Callable[..., PolicyLossOutput]
"""fn(log_probs, old_log_probs, advantages, mask, config: PolicyLossConfig, *, entropy=None, is_weights=None)
-> PolicyLossOutput: the signature of every --policy-loss (docs/ALGORITHMS.md)."""

POLICY_LOSS_SIGNATURE = ("fn(log_probs, old_log_probs, advantages, mask, config: PolicyLossConfig, *, entropy=None, "
                         "is_weights=None) -> PolicyLossOutput(loss_sum, denominator, metrics)")

POLICY_LOSSES = Registry("--policy-loss", POLICY_LOSS_SIGNATURE, "megatron_dapo.algorithm")
"""--policy-loss's names: every loss of megatron_dapo/algorithm/ registered with `register_policy_loss`."""

TOKEN_METRICS: tuple[str, ...] = ("pg_loss", "clipfrac_high", "clipfrac_low", "clipfrac_dual", "approx_kl", "ratio",
                                  "entropy", "tokens")
"""The token sums `token_metrics` reports (entropy when given one): the metrics of a loss that declares none."""


def register_policy_loss(name: str, *, help: str, metrics: tuple[str, ...] = TOKEN_METRICS,
                         behaviour_weights: bool = False) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator: the loss under --policy-loss `name`, `help` its description in the flag's help, `metrics` the
    names of the token sums its PolicyLossOutput.metrics holds (set as the function's `metrics` attribute, which
    is also how a dotted-path loss declares them; see `declared_metrics`). `behaviour_weights`: the loss takes
    `is_weights` as the raw behaviour weights pi_old / pi_rollout and weights (and caps) them itself, instead of
    TIS's min(r, C) (`takes_behaviour_weights`; the decoupled objective, algorithm/decoupled.py)."""
    checked = _checked_metrics(metrics, f"register_policy_loss({name!r})")

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        fn.metrics = checked  # type: ignore[attr-defined]
        fn.behaviour_weights = behaviour_weights  # type: ignore[attr-defined]
        return POLICY_LOSSES.register(name, help=help)(fn)

    return decorator


def takes_behaviour_weights(fn: Callable) -> bool:
    """True for a loss that wants `is_weights` = pi_old / pi_rollout per token, uncapped (the trainer then passes
    those, OffPolicyConfig.behaviour_weights, and refuses --use-tis beside it); its `behaviour_weights` attribute
    (register_policy_loss sets it; a dotted-path loss may set it by hand), False when it has none."""
    return bool(getattr(fn, "behaviour_weights", False))


def declared_metrics(fn: Callable) -> tuple[str, ...]:
    """The token sums loss `fn` reports: its `metrics` attribute (register_policy_loss sets it; a dotted-path loss
    sets it by hand, `my_loss.metrics = (*TOKEN_METRICS, "my_sum")`), TOKEN_METRICS when it has none. Each is summed
    over micro-batches and DP ranks and logged divided by 'tokens', so the names are fixed before the run starts.
    ValueError unless a tuple or list of distinct strings that includes 'tokens'."""
    return _checked_metrics(getattr(fn, "metrics", TOKEN_METRICS), f"the loss {qualified_name(fn)}")


def _checked_metrics(metrics: object, owner: str) -> tuple[str, ...]:
    if not (isinstance(metrics, (tuple, list)) and all(isinstance(m, str) and m for m in metrics)):
        raise ValueError(f"{owner} declares metrics {metrics!r}: they must be a tuple of metric names")
    if len(set(metrics)) != len(metrics) or "tokens" not in metrics:
        raise ValueError(f"{owner} declares metrics {tuple(metrics)}: the names must be distinct and include "
                         "'tokens', the count every other metric is divided by")
    return tuple(metrics)


def aggregate(token_values: Tensor, mask: Tensor, agg_mode: AggMode) -> tuple[Tensor, Tensor]:
    """Reduce per-token values [B, S] under mask [B, S] to (numerator, denominator) scalars.

    token-mean:           sum_{b,t} m*x            / sum_{b,t} m
    seq-mean-token-mean:  sum_b (sum_t m*x / sum_t m) / #sequences with >= 1 token
    seq-mean-token-sum:   sum_b  sum_t m*x            / #sequences with >= 1 token
    Each row is one whole sequence (micro-batches never split one; packed ones are unpacked into rows
    before the loss) and both numerator and denominator are sums of per-row terms, so sums of numerators
    over any partition of the rows, divided by the summed denominators, equal the value for the whole
    batch. Micro-batching, DP (rows on other ranks) and PP (only the last stage computes the loss, on
    whole micro-batches) are such partitions: every mode is invariant to them.
    """
    mask = mask.to(token_values.dtype)
    masked = token_values * mask
    if agg_mode == "token-mean":
        return masked.sum(), mask.sum()
    tokens_per_seq = mask.sum(dim=-1)
    has_tokens = tokens_per_seq > 0
    seq_sums = masked.sum(dim=-1)
    if agg_mode == "seq-mean-token-mean":
        seq_values = torch.where(has_tokens, seq_sums / tokens_per_seq.clamp(min=1.0), 0.0)
    elif agg_mode == "seq-mean-token-sum":
        seq_values = seq_sums
    else:
        raise ValueError(f"agg_mode must be one of {AGG_MODES}, got {agg_mode!r}")
    return seq_values.sum(), has_tokens.to(token_values.dtype).sum()


@register_policy_loss("dapo", help="token-mean over the mini-batch, aggregation --loss-agg-mode")
def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: PolicyLossConfig,
    *,
    entropy: Tensor | None = None,
    is_weights: Tensor | None = None,
) -> PolicyLossOutput:
    """DAPO clipped surrogate on a micro-batch (--policy-loss dapo), aggregated by --loss-agg-mode.

    Args:
        log_probs: [B, S] log pi_theta of the sampled tokens (differentiable).
        old_log_probs: [B, S] log pi_old of the same tokens (no gradient).
        advantages: [B] per-sequence or [B, S] per-token advantages.
        mask: [B, S] 1 for response tokens that enter the loss, 0 for prompt / padding / filtered.
        entropy: optional [B, S] per-token entropy, only reported.
        is_weights: optional [B, S] rollout-correction weights (TIS, algorithm/mismatch.py), detached here;
            each token's clipped loss is multiplied by its weight; the denominator is unchanged.
    Returns:
        PolicyLossOutput(loss_sum, denominator, metrics). The denominator counts loss tokens (token-mean)
        or sequences with >= 1 loss token (seq-mean-*): see `aggregate` for why any split is exact.
        Metric sums over masked tokens: pg_loss, clipfrac_high (ratio clipped at 1+eps_high with A > 0),
        clipfrac_low (clipped at 1-eps_low with A < 0), clipfrac_dual (dual clip active), approx_kl (k1
        estimator old_logp - logp, as a mean it is an estimate of KL(pi_old || pi_theta)), ratio, entropy;
        'tokens' = number of masked tokens.
    """
    token_loss, terms = clipped_token_loss(log_probs, old_log_probs, advantages, mask, config, is_weights=is_weights)
    loss_sum, denominator = aggregate(token_loss, terms.mask, config.agg_mode or "token-mean")
    return PolicyLossOutput(loss_sum=loss_sum, denominator=denominator,
                            metrics=token_metrics(token_loss, terms, config, entropy))


@dataclass
class SurrogateTerms:
    """The per-token pieces of a clipped surrogate that the metrics read ([B, S] each, computation dtype)."""

    ratio: Tensor
    log_ratio: Tensor
    advantages: Tensor
    mask: Tensor
    dual_active: Tensor


def prepare_inputs(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Check the [B, S] shapes, broadcast [B] advantages over tokens, and cast to >= fp32 (bf16 log-probs
    would make ratios of 1 +- 0.008 steps); old log-probs and advantages come back detached."""
    if log_probs.shape != old_log_probs.shape or log_probs.shape != mask.shape:
        raise ValueError(
            f"log_probs {tuple(log_probs.shape)}, old_log_probs {tuple(old_log_probs.shape)} and mask "
            f"{tuple(mask.shape)} must have the same [B, S] shape"
        )
    if advantages.dim() == log_probs.dim() - 1:
        advantages = advantages.unsqueeze(-1).expand_as(log_probs)
    elif advantages.shape != log_probs.shape:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be [B] or [B, S] like log_probs")
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    return (log_probs.to(dtype), old_log_probs.detach().to(dtype), advantages.detach().to(dtype),
            mask.to(dtype))


def clipped_token_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
                       config: PolicyLossConfig, *, is_weights: Tensor | None = None
                       ) -> tuple[Tensor, SurrogateTerms]:
    """Per-token -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) [B, S], r = exp(logp - old_logp), then
    the dual-clip cap for A < 0 and the TIS weights: PPO's surrogate with DAPO's decoupled clip (Eq. 10),
    the token term of DAPO, GRPO and Dr. GRPO alike. Returns it with the terms the metrics need."""
    log_probs, old_log_probs, advantages, maskf = prepare_inputs(log_probs, old_log_probs, advantages, mask)
    log_ratio = torch.clamp(log_probs - old_log_probs, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    token_loss = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(token_loss, dtype=torch.bool)
    if config.dual_clip_c is not None:
        cap = -advantages * config.dual_clip_c  # positive where A < 0
        dual_active = (advantages < 0) & (token_loss > cap)
        token_loss = torch.where(dual_active, cap, token_loss)
    token_loss = apply_is_weights(token_loss, is_weights)
    return token_loss, SurrogateTerms(ratio=ratio, log_ratio=log_ratio, advantages=advantages, mask=maskf,
                                      dual_active=dual_active)


def apply_is_weights(token_loss: Tensor, is_weights: Tensor | None) -> Tensor:
    """Multiply each token's loss by its detached rollout-correction weight (identity for None)."""
    if is_weights is None:
        return token_loss
    if is_weights.shape != token_loss.shape:
        raise ValueError(f"is_weights {tuple(is_weights.shape)} must have the [B, S] shape of log_probs "
                         f"{tuple(token_loss.shape)}")
    return token_loss * is_weights.detach().to(token_loss.dtype)


def token_metrics(token_loss: Tensor, terms: SurrogateTerms, config: PolicyLossConfig,
                  entropy: Tensor | None = None) -> dict[str, Tensor]:
    """Token sums of the loss diagnostics (see policy_loss's Returns); `terms.ratio` is whatever ratio the
    loss clips (per token, or a sequence's ratio repeated over its tokens)."""
    maskf, ratio, advantages = terms.mask, terms.ratio, terms.advantages
    with torch.no_grad():
        clip_high = (ratio > 1.0 + config.eps_high) & (advantages > 0)
        clip_low = (ratio < 1.0 - config.eps_low) & (advantages < 0)
        metrics = {
            "pg_loss": (token_loss * maskf).sum(),
            "clipfrac_high": (clip_high.float() * maskf).sum(),
            "clipfrac_low": (clip_low.float() * maskf).sum(),
            "clipfrac_dual": (terms.dual_active.float() * maskf).sum(),
            "approx_kl": (-terms.log_ratio * maskf).sum(),
            "ratio": (ratio * maskf).sum(),
            "tokens": maskf.sum(),
        }
        if entropy is not None:
            metrics["entropy"] = (entropy.detach().to(maskf.dtype) * maskf).sum()
    return metrics


def reduce_metrics(metric_sums: list[dict[str, Tensor]] | dict[str, Tensor]) -> dict[str, float]:
    """Turn token-summed metrics (one dict or several to add up) into per-token means."""
    if isinstance(metric_sums, dict):
        metric_sums = [metric_sums]
    total: dict[str, float] = {}
    for sums in metric_sums:
        for key, value in sums.items():
            total[key] = total.get(key, 0.0) + float(value)
    tokens = total.get("tokens", 0.0)
    out = {key: (value / tokens if tokens > 0 else 0.0) for key, value in total.items() if key != "tokens"}
    out["tokens"] = tokens
    return out
