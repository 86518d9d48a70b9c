"""The policy loss and the advantage estimator by name, or by dotted path for user extensions
(--policy-loss, --advantage-estimator); docs/ALGORITHMS.md is the user's page.

The names are registered beside the functions (`@register_policy_loss` in algorithm/loss.py,
`@register_advantage_estimator` in algorithm/advantages.py; every module of megatron_dapo/algorithm/ is imported on
the first read of a registry), and the flags' help texts are generated from them here.

Each is chosen once, when the run is built: `policy_loss_config` puts the loss function into the
PolicyLossConfig the actor calls (`config.fn`), `get_advantage_estimator` returns the function the trainer
calls. Both try the function once on a tiny CPU batch then, so a wrong signature, a wrong return type, a metric
the loss does not declare or a flag the loss contradicts (--loss-agg-mode, --clip-ratio-c) stops the run at
start-up with a UserError naming the flag, not at the first train step.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from megatron_dapo.algorithm.advantages import ADVANTAGE_ESTIMATOR_SIGNATURE, ADVANTAGE_ESTIMATORS, AdvantageFn
from megatron_dapo.algorithm.loss import (
    POLICY_LOSS_SIGNATURE,
    POLICY_LOSSES,
    TOKEN_METRICS,
    PolicyLossConfig,
    PolicyLossOutput,
    declared_metrics,
    takes_behaviour_weights,
)
from megatron_dapo.errors import UserError


def policy_loss_help() -> str:
    """--policy-loss's help text: each registered loss with its own description, then the dotted-path contract."""
    return (f"policy loss: {POLICY_LOSSES.describe()}, or a dotted path 'pkg.module:function' to "
            f"{POLICY_LOSS_SIGNATURE}: [n, L] tensors, one row per response; loss_sum / denominator summed over "
            "micro-batches and DP ranks must give the mini-batch loss, the denominator counting something (tokens "
            "or responses); metrics are token sums, logged as train/<name> divided by 'tokens', named in the "
            f"function's `metrics` attribute (a tuple; default: {', '.join(TOKEN_METRICS)}): a metric returned but "
            "not named there is an error. See docs/ALGORITHMS.md")


def advantage_estimator_help() -> str:
    """--advantage-estimator's help text: each registered estimator with its description, then the dotted path's."""
    return (f"advantage per response: {ADVANTAGE_ESTIMATORS.describe()}, or a dotted path 'pkg.module:function' to "
            f"{ADVANTAGE_ESTIMATOR_SIGNATURE} (rewards float64, one group id per response). See docs/ALGORITHMS.md")


def _check_binds(fn: Callable, name: str, flag: str, signature: str, *args, **kwargs) -> None:
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as err:
        raise UserError(f"{flag} {name!r} cannot be called as {signature}: {err}") from err
    except ValueError:
        pass  # no introspectable signature (a builtin): the trial call below still checks it


def _trial_batch() -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Two responses of 3 and 2 loss tokens, off-policy enough to clip: [2, 3] log-probs (with grad), old
    log-probs, [2] advantages, mask, and the per-token entropy the actor always passes."""
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.7, 0.0]])
    log_probs = (old + torch.tensor([[0.3, -0.2, 0.1], [-0.4, 0.2, 0.0]])).requires_grad_(True)
    return (log_probs, old, torch.tensor([1.0, -1.0]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]),
            torch.tensor([[0.5, 1.0, 0.2], [0.7, 0.1, 0.0]]))


def policy_loss_config(name: str = "dapo", **fields) -> PolicyLossConfig:
    """PolicyLossConfig(**fields) with `fn` the --policy-loss `name` (registered, or 'pkg.module:function').

    Raises UserError naming --policy-loss for an unknown name, an unimportable path or a function that does not
    take the signature or return a PolicyLossOutput with a differentiable scalar loss_sum and a scalar denominator
    on a 2 x 3 CPU trial batch, --behav-weight-cap for a loss that does not take behaviour weights
    (`loss.takes_behaviour_weights`), or whose metrics are not declared (`loss.declared_metrics`: a tuple naming
    'tokens', and every metric the trial returns); the loss's own objection to another flag (a ValueError naming
    it, e.g. --loss-agg-mode with grpo) comes back as a UserError with its message. The config's `counts_tokens`
    says what the trial's denominator counted (5 tokens or 2 responses; None: neither)."""
    fn = POLICY_LOSSES.resolve(name)
    config = PolicyLossConfig(**fields, name=name.strip(), fn=fn)
    if config.behav_weight_cap is not None and not takes_behaviour_weights(fn):
        raise UserError(f"--behav-weight-cap {config.behav_weight_cap} applies to a loss that takes the behaviour "
                        f"weights (--policy-loss decoupled), not to --policy-loss {config.name!r}; drop it, or cap "
                        "this loss's weights with --use-tis --tis-cap")
    try:
        declared = declared_metrics(fn)
    except ValueError as err:
        raise UserError(f"--policy-loss {config.name!r}: {err}") from err
    log_probs, old, advantages, mask, entropy = _trial_batch()
    _check_binds(fn, config.name, "--policy-loss", POLICY_LOSS_SIGNATURE, log_probs, old, advantages, mask, config,
                 entropy=entropy, is_weights=None)
    try:
        out = fn(log_probs, old, advantages, mask, config, entropy=entropy, is_weights=None)
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
    if "kl" in declared:
        raise UserError(f"--policy-loss {config.name!r} declares a metric 'kl', the name of the KL term's own metric "
                        "(train/kl, --kl-coef); give it another name")
    if undeclared := sorted(set(out.metrics) - set(declared)):
        raise UserError(f"--policy-loss {config.name!r} returned metrics {undeclared} that it does not declare "
                        f"(it declares {declared}); name every metric it reports in register_policy_loss(metrics=...) "
                        "or, for a dotted path, in the function's `metrics` attribute")
    tokens, responses = float(mask.sum()), float((mask.sum(dim=-1) > 0).sum())  # 5 and 2: told apart
    counted = float(out.denominator)
    return dataclasses.replace(config, counts_tokens=True if counted == tokens else
                               False if counted == responses else None)


def get_advantage_estimator(name: str = "grpo") -> AdvantageFn:
    """The --advantage-estimator `name` (registered, or 'pkg.module:function').

    Raises UserError naming --advantage-estimator for an unknown name, an unimportable path, or a function that
    does not return a float tensor [N] for N = 4 trial rewards in two groups."""
    fn = ADVANTAGE_ESTIMATORS.resolve(name)
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
