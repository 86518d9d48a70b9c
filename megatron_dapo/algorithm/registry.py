"""The policy loss and the advantage estimator by name, or by dotted path for user extensions
(--policy-loss, --advantage-estimator); docs/ALGORITHMS.md is the user's page.

Each is chosen once, when the run is built: `policy_loss_config` puts the loss function into the
PolicyLossConfig the actor calls (`config.fn`), `get_advantage_estimator` returns the function the trainer
calls. Both try the function once on a tiny CPU batch then, so a wrong signature, a wrong return type or a
flag the loss contradicts (--loss-agg-mode, --clip-ratio-c) stops the run at start-up with a UserError
naming the flag, not at the first train step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from megatron_dapo.algorithm.advantages import AdvantageFn, dr_grpo_advantages, grpo_advantages
from megatron_dapo.algorithm.grpo_loss import dr_grpo_loss, grpo_loss
from megatron_dapo.algorithm.gspo import gspo_loss
from megatron_dapo.algorithm.loss import PolicyLossConfig, PolicyLossFn, PolicyLossOutput, policy_loss
from megatron_dapo.dotted_path import resolve_callable
from megatron_dapo.errors import UserError

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "dapo": policy_loss,  # DAPO arXiv 2503.14476 Eq. 8/10: token-mean (or --loss-agg-mode), decoupled clip
    "grpo": grpo_loss,  # DeepSeekMath arXiv 2402.03300 Eq. 3: mean over tokens, then over sequences
    "dr_grpo": dr_grpo_loss,  # Dr. GRPO arXiv 2503.20783: token sums / --max-response-length
    "gspo": gspo_loss,  # GSPO arXiv 2507.18071: sequence-level ratio and clip (GSPO-token form)
}

ADVANTAGE_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,  # (R - mean) / (std + eps) per group; also GSPO's
    "dr_grpo": dr_grpo_advantages,  # R - mean per group
}

POLICY_LOSS_SIGNATURE = ("fn(log_probs, old_log_probs, advantages, mask, config: PolicyLossConfig, *, entropy=None, "
                         "is_weights=None) -> PolicyLossOutput(loss_sum, denominator, metrics)")
ADVANTAGE_ESTIMATOR_SIGNATURE = "fn(rewards: Tensor[N], group_ids: Sequence[Hashable]) -> Tensor[N]"

POLICY_LOSS_HELP = (
    "policy loss: dapo (token-mean over the mini-batch, aggregation --loss-agg-mode), grpo (mean over each "
    "response's tokens, then over responses), dr_grpo (token sums / --max-response-length), gspo (sequence-level "
    "ratio and clip, arXiv 2507.18071; set its small clip range, e.g. --clip-ratio-low 3e-4 --clip-ratio-high "
    f"4e-4), or a dotted path 'pkg.module:function' to {POLICY_LOSS_SIGNATURE}: [n, L] tensors, one row per "
    "response; loss_sum / denominator summed over micro-batches and DP ranks must give the mini-batch loss, the "
    "denominator counting something (tokens or responses). See docs/ALGORITHMS.md"
)
ADVANTAGE_ESTIMATOR_HELP = (
    "advantage per response: grpo ((R - mean) / (std + 1e-6) within each prompt group; what GSPO uses), dr_grpo "
    f"(R - mean, no std division), or a dotted path 'pkg.module:function' to {ADVANTAGE_ESTIMATOR_SIGNATURE} "
    "(rewards float64, one group id per response). See docs/ALGORITHMS.md"
)


def _check_binds(fn: Callable, name: str, flag: str, signature: str, *args, **kwargs) -> None:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as err:
        raise UserError(f"{flag} {name!r} cannot be called as {signature}: {err}") from err
    except ValueError:
        pass  # no introspectable signature (a builtin): the trial call below still checks it


def _trial_batch() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Two responses of 3 and 2 loss tokens, off-policy enough to clip: [2, 3] log-probs (with grad), old
    log-probs, [2] advantages, mask."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]])
    log_probs = (old + torch.tensor([[0.3, -0.2, 0.1], [-0.4, 0.2, 0.0]])).requires_grad_(True)
    return log_probs, old, torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])


def policy_loss_config(name: str = "dapo", **fields) -> PolicyLossConfig:
    """PolicyLossConfig(**fields) with `fn` the --policy-loss `name` (registered, or 'pkg.module:function').

    Raises UserError naming --policy-loss for an unknown name, an unimportable path or a function that does not
    take the signature or return a PolicyLossOutput with a differentiable scalar loss_sum and a scalar denominator
    on a 2 x 3 CPU trial batch; the loss's own objection to another flag (a ValueError naming it, e.g.
    --loss-agg-mode with grpo) comes back as a UserError with its message."""
    fn = resolve_callable(name, "--policy-loss", POLICY_LOSSES, POLICY_LOSS_SIGNATURE)
    config = PolicyLossConfig(**fields, name=name.strip(), fn=fn)
    log_probs, old, advantages, mask = _trial_batch()
    _check_binds(fn, config.name, "--policy-loss", POLICY_LOSS_SIGNATURE, log_probs, old, advantages, mask, config,
                 entropy=None, is_weights=None)
    try:
        out = fn(log_probs, old, advantages, mask, config, entropy=None, is_weights=None)
    except ValueError as err:  # a registered loss rejecting a flag combination names the flags itself
        raise UserError(str(err) if fn in POLICY_LOSSES.values() else
                        f"--policy-loss {config.name!r} failed on a 2 x 3 CPU trial batch: {err}") from err
    except Exception as err:
        raise UserError(f"--policy-loss {config.name!r} failed on a 2 x 3 CPU trial batch "
                        f"({type(err).__name__}: {err}); it must take {POLICY_LOSS_SIGNATURE}") from err
    problem = None
    if not isinstance(out, PolicyLossOutput):
        problem = f"returned {type(out).__name__}, not a PolicyLossOutput"
    elif not (isinstance(out.loss_sum, Tensor) and out.loss_sum.dim() == 0 and out.loss_sum.requires_grad):
        problem = "returned a loss_sum that is not a scalar tensor with a gradient to log_probs"
    elif not (isinstance(out.denominator, Tensor) and out.denominator.numel() == 1):
        problem = "returned a denominator that is not a one-element tensor (megatron sums it as an int)"
    elif not isinstance(out.metrics, dict):
        problem = f"returned metrics of type {type(out.metrics).__name__}, not a dict of token sums"
    if problem:
        raise UserError(f"--policy-loss {config.name!r} {problem}; it must be {POLICY_LOSS_SIGNATURE}")
    return config


def get_advantage_estimator(name: str = "grpo") -> AdvantageFn:
    """The --advantage-estimator `name` (registered, or 'pkg.module:function').

    Raises UserError naming --advantage-estimator for an unknown name, an unimportable path, or a function that
    does not return a float tensor [N] for N = 4 trial rewards in two groups."""
    fn = resolve_callable(name, "--advantage-estimator", ADVANTAGE_ESTIMATORS, ADVANTAGE_ESTIMATOR_SIGNATURE)
    name = name.strip()
    rewards, groups = torch.tensor([1.0, 0.0, 0.5, 0.5], dtype=torch.float64), [0, 0, 1, 1]
    _check_binds(fn, name, "--advantage-estimator", ADVANTAGE_ESTIMATOR_SIGNATURE, rewards, groups)
    try:
        out = fn(rewards, groups)
    except Exception as err:
        raise UserError(f"--advantage-estimator {name!r} failed on 4 trial rewards ({type(err).__name__}: {err}); "
                        f"it must take {ADVANTAGE_ESTIMATOR_SIGNATURE}") from err
    if not (isinstance(out, Tensor) and out.shape == (4,) and out.is_floating_point()):
        got = f"a tensor of shape {tuple(out.shape)} and dtype {out.dtype}" if isinstance(out, Tensor) \
            else type(out).__name__
        raise UserError(f"--advantage-estimator {name!r} returned {got} for 4 rewards; it must be "
                        f"{ADVANTAGE_ESTIMATOR_SIGNATURE}, one float per response")
    return fn
