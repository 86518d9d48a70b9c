"""The real trainer with a frozen reference model and the KL term (--ref-load initial --kl-coef): train/kl is logged
(0 while the policy is the reference, > 0 once it moved), a run SIGKILLed between a save and its log line resumes
to the uninterrupted run's metrics and weights (the reference rebuilt from the same weights), and a resume against
another reference is refused, naming both."""

from __future__ import annotations

import subprocess

import pytest
import torch
from transformers import Qwen2ForCausalLM

from tests.conftest import REPO, train_env
from tests.e2e.test_trainer_e2e import COMPARED, die_at_log, read_jsonl, train_cmd

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
