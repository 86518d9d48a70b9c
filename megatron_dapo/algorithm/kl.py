"""KL to a frozen reference policy: the per-token estimators and the loss term (--kl-coef, --kl-estimator).

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

The loss term (`kl_loss_term`) is beta times the estimator aggregated like the policy loss's own terms, so the sum
shares the loss's denominator and stays exact under any split into micro-batches and DP ranks: token-mean when the
loss's denominator counts tokens (dapo, cispo, decoupled: DAPO's 1/sum|o_i|), seq-mean-token-mean when it counts
responses (grpo, gspo, dr_grpo: GRPO's 1/G sum_i 1/|o_i| sum_t, where Eq. 3 puts the KL), or --loss-agg-mode when
given (`kl_agg_mode`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

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


__all__ = ["KL_ESTIMATORS", "KLConfig", "kl_agg_mode", "kl_estimate", "kl_loss_term"]
