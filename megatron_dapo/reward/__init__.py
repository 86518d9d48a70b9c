"""Rule-based rewards: DAPO's math verifier and reward functions by name or dotted path."""

from megatron_dapo.reward.math_dapo import compute_score
from megatron_dapo.reward.normalize import normalize_final_answer
from megatron_dapo.reward.registry import BUILTIN_REWARD_FNS, RewardFn, get_reward_fn
from megatron_dapo.reward.result import RewardResult

__all__ = [
    "BUILTIN_REWARD_FNS",
    "RewardFn",
    "RewardResult",
    "compute_score",
    "get_reward_fn",
    "normalize_final_answer",
]
