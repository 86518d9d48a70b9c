"""A reward for trainer tests (loaded through --reward-fn tests.rewards:length_parity).

A barely trained model answers every prompt wrong, so the math verifier would give whole groups the
same reward and zero advantage. Rewarding the parity of the response length instead keeps almost
every group informative, so each step really changes the weights.
"""

from __future__ import annotations

from pathlib import Path

from megatron_dapo.reward.result import RewardResult


def length_parity(response: str, ground_truth: str) -> RewardResult:
    """+1 for an even number of characters, -1 for odd (ground_truth unused)."""
    even = len(response) % 2 == 0
    return RewardResult(score=1.0 if even else -1.0, acc=even, pred=str(len(response)))


PARITY_REWARD = ("--reward-fn", "tests.rewards:length_parity")
"""Trainer flags that select it."""


def length_parity_held(response: str, ground_truth: str) -> RewardResult:
    """length_parity, for the multi-node rehearsal (tests/slurm/test_slurm_rehearsal.py), holding the step's scoring
    (at most $REHEARSAL_HOLD_S seconds, 300, then TimeoutError) while a killed server's recovery would otherwise
    fall behind the run. In $REHEARSAL_HOLD_DIR the test touches `killed` (server 0 got kill -9), `back`
    (its restart answers /health) and `resynced` (the trainer logged its re-sync). It holds:
      - while `killed` exists and `back` does not: the step that lost the server waits for its return;
      - while `back` exists, `resynced` does not, and the step during which the return was first seen here has
        been logged to metrics.jsonl: that step's weight update found the restarted server and started its
        re-sync, which the next step waits for, so that the return and the re-sync land in a step's metrics.

    At 32B a step takes 20-45 min and a server restart 1-3 min, so a killed server is back and re-synced
    within the step that lost it; here a tiny step takes under a second and a restarted CPU server 15-60 s.
    Without the second hold an idle machine ran the last step's update before the re-sync, whose counts then
    came after the last metrics record.

    Also, while `pause` exists and holds a step number N, it holds the scoring of every step after step N is logged:
    the servers then keep step N's weights while the test compares them."""
    import os
    import time
    from pathlib import Path

    hold = os.environ.get("REHEARSAL_HOLD_DIR")
    if hold:
        hold_dir = Path(hold)
        deadline = time.monotonic() + float(os.environ.get("REHEARSAL_HOLD_S", "300"))
        while _rehearsal_must_wait(hold_dir):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the killed server was not back and re-synced within $REHEARSAL_HOLD_S s ({hold})")
            time.sleep(0.5)
    return length_parity(response, ground_truth)


def _rehearsal_must_wait(hold: Path) -> bool:
    """length_parity_held's condition (see there); records in `hold`/back_step the last logged step when the
    return is first seen."""
    pause = hold / "pause"
    if pause.exists() and _last_logged_step(hold) >= int(pause.read_text()):
        return True
    if not (hold / "killed").exists() or (hold / "resynced").exists():
        return False
    if not (hold / "back").exists():
        return True
    mark = hold / "back_step"
    if not mark.exists():
        mark.write_text(str(_last_logged_step(hold)))
        return False
    return _last_logged_step(hold) > int(mark.read_text())


def _last_logged_step(hold: Path) -> int:
    """The highest "step" in `hold`/metrics.jsonl (-1 before the first record)."""
    import json

    path = hold / "metrics.jsonl"
    steps = [json.loads(line).get("step", -1) for line in path.read_text().splitlines() if line.strip()] \
        if path.exists() else []
    return max(steps, default=-1)


_CALLS = [0]


def length_parity_signalled(response: str, ground_truth: str) -> RewardResult:
    """length_parity that sends this process a signal from inside the rollout, where Slurm's SIGTERM (a time
    limit, a preemption) or a Ctrl-C lands most of the time at scale (the rollout is most of a 32B step).
    $DAPO_TEST_SIGNAL = "NAME:N[:again][:group]": the N-th call sends signal NAME (SIGTERM, SIGINT, SIGKILL) to this
    process, once; with "again" every second after that too (a second Ctrl-C: the signals are a second apart, as a
    person's key presses, so that the trainer's handler sees each); with "group" to its whole process group, as a
    terminal's Ctrl-C does (start the trainer in a session of its own). Unset: length_parity."""
    import os
    import signal
    import time

    spec = os.environ.get("DAPO_TEST_SIGNAL")
    _CALLS[0] += 1
    if spec:
        name, at, *options = spec.split(":")
        if _CALLS[0] == int(at):
            sig = getattr(signal, name)
            group = "group" in options
            send = (lambda: os.killpg(os.getpgid(0), sig)) if group else (lambda: os.kill(os.getpid(), sig))
            send()
            for _ in range(60 if "again" in options else 0):  # until the trainer exits
                time.sleep(1.0)
                send()
    return length_parity(response, ground_truth)


SIGNALLED_REWARD = ("--reward-fn", "tests.rewards:length_parity_signalled")
"""Trainer flags that select it (with $DAPO_TEST_SIGNAL in the environment)."""
