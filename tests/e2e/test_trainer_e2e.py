"""The whole loop through `python -m megatron_dapo.train`, and resume after SIGKILL or SIGTERM.

A run killed with SIGKILL mid-run and resumed with --load must continue exactly as the
uninterrupted run: same prompts at every later step, same rewards, losses and grad norms (the
rollouts are seeded per request, and the checkpoint holds model, optimizer, scheduler, RNG and
sampler state). A run sent SIGTERM (Slurm's time limit or preemption) saves its last finished step first and
resumes from it exactly; a second Ctrl-C ends a run at once, without a traceback.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2ForCausalLM

from tests.conftest import REPO, train_env
from tests.rewards import PARITY_REWARD, SIGNALLED_REWARD

NUM_STEPS = 8
COMPARED = ("rollout/reward", "rollout/accuracy", "rollout/response_len_mean", "train/pg_loss",
            "train/grad_norm", "train/entropy", "train/num_tokens", "train/lr")

pytestmark = pytest.mark.slow


def train_cmd(base: Path, run: Path, *extra: str, steps: int = NUM_STEPS) -> list[str]:
    # A barely trained model gets every answer wrong: no dynamic sampling, and a length-parity reward
    # (tests/rewards.py) so rewards differ inside each group and every step changes the weights.
    return [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", str(base / "model"),
            "--prompt-data", str(base / "train.jsonl"), "--num-steps", str(steps),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--no-dynamic-sampling", *PARITY_REWARD,
            "--max-response-length", "12", "--overlong-buffer-length", "10", "--lr", "1e-3",
            "--global-batch-size", "8", "--lr-warmup-steps", "4",  # a resume at step 2 continues mid-warm-up
            "--log-dir", str(run / "log"), "--save", str(run / "ckpt"),
            "--save-interval", "2", "--no-progress", "--seed", "7", "--max-prompt-length", "16", *extra]


def read_jsonl(path: Path) -> dict[int, dict]:
    """Records by step; a later record of a step (written after a resume) replaces the earlier one."""
    out: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            out[record["step"]] = record
    return out


def latest_step(ckpt: Path) -> int:
    marker = ckpt / "latest"
    return int(marker.read_text().strip().split("_")[-1]) if marker.is_file() else 0


def assert_resume_matches(base: Path, run: Path, resumed_from: int, ref: Path, *extra: str,
                          keys: tuple[str, ...] = COMPARED, timeout: int = 600) -> None:
    """Resumes the killed `run` from its checkpoint (train_cmd with `extra`, --load, --export-hf run/hf) and asserts
    it says it resumed at `resumed_from` and every later step drew the prompts and logged the metrics `keys` of the
    uninterrupted run `ref` (rel 1e-5, abs 1e-7)."""
    out = subprocess.run(train_cmd(base, run, *extra, "--load", str(run / "ckpt"), "--export-hf", str(run / "hf")),
                         cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-4000:]
    assert f"resumed from {run / 'ckpt'} at step {resumed_from}" in out.stdout
    ref_metrics, ref_prompts = read_jsonl(ref / "log" / "metrics.jsonl"), read_jsonl(ref / "log" / "prompts.jsonl")
    metrics, prompts = read_jsonl(run / "log" / "metrics.jsonl"), read_jsonl(run / "log" / "prompts.jsonl")
    for step in range(resumed_from + 1, NUM_STEPS + 1):
        assert prompts[step]["requested"] == ref_prompts[step]["requested"], f"step {step} saw other prompts"
        for key in keys:
            expected = pytest.approx(ref_metrics[step][key], rel=1e-5, abs=1e-7)
            assert metrics[step][key] == expected, (step, key)


def test_sigkill_mid_run_resumes_with_the_same_prompts_and_updates(tiny_base, tmp_path):
    ref = tmp_path / "ref"
    subprocess.run(train_cmd(tiny_base, ref, "--export-hf", str(ref / "hf")), cwd=REPO, env=train_env(),
                   check=True, capture_output=True, timeout=600)
    assert list((ref / "log" / "wandb").glob("offline-run-*")), "wandb should log offline by default"
    ref_metrics = read_jsonl(ref / "log" / "metrics.jsonl")
    assert sorted(ref_metrics) == list(range(1, NUM_STEPS + 1))
    assert (ref / "log" / "report.png").is_file()
    assert latest_step(ref / "ckpt") == NUM_STEPS
    # two-mini-batch steps: the second update is off-policy, so the clipped ratio is exercised
    assert all(ref_metrics[s]["train/minibatches"] == 2 for s in ref_metrics)
    # the embedded engine's sampling log-probs equal the Megatron actor's for the same weights, at every
    # step: weight sync after each update keeps the engine on the actor's weights (a stale engine would
    # be off by the size of an lr=1e-3 update)
    for step, record in ref_metrics.items():
        assert record["mismatch/logprob_abs_diff_mean"] < 1e-5, (step, record["mismatch/logprob_abs_diff_mean"])
        assert record["train/grad_norm"] > 0

    run = tmp_path / "killed"  # killed between step 2's save and its metrics log line
    assert die_at_log(train_cmd(tiny_base, run, "--no-wandb"), run, 2) == 2
    assert not (run / "log" / "metrics.jsonl").read_text().count('"step": 2,')
    assert_resume_matches(tiny_base, run, 2, ref, "--no-wandb")
    assert_record_recovered(run, ref, 2, COMPARED)

    # the exported HF checkpoints of both runs hold the same trained weights, and transformers loads them
    ref_model = Qwen2ForCausalLM.from_pretrained(ref / "hf")
    resumed = Qwen2ForCausalLM.from_pretrained(run / "hf")
    base = Qwen2ForCausalLM.from_pretrained(tiny_base / "model")
    AutoTokenizer.from_pretrained(ref / "hf")
    for (name, a), (_, b) in zip(ref_model.state_dict().items(), resumed.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"{name} differs after resume")
    moved = [not torch.equal(a, c) for a, c in zip(ref_model.parameters(), base.parameters(), strict=True)]
    assert any(moved), "no update"


PARTIAL_STEPS = 6
PARTIAL_FLAGS = ("--partial-rollout", "--use-tis", "--over-sample-factor", "4", "--n-samples-per-prompt", "2",
                 "--dynamic-sampling", "--save-interval", "1")
"""Later flags win: G = 2 with dynamic sampling drops about half the groups (both responses of the same
parity), and 4x over-sampling submits 4 decode batches of the embedded engine (rollout batch x G rows each):
the batch fills while later groups are still generating, so the cut carries real prefixes (steps 3-5 of this
seeded run carry 24-66 tokens; step 2 carries only unstarted groups, hence the kill after step 3's save)."""


def die_at_log(cmd: list[str], run: Path, step: int) -> int:
    """Runs train_cmd's `cmd` until it SIGKILLs itself about to log step `step`'s metrics, after that step's save
    (tests/die_at_log.py); returns the newest checkpoint's step."""
    assert cmd[1:3] == ["-m", "megatron_dapo.train"], cmd[:3]
    out = subprocess.run([cmd[0], "-m", "tests.die_at_log", str(step), *cmd[3:]], cwd=REPO, env=train_env(),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == -signal.SIGKILL, out.stderr[-4000:]
    return latest_step(run / "ckpt")


def assert_record_recovered(run: Path, ref: Path, step: int, keys: tuple[str, ...] = (), *,
                            steps: int = NUM_STEPS) -> None:
    """The resumed `run` logged every step, step `step`'s record (lost with the killed run, logged from its
    checkpoint) included: its training and rollout metrics `keys` are those of the uninterrupted `ref`."""
    metrics, ref_metrics = read_jsonl(run / "log" / "metrics.jsonl"), read_jsonl(ref / "log" / "metrics.jsonl")
    assert sorted(metrics) == list(range(1, steps + 1))
    assert set(ref_metrics[step]) - set(metrics[step]) <= {"time/step_s"}, "the recovered record lacks metrics"
    for key in keys:  # a metric absent in a step (a staleness share never seen) is 0 there
        expected = pytest.approx(ref_metrics[step].get(key, 0.0), rel=1e-5, abs=1e-7)
        assert metrics[step].get(key, 0.0) == expected, (step, key)


def _kill_after_save(cmd: list[str], run: Path, step: int) -> int:
    proc = subprocess.Popen(cmd, cwd=REPO, env=train_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while latest_step(run / "ckpt") < step and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return latest_step(run / "ckpt")


def test_sigkill_resume_is_exact_with_partial_rollout(tiny_base, tmp_path):
    """--partial-rollout: the groups cut at the checkpointed step are in the checkpoint; the resumed run resumes
    the same prefixes with the same seeds, so every later step matches the uninterrupted run."""
    ref, run = tmp_path / "ref", tmp_path / "killed"
    cmd = lambda where, *extra: train_cmd(tiny_base, where, "--no-wandb", *PARTIAL_FLAGS, *extra,
                                          steps=PARTIAL_STEPS)
    subprocess.run(cmd(ref), cwd=REPO, env=train_env(), check=True, capture_output=True, timeout=600)
    ref_metrics = read_jsonl(ref / "log" / "metrics.jsonl")
    ref_prompts = read_jsonl(ref / "log" / "prompts.jsonl")
    resumed_from = _kill_after_save(cmd(run), run, 3)
    assert 3 <= resumed_from < PARTIAL_STEPS, f"the run was not killed mid-way (checkpoint {resumed_from})"
    out = subprocess.run(cmd(run, "--load", str(run / "ckpt")), cwd=REPO, env=train_env(), capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    metrics = read_jsonl(run / "log" / "metrics.jsonl")
    prompts = read_jsonl(run / "log" / "prompts.jsonl")
    # the resumed step picks up the groups cut at the checkpointed step, prefixes included
    first = resumed_from + 1
    carried = ref_prompts[resumed_from]["carried"]
    assert prompts[first]["resumed"] == [i for i in carried if i not in prompts[first]["stale_dropped"]] != []
    assert metrics[first]["rollout/resumed_tokens"] == ref_metrics[resumed_from]["rollout/carried_tokens"] > 0
    compared = (*COMPARED, "rollout/generated_tokens", "rollout/carried_tokens", "rollout/resumed_tokens",
                "rollout/max_staleness", "mismatch/tis_weight_mean", "mismatch/logprob_abs_diff_max")
    for step in range(first, PARTIAL_STEPS + 1):
        for key in ("requested", "resumed", "stale_dropped", "carried", "kept"):
            assert prompts[step][key] == ref_prompts[step][key], (step, key)
        for key in compared:
            assert metrics[step][key] == pytest.approx(ref_metrics[step][key], rel=1e-5, abs=1e-7), (step, key)
    # the carried prefixes came from the previous weights: TIS sees a real mismatch on them
    assert any(ref_metrics[s]["rollout/max_staleness"] >= 1 for s in ref_metrics)
    assert any(ref_metrics[s]["mismatch/logprob_abs_diff_max"] > 1e-4 for s in ref_metrics)


STOP_STEPS = 5
CALL_IN_STEP_4 = 3 * 16 + 2
"""The reward call during step 4's rollout: 16 responses a step (4 prompts x 4, no dynamic sampling), each scored
once (tests/rewards.py: length_parity_signalled sends the signal from there)."""


def _signalled(base: Path, run: Path, spec: str | None, *extra: str) -> subprocess.CompletedProcess:
    """A STOP_STEPS run of train_cmd (checkpoints at steps 2 and 4) whose reward sends signal `spec`."""
    env = train_env() | ({"DAPO_TEST_SIGNAL": spec} if spec else {})
    return subprocess.run(train_cmd(base, run, "--no-wandb", *SIGNALLED_REWARD, *extra, steps=STOP_STEPS), cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600, start_new_session=True)


def test_sigterm_mid_rollout_saves_the_last_finished_step_and_resume_is_exact(tiny_base, tmp_path):
    """SIGTERM in the middle of step 4's rollout: the rollout is abandoned, step 3 (not due by --save-interval 2) is
    saved, the run exits 143 within the bound. It used to die at once: steps since step 2 lost."""
    ref, run = tmp_path / "ref", tmp_path / "stopped"
    assert _signalled(tiny_base, ref, None).returncode == 0
    out = _signalled(tiny_base, run, f"SIGTERM:{CALL_IN_STEP_4}")
    assert out.returncode == 143, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "[megatron-dapo] SIGTERM: abandoned the rollout of step 4" in out.stdout
    assert f"[megatron-dapo] SIGTERM: saved step 3 to {run / 'ckpt'} in " in out.stdout
    assert latest_step(run / "ckpt") == 3 and not list((run / "ckpt").glob("*.tmp")), list((run / "ckpt").iterdir())
    assert sorted(read_jsonl(run / "log" / "prompts.jsonl")) == [1, 2, 3]  # step 4 never got its batch

    resumed = subprocess.run(train_cmd(tiny_base, run, "--no-wandb", *SIGNALLED_REWARD, "--load", str(run / "ckpt"),
                                       steps=STOP_STEPS), cwd=REPO, env=train_env(), capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {run / 'ckpt'} at step 3" in resumed.stdout
    ref_metrics, ref_prompts = read_jsonl(ref / "log" / "metrics.jsonl"), read_jsonl(ref / "log" / "prompts.jsonl")
    metrics, prompts = read_jsonl(run / "log" / "metrics.jsonl"), read_jsonl(run / "log" / "prompts.jsonl")
    for step in (4, 5):  # the abandoned draws were rewound: step 4 asks for the prompts it would have
        assert prompts[step]["requested"] == ref_prompts[step]["requested"], step
        for key in COMPARED:
            assert metrics[step][key] == pytest.approx(ref_metrics[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_sigterm_during_the_update_saves_that_step_and_resume_is_exact(tiny_base, tmp_path):
    """--async-rollout 1: step 4's batch (and so the SIGTERM) is generated while step 3 trains. The update is
    finished, then step 3 is saved (with batch 4, finished: the push waits for it anyway) before its push, and
    the resumed run takes batch 4 from the checkpoint as the uninterrupted run took it from memory."""
    ref, run = tmp_path / "ref", tmp_path / "stopped"
    assert _signalled(tiny_base, ref, None, "--async-rollout", "1").returncode == 0
    out = _signalled(tiny_base, run, f"SIGTERM:{CALL_IN_STEP_4}", "--async-rollout", "1")
    assert out.returncode == 143, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"[megatron-dapo] SIGTERM: saved step 3 to {run / 'ckpt'} in " in out.stdout
    assert "abandoned" not in out.stdout and "Traceback" not in out.stderr, out.stdout[-3000:] + out.stderr[-3000:]
    assert latest_step(run / "ckpt") == 3 and not list((run / "ckpt").glob("*.tmp"))
    assert sorted(read_jsonl(run / "log" / "metrics.jsonl")) == [1, 2, 3]  # step 3's record, without a push
    resumed = subprocess.run(train_cmd(tiny_base, run, "--no-wandb", *SIGNALLED_REWARD, "--async-rollout", "1",
                                       "--load", str(run / "ckpt"), steps=STOP_STEPS), cwd=REPO, env=train_env(),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    ref_metrics, metrics = read_jsonl(ref / "log" / "metrics.jsonl"), read_jsonl(run / "log" / "metrics.jsonl")
    for step in (4, 5):
        for key in (*COMPARED, "async/staleness"):
            assert metrics[step][key] == pytest.approx(ref_metrics[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_exit_save_timeout_0_exits_at_once_keeping_the_previous_checkpoint(tiny_base, tmp_path):
    """A bound no save fits in: the run exits 143 without one; step 2 stays the newest checkpoint, nothing half
    written."""
    run = tmp_path / "stopped"
    out = _signalled(tiny_base, run, f"SIGTERM:{CALL_IN_STEP_4}", "--exit-save-timeout-s", "0")
    assert out.returncode == 143, out.stdout[-3000:] + out.stderr[-3000:]
    assert "saved step" not in out.stdout and "Traceback" not in out.stderr, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(p.name for p in (run / "ckpt").iterdir() if p.name.startswith("step_")) == ["step_0000002"]
    assert latest_step(run / "ckpt") == 2


def test_a_second_sigint_ends_the_run_at_once_without_a_traceback(tiny_base, tmp_path):
    """Ctrl-C in a terminal (SIGINT to the trainer's whole process group, its embedded rollout process included),
    then Ctrl-C again a second later. With --async-rollout 1 the reward (and so the first Ctrl-C) comes while step 3
    trains and step 4's batch is generated ahead, which the step waits for: the first Ctrl-C cannot be acted on
    before the second. It used to print a KeyboardInterrupt traceback (25 frames), and the rollout process its own."""
    run = tmp_path / "stopped"
    out = _signalled(tiny_base, run, f"SIGINT:{CALL_IN_STEP_4}:again:group", "--async-rollout", "1")
    assert out.returncode == 130, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr, out.stderr[-3000:]
    assert "[megatron-dapo] SIGINT: exiting now (a second SIGINT)" in out.stderr
    assert not list((run / "ckpt").glob("*.tmp")) and latest_step(run / "ckpt") == 2
