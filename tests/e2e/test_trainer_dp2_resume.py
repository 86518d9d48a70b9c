"""Two gloo ranks (DP=2): a run resumed with --load from its step-2 checkpoint makes the same step 3
as the run that never stopped (checkpoint written by both ranks: one RNG state per rank, rank 0's
sampler, the optimizer state), with the regular and with the distributed optimizer.

Before the fix in checkpoint.py (`_restore_distributed_adam_steps`), the distributed optimizer
resumed with a wrong torch-Adam step: step-3 metrics off by up to 4.6e-4 relative, weights by 8e-3.

A SIGTERM that reaches rank 0 alone in the middle of its rollout stops both ranks at the same step: rank 0 abandons
the rollout and tells rank 1, waiting for the batch, to stop; both write the last finished step, which resumes
exactly.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.checkpoint_helpers import max_rel_diff, metrics, read_checkpoint_tensors, start_from_step
from tests.conftest import REPO, train_env
from tests.rewards import PARITY_REWARD, SIGNALLED_REWARD
from tests.torchrun import free_port

pytestmark = pytest.mark.slow
COMPARED = ("rollout/reward", "train/pg_loss", "train/grad_norm", "train/num_tokens", "train/entropy")


def torchrun_train(base, run, num_steps: int, *extra: str, env: dict[str, str] | None = None,
                   status: int = 0) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "megatron_dapo.train", "--hf-checkpoint", str(base / "model"),
           "--prompt-data", str(base / "train.jsonl"), "--num-steps", str(num_steps), "--rollout-batch-size", "4",
           "--n-samples-per-prompt", "4", "--no-dynamic-sampling", *PARITY_REWARD, "--max-response-length", "12",
           "--max-prompt-length", "16", "--overlong-buffer-length", "10", "--lr", "1e-3", "--global-batch-size", "8",
           "--log-dir", str(run / "log"), "--save", str(run / "ckpt"),
           "--save-interval", "2", "--no-wandb", "--no-progress", "--seed", "11",
           "--use-tis", "--mis-mode", "sequence", *extra]  # embedded engine: weights 1, nothing masked
    out = subprocess.run(cmd, cwd=REPO, env=train_env() | (env or {}), capture_output=True, text=True, timeout=600)
    assert (out.returncode == 0) == (status == 0), out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.mark.parametrize("optimizer", ["regular", "distributed"])
def test_dp2_resume_matches_uninterrupted(tiny_base, tmp_path, optimizer):
    flags = ("--use-distributed-optimizer",) if optimizer == "distributed" else ()
    ref, split = tmp_path / "ref", tmp_path / "split"
    torchrun_train(tiny_base, ref, 3, *flags)  # checkpoints at steps 2 and 3
    start_from_step(ref / "ckpt", 2, split / "ckpt")
    torchrun_train(tiny_base, split, 3, "--load", str(split / "ckpt"), *flags)
    ref_m, split_m = metrics(ref / "log"), metrics(split / "log")
    assert sorted(split_m) == [2, 3]  # step 2's record: logged from the checkpoint it resumed (SavedRecord)
    for step in (2, 3):
        for key in COMPARED:
            assert split_m[step][key] == pytest.approx(ref_m[step][key], rel=1e-5, abs=1e-7), (step, key)
    assert ref_m[3]["train/num_tokens"] > 0
    # the weights after step 3 (fp32: they are the main params) and, for the regular optimizer, Adam's m, v
    rel, key = max_rel_diff(read_checkpoint_tensors(ref / "ckpt" / "step_0000003"),
                            read_checkpoint_tensors(split / "ckpt" / "step_0000003"))
    assert rel <= 1e-5, (rel, key)
    for step, r in ref_m.items():  # same weights in engine and actor: the correction is the identity
        assert r["mismatch/is_ratio_mean"] == pytest.approx(1.0, abs=1e-5), step
        assert r["mismatch/tis_clipfrac"] == r["mismatch/mis_maskfrac"] == 0.0, step
        assert r["mismatch/ppl_ratio"] == pytest.approx(1.0, abs=1e-5), step
        assert r["mismatch/tokens"] > 0 and r["mismatch/logprob_abs_diff_max"] < 1e-4, step


def test_sigterm_at_rank_0_mid_rollout_stops_both_ranks_at_the_last_finished_step(tiny_base, tmp_path):
    """Rank 0's reward sends its own process SIGTERM during step 4's rollout (16 scored responses a step). Rank 1 is
    waiting for the batch in the data plane (gloo): it gets STOP instead and both ranks save step 3 (checkpoints
    every 2 steps), a checkpoint of both ranks' state that resumes as the uninterrupted run goes on."""
    ref, run = tmp_path / "ref", tmp_path / "stopped"
    torchrun_train(tiny_base, ref, 5, *SIGNALLED_REWARD)
    out = torchrun_train(tiny_base, run, 5, *SIGNALLED_REWARD, env={"DAPO_TEST_SIGNAL": "SIGTERM:50"}, status=143)
    assert "[megatron-dapo] SIGTERM: abandoned the rollout of step 4" in out.stdout, out.stdout[-3000:]
    assert f"[megatron-dapo] SIGTERM: saved step 3 to {run / 'ckpt'}" in out.stdout, out.stdout[-3000:]
    assert "exitcode  : 143" in out.stdout + out.stderr  # torchrun's report of the ranks' exit
    assert sorted(p.name for p in (run / "ckpt").iterdir() if p.name.startswith("step_")) == \
        ["step_0000002", "step_0000003"]
    assert (run / "ckpt" / "latest").read_text() == "step_0000003"
    torchrun_train(tiny_base, run, 5, *SIGNALLED_REWARD, "--load", str(run / "ckpt"))
    ref_m, run_m = metrics(ref / "log"), metrics(run / "log")
    assert sorted(run_m) == [1, 2, 3, 4, 5]
    for step in (4, 5):
        for key in COMPARED:
            assert run_m[step][key] == pytest.approx(ref_m[step][key], rel=1e-5, abs=1e-7), (step, key)
