"""A reward for trainer tests (loaded through --reward-fn tests.rewards:length_parity).

A barely trained model answers every prompt wrong, so the math verifier would give whole groups the
same reward and zero advantage. Rewarding the parity of the response length instead keeps almost
every group informative, so each step really changes the weights.
"""

from __future__ import annotations

from megatron_dapo.reward.result import RewardResult


def length_parity(response: str, ground_truth: str) -> RewardResult:
    """+1 for an even number of characters, -1 for odd (ground_truth unused)."""
    even = len(response) % 2 == 0
    return RewardResult(score=1.0 if even else -1.0, acc=even, pred=str(len(response)))


PARITY_REWARD = ("--reward-fn", "tests.rewards:length_parity")
"""Trainer flags that select it."""
