"""Reward functions by name, or by dotted path for user extensions (--reward-fn).

A named one is registered beside its definition with `@register_reward_fn("name")` in a module of
megatron_dapo/reward/ (imported on the first read of BUILTIN_REWARD_FNS). A user reward function has the signature
`fn(solution_str: str, ground_truth: str) -> R` where R is a `RewardResult`, a float (acc = score > 0), or a dict
with "score" and optional "acc"/"pred" (the verl convention). It is addressed as "pkg.module:function" or
"pkg.module.function".
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

from megatron_dapo.dotted_path import Registry
from megatron_dapo.errors import UserError
from megatron_dapo.reward.result import RewardResult

RewardFn = Callable[[str, str], RewardResult]

REWARD_FN_SIGNATURE = "fn(solution_str: str, ground_truth: str) -> RewardResult | float | dict"

BUILTIN_REWARD_FNS = Registry("--reward-fn", REWARD_FN_SIGNATURE, "megatron_dapo.reward",
                              unknown="is not a known reward function")
"""--reward-fn's names: every function of megatron_dapo/reward/ registered with `register_reward_fn("name")`."""
register_reward_fn = BUILTIN_REWARD_FNS.register


def _coerce(value: object, origin: str) -> RewardResult:
    """Turn a user function's return value into a RewardResult, or raise UserError (one line at the trainer's start
    or mid-run) naming the function, the type of what it returned and what it must return."""
    if isinstance(value, RewardResult):
        return value
    score, what = value, f"{type(value).__name__} {_short(value)}"
    if isinstance(value, dict) and "score" in value:
        score = value["score"]
        what = f"a dict whose 'score' is {type(score).__name__} {_short(score)}"
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise UserError(f"--reward-fn {origin!r} returned {what}: it must return a RewardResult, a number, or a dict "
                        "with a numeric 'score' key")
    if not math.isfinite(score):
        raise UserError(f"--reward-fn {origin!r} returned a score of {score}: a reward must be a finite number")
    if isinstance(value, dict):
        return RewardResult(score=score, acc=bool(value.get("acc", score > 0)), pred=value.get("pred"))
    return RewardResult(score=float(score), acc=score > 0)


def _short(value: object, limit: int = 40) -> str:
    """repr(value) in parentheses, cut to `limit` characters."""
    text = repr(value)
    return f"({text[:limit]}...)" if len(text) > limit else f"({text})"


def get_reward_fn(name_or_dotted_path: str) -> RewardFn:
    """Return the reward function `fn(solution_str, ground_truth) -> RewardResult` named here."""
    fn = BUILTIN_REWARD_FNS.resolve(name_or_dotted_path)
    if fn in BUILTIN_REWARD_FNS.values():
        return fn
    name = name_or_dotted_path.strip()
    try:
        inspect.signature(fn).bind("solution", "truth")
    except TypeError as err:
        raise ValueError(
            f"--reward-fn {name!r} cannot be called as fn(solution_str, ground_truth): {err}"
        ) from err
    except ValueError:
        pass  # builtins without a signature: trust them, results are still checked per call

    @functools.wraps(fn)
    def reward_fn(solution_str: str, ground_truth: str) -> RewardResult:
        return _coerce(fn(solution_str, ground_truth), name)

    return reward_fn
