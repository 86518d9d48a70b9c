"""Rollout-vs-actor mismatch: truncated importance sampling (TIS), masked importance sampling (MIS), metrics.

The rollout engine (bf16 SGLang) samples from pi_rollout, not from pi_old, the actor's own distribution
under the same weights (recomputed by `MegatronActor.compute_log_probs`). Per response token t:

    log r_t = log pi_old(o_t) - log pi_rollout(o_t),    r_t = pi_old / pi_rollout   (the mismatch ratio)

DAPO's ratio pi_theta / pi_old (algorithm/loss.py) is unchanged; the corrections below act on r_t only,
as detached per-token factors of the per-token loss.

TIS (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
https://fengyao.notion.site/off-policy-rl, flags --use-tis --tis-cap C):

    loss_t <- min(r_t, C) * loss_t                                   (weight detached, C >= 1)

No lower bound, as slime's TIS with its default lower clip 0 and verl's rollout IS "truncate" mode; the
token-mean denominator is unchanged (TIS re-weights, it does not remove tokens).

MIS (masked / rejection IS: Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse
from the Training-Inference Mismatch", https://richardli.xyz/rl-collapse; verl's rollout correction
"mask" mode; flags --mis-mode {token,sequence} --mis-threshold T): a token leaves the loss (its loss
mask becomes 0, so it also leaves the token-mean denominator) when

    token:     r_t not in [1/T, T]
    sequence:  g_i = exp( sum_t m_t log r_t / sum_t m_t )  not in [1/T, T]   (geometric mean over the
               sequence's tokens; all its tokens are dropped together)

TIS and MIS compose: a kept token is still weighted by min(r_t, C).

IcePop (Ring-1T, arXiv 2510.18855, Sec. 3 "IcePop": double-sided masking calibration; flags --use-icepop
--icepop-low alpha --icepop-high beta): each token's term is weighted by

    M(r_t) = r_t   if alpha <= r_t <= beta,   0 otherwise                (weight detached)

so a token inside the band is importance-weighted exactly (no cap) and one outside it leaves the gradient, on both
sides. The denominator is unchanged: the paper's 1/|y_i| counts every token, so a zeroed token still counts (MIS
removes its tokens from the denominator). It is a per-token weight like TIS and excludes it (and behaviour weights);
it composes with MIS.

Behaviour weights (--policy-loss decoupled, algorithm/decoupled.py, AReaL's decoupled PPO): the loss gets r_t
itself, uncapped, as its per-token weight (pi_old is the proximal policy, pi_rollout the behaviour policy) and
caps it its own way (--behav-weight-cap); it excludes TIS and composes with MIS like TIS.

Metrics (`mismatch/*`, token means over every response token of the step unless said otherwise; they are
computed with the configured C and T whether or not the correction is switched on, so a run can watch
them before enabling it):
    logprob_abs_diff_mean / _max   |log r_t|
    is_ratio_mean / _max           r_t
    tis_weight_mean                min(r_t, C)
    tis_clipfrac                   fraction of tokens with r_t > C
    mis_maskfrac                   fraction of tokens outside [1/T, T] (per token or per sequence by --mis-mode;
                                   token mode when --mis-mode is unset)
    icepop_maskfrac                fraction of tokens outside IcePop's [alpha, beta]
    kl_k3                          Schulman's k3 estimator of KL(pi_rollout || pi_old) on tokens sampled from
                                   pi_rollout: (r_t - 1) - log r_t  (>= 0)
    ppl_ratio                      PPL_old / PPL_rollout over all tokens of the step,
                                   exp(-mean_t log pi_old) / exp(-mean_t log pi_rollout) = exp(-mean_t log r_t)
With the same weights in both engines (embedded engine, fp32) r_t = 1: ratio 1, clip/mask fractions 0,
k3 = 0, ppl_ratio = 1.

Cost at the production setting (Qwen2.5-32B, 8192 responses x up to 20480 tokens, DP 8): the weights are
one fp32 per response token: 8192 x 20480 x 4 B = 0.625 GiB for the whole step at most, 80 MiB of host
memory per DP rank (its 1024 responses), and 4 B x micro-batch tokens (96 KiB at a 24576-token budget) on
the device per micro-batch. The metrics are 10 fp64 sums + 2 maxima all-reduced over DP (96 B).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

MisMode = Literal["token", "sequence"]
MIS_MODES: tuple[str, ...] = ("token", "sequence")
LOG_RATIO_CLAMP = 20.0
SUM_KEYS = ("abs_diff", "ratio", "tis_weight", "tis_clipped", "mis_masked", "icepop_masked", "kl_k3", "log_ratio",
            "tokens", "sequences")
"""Keys of `mismatch_sums` reduced by summing (over samples and DP ranks)."""
MAX_KEYS = ("abs_diff_max", "ratio_max")
"""Keys of `mismatch_sums` reduced by max."""


@dataclass(frozen=True, kw_only=True)
class OffPolicyConfig:
    use_tis: bool = False
    """Multiply each token's loss by min(pi_old / pi_rollout, tis_cap) (--use-tis)."""
    tis_cap: float = 2.0
    """C of TIS (--tis-cap), >= 1."""
    mis_mode: MisMode | None = None
    """Mask tokens (token) or whole sequences (sequence, geometric mean) whose ratio is outside
    [1/mis_threshold, mis_threshold] (--mis-mode); None = no masking."""
    mis_threshold: float = 2.0
    """T of MIS (--mis-threshold), > 1."""
    use_icepop: bool = False
    """Weight each token's loss by r_t inside [icepop_low, icepop_high] and by 0 outside (--use-icepop)."""
    icepop_low: float = 0.5
    """alpha of IcePop (--icepop-low), in (0, 1)."""
    icepop_high: float = 5.0
    """beta of IcePop (--icepop-high), > 1."""
    behaviour_weights: bool = False
    """Pass each token's raw r_t = pi_old / pi_rollout (uncapped) as the loss's is_weights: set when the
    --policy-loss takes behaviour weights (`loss.takes_behaviour_weights`: --policy-loss decoupled, which caps
    them itself); excludes use_tis (the same ratio would weight the loss twice)."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.tis_cap) and self.tis_cap >= 1.0):
            raise ValueError(f"tis_cap (--tis-cap) must be a finite number >= 1 (a cap below 1 would down-weight "
                             f"on-policy tokens), got {self.tis_cap}")
        if self.mis_mode is not None and self.mis_mode not in MIS_MODES:
            raise ValueError(f"mis_mode (--mis-mode) must be one of {MIS_MODES} or unset, got {self.mis_mode!r}")
        if not (math.isfinite(self.mis_threshold) and self.mis_threshold > 1.0):
            raise ValueError(f"mis_threshold (--mis-threshold) must be a finite number > 1, got "
                             f"{self.mis_threshold}")

        if not (0.0 < self.icepop_low < 1.0):
            raise ValueError(f"icepop_low (--icepop-low) must be in (0, 1): the band [alpha, beta] must hold r = 1, "
                             f"got {self.icepop_low}")
        if not (math.isfinite(self.icepop_high) and self.icepop_high > 1.0):
            raise ValueError(f"icepop_high (--icepop-high) must be a finite number > 1, got {self.icepop_high}")
        if self.use_icepop and (self.use_tis or self.behaviour_weights):
            other = "--use-tis" if self.use_tis else "a --policy-loss that takes behaviour weights (decoupled)"
            raise ValueError(f"--use-icepop weights each token by pi_old / pi_rollout inside [--icepop-low, "
                             f"--icepop-high] and {other} weights it by that ratio too: choose one (the ratio would "
                             f"weight each token twice)")
        if self.use_tis and self.behaviour_weights:
            raise ValueError("--use-tis weights the loss by min(pi_old / pi_rollout, --tis-cap), and a --policy-loss "
                             "that takes behaviour weights (decoupled) weights it by pi_old / pi_rollout itself: "
                             "drop --use-tis (cap the decoupled weights with --behav-weight-cap)")

    @property
    def enabled(self) -> bool:
        return self.use_tis or self.use_icepop or self.behaviour_weights or self.mis_mode is not None


def _log_ratio(old_log_probs: Tensor, rollout_log_probs: Tensor) -> Tensor:
    if old_log_probs.shape != rollout_log_probs.shape:
        raise ValueError(f"old_log_probs {tuple(old_log_probs.shape)} and rollout_log_probs "
                         f"{tuple(rollout_log_probs.shape)} must have the same shape")
    dtype = torch.promote_types(old_log_probs.dtype, torch.float32)
    diff = old_log_probs.detach().to(dtype) - rollout_log_probs.detach().to(dtype)
    return diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def tis_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, cap: float) -> Tensor:
    """min(pi_old / pi_rollout, cap) per token, detached; any shape, fp32 (or wider)."""
    return torch.exp(_log_ratio(old_log_probs, rollout_log_probs)).clamp(max=cap)


def icepop_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, low: float, high: float) -> Tensor:
    """IcePop's M(r_t): r_t = pi_old / pi_rollout where low <= r_t <= high, else 0; per token, detached, fp32 (or
    wider)."""
    ratio = torch.exp(_log_ratio(old_log_probs, rollout_log_probs))
    return torch.where((ratio >= low) & (ratio <= high), ratio, torch.zeros_like(ratio))


def mis_keep_mask(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, mode: MisMode,
                  threshold: float) -> Tensor:
    """Bool [B, S]: True = the token stays in the loss under MIS (module docstring).

    token: 1/T <= r_t <= T. sequence: 1/T <= g_i <= T with g_i the geometric mean of r_t over the row's
    masked tokens (a row without masked tokens is kept). Positions where mask is 0 come back False.
    """
    log_r = _log_ratio(old_log_probs, rollout_log_probs)
    if mask.shape != log_r.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the log-probs' shape {tuple(log_r.shape)}")
    bound = math.log(threshold)
    maskf = mask.to(log_r.dtype)
    if mode == "token":
        keep = log_r.abs() <= bound
    elif mode == "sequence":
        count = maskf.sum(dim=-1, keepdim=True)
        log_g = (log_r * maskf).sum(dim=-1, keepdim=True) / count.clamp(min=1.0)
        keep = (log_g.abs() <= bound).expand_as(log_r)
    else:
        raise ValueError(f"mis_mode (--mis-mode) must be one of {MIS_MODES}, got {mode!r}")
    return keep & (maskf > 0)


def mismatch_sums(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor,
                  config: OffPolicyConfig) -> dict[str, Tensor]:
    """Per-batch sums (SUM_KEYS) and maxima (MAX_KEYS) of the mismatch metrics over masked tokens of [B, S]
    inputs; add sums and take the max of maxima over batches / DP ranks, then `reduce_mismatch`."""
    log_r = _log_ratio(old_log_probs, rollout_log_probs)
    maskf = mask.to(log_r.dtype)
    on = maskf > 0
    ratio = torch.exp(log_r)
    mis = mis_keep_mask(old_log_probs, rollout_log_probs, mask, config.mis_mode or "token", config.mis_threshold)
    zero = torch.zeros((), dtype=log_r.dtype)
    return {
        "abs_diff": (log_r.abs() * maskf).sum(),
        "ratio": (ratio * maskf).sum(),
        "tis_weight": (ratio.clamp(max=config.tis_cap) * maskf).sum(),
        "tis_clipped": ((ratio > config.tis_cap) & on).to(log_r.dtype).sum(),
        "mis_masked": (on & ~mis).to(log_r.dtype).sum(),
        "icepop_masked": (on & ((ratio < config.icepop_low) | (ratio > config.icepop_high))).to(log_r.dtype).sum(),
        "kl_k3": ((ratio - 1.0 - log_r) * maskf).sum(),
        "log_ratio": (log_r * maskf).sum(),
        "tokens": maskf.sum(),
        "sequences": (maskf.sum(dim=-1) > 0).to(log_r.dtype).sum(),
        "abs_diff_max": log_r.abs()[on].max() if on.any() else zero,
        "ratio_max": ratio[on].max() if on.any() else zero,
    }


def reduce_mismatch(sums: dict[str, float]) -> dict[str, float]:
    """Reduced sums/maxima (floats) -> the `mismatch/*` metrics of the module docstring."""
    n = sums["tokens"]
    mean = (lambda key: sums[key] / n) if n > 0 else (lambda key: 0.0)
    return {
        "mismatch/logprob_abs_diff_mean": mean("abs_diff"),
        "mismatch/logprob_abs_diff_max": sums["abs_diff_max"],
        "mismatch/is_ratio_mean": mean("ratio") if n > 0 else 1.0,
        "mismatch/is_ratio_max": sums["ratio_max"],
        "mismatch/tis_weight_mean": mean("tis_weight") if n > 0 else 1.0,
        "mismatch/tis_clipfrac": mean("tis_clipped"),
        "mismatch/mis_maskfrac": mean("mis_masked"),
        "mismatch/icepop_maskfrac": mean("icepop_masked"),
        "mismatch/kl_k3": mean("kl_k3"),
        "mismatch/ppl_ratio": math.exp(-mean("log_ratio")),
        "mismatch/tokens": n,
    }


@dataclass
class Correction:
    """What the loss needs for one [B, S] batch of responses."""

    is_weights: Tensor | None
    """[B, S] detached min(r_t, C) under TIS, IcePop's M(r_t) under --use-icepop, r_t under behaviour_weights (0
    outside mask); None when all are off."""
    loss_mask: Tensor
    """[B, S] the input mask with MIS-rejected tokens set to 0 (the input mask when MIS is off)."""


def off_policy_correction(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor,
                          config: OffPolicyConfig) -> Correction:
    """Apply the configured TIS or IcePop weights (or the raw behaviour weights r_t) and MIS mask to [B, S]
    responses (module docstring)."""
    loss_mask = mask
    if config.mis_mode is not None:
        keep = mis_keep_mask(old_log_probs, rollout_log_probs, mask, config.mis_mode, config.mis_threshold)
        loss_mask = mask * keep.to(mask.dtype)
    weights = None
    if config.use_tis:
        weights = tis_weights(old_log_probs, rollout_log_probs, config.tis_cap) * (mask != 0)
    elif config.use_icepop:
        weights = icepop_weights(old_log_probs, rollout_log_probs, config.icepop_low, config.icepop_high) * (mask != 0)
    elif config.behaviour_weights:
        weights = torch.exp(_log_ratio(old_log_probs, rollout_log_probs)) * (mask != 0)
    return Correction(is_weights=weights, loss_mask=loss_mask)
