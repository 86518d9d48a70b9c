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


def length_parity_held(response: str, ground_truth: str) -> RewardResult:
    """length_parity, for the multi-node rehearsal (examples/rehearse_multinode.sh): while the file
    $REHEARSAL_HOLD_DIR/killed exists and $REHEARSAL_HOLD_DIR/back does not (a server was killed and its
    restart does not answer /health yet), waits, at most $REHEARSAL_HOLD_S seconds (300), then raises.

    At 32B a step takes 20-45 min and a server restart 1-3 min, so a killed server is back within the step
    that lost it; here a tiny step takes seconds and a restarted CPU server 60+ s. Holding the step's scoring
    restores that ratio, so a 3-step run sees the return (and the engine's re-sync, at the step's weight update)."""
    import os
    import time
    from pathlib import Path

    hold = os.environ.get("REHEARSAL_HOLD_DIR")
    if hold:
        deadline = time.monotonic() + float(os.environ.get("REHEARSAL_HOLD_S", "300"))
        while (Path(hold) / "killed").exists() and not (Path(hold) / "back").exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the killed server did not come back within $REHEARSAL_HOLD_S s ({hold})")
            time.sleep(0.5)
    return length_parity(response, ground_truth)
