"""--async-rollout 1 through `python -m megatron_dapo.train`: one step off-policy for real, and resume after SIGKILL.

The uninterrupted async run trains step k >= 2 on a batch the embedded engine (in its own process) generated
with the weights from before step k-1's update: the rollout log-probs then differ from the actor's (step 1:
equal), TIS is on by default and staleness is 1. A run killed with SIGKILL and resumed with --load continues
exactly as the uninterrupted one (the checkpoint holds the batch generated ahead), and the engine process dies
with the trainer.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from transformers import Qwen2ForCausalLM

from tests.conftest import REPO, train_env
from tests.e2e.test_trainer_e2e import (
    COMPARED,
    NUM_STEPS,
    assert_resume_matches,
    latest_step,
    read_jsonl,
    train_cmd,
)
from tests.procs import running

pytestmark = pytest.mark.slow
ASYNC = ("--async-rollout", "1", "--no-wandb")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def test_async_run_is_one_step_off_and_resumes_exactly_after_sigkill(tiny_base, tmp_path):
    ref = tmp_path / "ref"
    subprocess.run(train_cmd(tiny_base, ref, *ASYNC, "--export-hf", str(ref / "hf")), cwd=REPO, env=train_env(),
                   check=True, capture_output=True, timeout=900)
    ref_metrics = read_jsonl(ref / "log" / "metrics.jsonl")
    assert sorted(ref_metrics) == list(range(1, NUM_STEPS + 1))
    assert [ref_metrics[s]["async/staleness"] for s in ref_metrics] == [0.0] + [1.0] * (NUM_STEPS - 1)
    assert ref_metrics[1]["mismatch/logprob_abs_diff_mean"] < 1e-5  # same weights at step 1
    for step in range(2, NUM_STEPS + 1):  # generated one update behind the actor (lr 1e-3 moves log-probs)
        assert ref_metrics[step]["mismatch/logprob_abs_diff_mean"] > 1e-4, step
        assert ref_metrics[step]["mismatch/tis_weight_mean"] != pytest.approx(1.0, abs=1e-6)  # TIS on by default
    assert all(ref_metrics[s]["time/overlap_s"] > 0 for s in range(1, NUM_STEPS))

    run = tmp_path / "killed"
    proc = subprocess.Popen(train_cmd(tiny_base, run, *ASYNC), cwd=REPO, env=train_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    children: set[int] = set()
    while latest_step(run / "ckpt") < 2 and proc.poll() is None and time.monotonic() < deadline:
        children |= set(_children(proc.pid))
        time.sleep(0.05)
    children |= set(_children(proc.pid))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    resumed_from = latest_step(run / "ckpt")
    assert 2 <= resumed_from < NUM_STEPS, f"the run was not killed mid-way (checkpoint {resumed_from})"
    assert children, "the async run started no engine process"
    deadline = time.monotonic() + 15
    while any(running(c) for c in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [c for c in children if running(c)]
    for c in left:
        os.kill(c, signal.SIGKILL)
    assert not left, f"processes {left} outlived the SIGKILLed trainer"

    assert_resume_matches(tiny_base, run, resumed_from, ref, *ASYNC, timeout=900,
                          keys=(*COMPARED, "async/staleness", "mismatch/logprob_abs_diff_mean",
                                "mismatch/tis_weight_mean"))
    ref_model, resumed = Qwen2ForCausalLM.from_pretrained(ref / "hf"), Qwen2ForCausalLM.from_pretrained(run / "hf")
    for (name, a), (_, b) in zip(ref_model.state_dict().items(), resumed.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} differs after resume")


def test_async_with_partial_rollout_resumes_exactly_after_sigkill(tiny_base, tmp_path):
    """--async-rollout 1 and --partial-rollout together: the checkpoint after step k holds both the batch generated
    ahead (step k+1) and the groups cut from it; a run killed after a save and resumed matches the uninterrupted
    one on every later step, carried and resumed token counts included."""
    from tests.e2e.test_trainer_e2e import PARTIAL_FLAGS, PARTIAL_STEPS, _kill_after_save

    ref, run = tmp_path / "ref", tmp_path / "killed"
    cmd = lambda where, *extra: train_cmd(tiny_base, where, *ASYNC, *PARTIAL_FLAGS, *extra,  # noqa: E731
                                          steps=PARTIAL_STEPS)
    subprocess.run(cmd(ref), cwd=REPO, env=train_env(), check=True, capture_output=True, timeout=900)
    ref_metrics = read_jsonl(ref / "log" / "metrics.jsonl")
    assert sorted(ref_metrics) == list(range(1, PARTIAL_STEPS + 1))
    assert sum(m["rollout/carried_tokens"] for m in ref_metrics.values()) > 0, "nothing was carried over"
    assert [ref_metrics[s]["async/staleness"] for s in ref_metrics] == [0.0] + [1.0] * (PARTIAL_STEPS - 1)

    resumed_from = _kill_after_save(cmd(run), run, 3)
    assert 3 <= resumed_from < PARTIAL_STEPS, f"the run was not killed mid-way (checkpoint {resumed_from})"
    out = subprocess.run(cmd(run, "--load", str(run / "ckpt")), cwd=REPO, env=train_env(), capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    metrics = read_jsonl(run / "log" / "metrics.jsonl")
    keys = (*COMPARED, "async/staleness", "rollout/carried_tokens", "rollout/resumed_tokens",
            "rollout/generated_tokens", "mismatch/tis_weight_mean")
    for step in range(resumed_from + 1, PARTIAL_STEPS + 1):
        for key in keys:
            assert metrics[step][key] == pytest.approx(ref_metrics[step][key], rel=1e-5, abs=1e-7), (step, key)
