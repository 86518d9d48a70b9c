"""The real trainer with a frozen reference model and the KL term (--ref-load initial --kl-coef): train/kl is logged
(0 while the policy is the reference, > 0 once it moved), a run SIGKILLed between a save and its log line resumes
to the uninterrupted run's metrics and weights (the reference rebuilt from the same weights), and a resume against
another reference is refused, naming both. With --kl-in-reward (the KL as a reward penalty), a DP2 run equals the DP1
run (the responses' KL sums combined over the ranks) and its penalty is beta x the KL the loss path logs."""

from __future__ import annotations

import subprocess

import pytest
import torch
from transformers import Qwen2ForCausalLM

from tests.checkpoint_helpers import max_rel_diff, read_checkpoint_tensors
from tests.conftest import REPO, train_env
from tests.e2e.test_trainer_e2e import COMPARED, die_at_log, read_jsonl, train_cmd
from tests.torchrun import free_port

pytestmark = pytest.mark.slow
STEPS = 4
KL = ("--ref-load", "initial", "--kl-coef", "0.5", "--kl-estimator", "k3", "--no-wandb", "--save-interval", "1",
      "--global-batch-size", "16")
"""One mini-batch per step (the batch is 4 prompts x 4 samples): step 1 trains at the reference's own weights."""


def test_kl_to_the_initial_policy_is_logged_and_a_killed_run_resumes_to_the_same_weights(tiny_base, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "killed"
    out = subprocess.run(train_cmd(tiny_base, ref, *KL, "--export-hf", str(ref / "hf"), steps=STEPS), cwd=REPO,
                         env=train_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    metrics = read_jsonl(ref / "log" / "metrics.jsonl")
    assert metrics[1]["train/kl"] == 0.0  # the policy is the reference until its first update
    assert all(metrics[s]["train/kl"] > 0 for s in range(2, STEPS + 1))
    assert all(metrics[s]["time/ref_logprob_s"] > 0 for s in metrics)

    assert die_at_log(train_cmd(tiny_base, run, *KL, steps=STEPS), run, 2) == 2
    refused = subprocess.run(train_cmd(tiny_base, run, *KL[2:], "--ref-load", str(ref / "hf"), "--load",
                                       str(run / "ckpt"), steps=STEPS),
                             cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=900)
    assert refused.returncode != 0
    assert "--ref-load: the checkpoint was trained against hf" in refused.stderr
    assert f"(--ref-load initial), this run would use hf {(ref / 'hf').resolve()}" in refused.stderr

    out = subprocess.run(train_cmd(tiny_base, run, *KL, "--load", str(run / "ckpt"), "--export-hf",
                                   str(run / "hf"), steps=STEPS),
                         cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    resumed = read_jsonl(run / "log" / "metrics.jsonl")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(2, STEPS + 1):  # step 2 logged from its checkpoint, 3 and 4 trained after the resume
        for key in (*COMPARED, "train/kl"):
            assert resumed[step][key] == pytest.approx(metrics[step][key], rel=1e-5, abs=1e-7), (step, key)
    a, b = Qwen2ForCausalLM.from_pretrained(ref / "hf"), Qwen2ForCausalLM.from_pretrained(run / "hf")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"{name} differs after the resume")


REWARD_KL = ("--ref-load", "initial", "--kl-coef", "0.5", "--kl-estimator", "k3", "--kl-in-reward", "--no-wandb",
             "--global-batch-size", "16", "--save-interval", "3", "--lr-warmup-steps", "0")
"""--kl-in-reward at beta 0.5; one mini-batch a step (4 prompts x 4 samples), saved at the last of 3 steps."""
N_RESPONSES = 16


def _dp2(cmd: list[str]) -> list[str]:
    """train_cmd's `cmd` under torchrun, two gloo ranks (DP 2)."""
    assert cmd[1:3] == ["-m", "megatron_dapo.train"], cmd[:3]
    return [cmd[0], "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", *cmd[1:]]


def test_kl_in_the_reward_is_the_same_on_two_dp_ranks_as_on_one(tiny_base, tmp_path):
    """--kl-in-reward: every rank needs every response's KL sum, a group's responses being split over the DP ranks
    (by tokens): a DP2 run logs the DP1 run's penalty, advantages and metrics and ends with its weights. The rel 1e-4
    tolerance: the two runs batch the rows differently (fp32 log-probs differ in the last bits), and the KL, a
    small difference of log-probs, carries that error relatively larger (observed 3e-6). Each logged penalty is
    beta x the KL the loss path measures (train/kl, its token mean at the same pre-update weights in the step's one
    mini-batch): k3 in fp32 there, exp(-d) + d - 1 with terms near 1, is off by a few 1e-8 a token (abs 2e-7 per
    token allowed)."""
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    for cmd in (train_cmd(tiny_base, one, *REWARD_KL, steps=3), _dp2(train_cmd(tiny_base, two, *REWARD_KL, steps=3))):
        out = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    a, b = read_jsonl(one / "log" / "metrics.jsonl"), read_jsonl(two / "log" / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert a[1]["kl/reward_penalty"] == a[1]["train/kl"] == 0.0  # the policy is the reference until its update
    for step in (2, 3):
        m = a[step]
        assert m["kl/reward_penalty"] > 0 and m["train/kl"] > 0 and m["train/minibatches"] == 1
        assert m["kl/reward_penalty"] * N_RESPONSES / 0.5 == pytest.approx(
            m["train/kl"] * m["train/num_tokens"], rel=0, abs=2e-7 * m["train/num_tokens"]), step
    for step in (1, 2, 3):
        assert set(a[step]) == set(b[step]), step
        for key in a[step]:
            # the mismatch metrics are differences of fp32 log-probs (the actor's against the engine's), each exact
            # to an ulp of the log-prob only: 2^-21 = 4.8e-7 at |log p| in [4, 8), 2^-19 = 1.9e-6 at [16, 32). Two
            # layouts batch the rows differently, so a max over the tokens may move by a couple of those ulps
            # (observed: 9.5e-7 against 4.8e-7 for mismatch/logprob_abs_diff_max on one machine)
            tol = 4e-6 if key.startswith("mismatch/") else 1e-7
            if not key.startswith("time/"):
                assert b[step][key] == pytest.approx(a[step][key], rel=1e-4, abs=tol), (step, key)
    # the weights and Adam's moments after step 3 (observed 5.6e-6: Adam's per-coordinate step lr x m / sqrt(v)
    # amplifies the fp32 differences of gradient coordinates near 0)
    rel, key = max_rel_diff(read_checkpoint_tensors(one / "ckpt" / "step_0000003"),
                            read_checkpoint_tensors(two / "ckpt" / "step_0000003"))
    assert rel <= 1e-4, (rel, key)
