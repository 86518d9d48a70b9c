"""The real trainer with on-policy distillation (--teacher-load, --distill-coef, --distill-only): a better-trained
tiny model (the same character tokenizer) scores the student's samples. distill/* is logged with its relations
(advantage = -coef x reverse KL), --distill-only trains on the teacher's term alone (at step 1, one on-policy
mini-batch, the token-mean loss is exactly coef x the reverse KL), a run SIGKILLed between a save and its log line
resumes to the uninterrupted run's metrics and weights, and a resume against another teacher is refused."""

from __future__ import annotations

import subprocess

import pytest
import torch
from transformers import Qwen2ForCausalLM

from tests.conftest import REPO, train_env
from tests.e2e.test_trainer_e2e import COMPARED, die_at_log, read_jsonl, train_cmd

pytestmark = pytest.mark.slow
STEPS = 4
ONE_BATCH = ("--no-wandb", "--save-interval", "1", "--global-batch-size", "16")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def test_distill_only_trains_on_the_teachers_reverse_kl(tiny_base, teacher, tmp_path):
    flags = ("--teacher-load", str(teacher), "--distill-coef", "0.5", "--distill-only", "--no-dynamic-sampling",
             *ONE_BATCH)
    _run(train_cmd(tiny_base, tmp_path, *flags, steps=2))
    m = read_jsonl(tmp_path / "log" / "metrics.jsonl")[1]
    assert m["distill/reverse_kl"] > 0.1 and m["distill/teacher_logprob"] < 0
    assert m["distill/advantage"] == pytest.approx(-0.5 * m["distill/reverse_kl"], rel=1e-9)
    # one mini-batch at the policy that sampled it (r = 1): the dapo loss is -mean_t A_t = 0.5 x mean_t rkl_t
    assert m["train/pg_loss"] == pytest.approx(0.5 * m["distill/reverse_kl"], rel=1e-5)


def test_a_killed_distillation_run_resumes_to_the_same_weights(tiny_base, teacher, tmp_path):
    flags = ("--teacher-load", str(teacher), "--distill-coef", "0.5", *ONE_BATCH)
    ref, run = tmp_path / "ref", tmp_path / "killed"
    _run(train_cmd(tiny_base, ref, *flags, "--export-hf", str(ref / "hf"), steps=STEPS))
    metrics = read_jsonl(ref / "log" / "metrics.jsonl")
    assert all(metrics[s]["distill/reverse_kl"] > 0 and metrics[s]["time/teacher_logprob_s"] > 0 for s in metrics)
    # with the verifier's advantage too, the loss is not the teacher's term alone
    assert metrics[1]["train/pg_loss"] != pytest.approx(0.5 * metrics[1]["distill/reverse_kl"], rel=1e-3)

    assert die_at_log(train_cmd(tiny_base, run, *flags, steps=STEPS), run, 2) == 2
    other = subprocess.run(train_cmd(tiny_base, run, *flags, "--teacher-load", str(tiny_base / "model"), "--load",
                                     str(run / "ckpt"), steps=STEPS),
                           cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=900)
    assert other.returncode != 0
    assert f"--teacher-load: the checkpoint was trained against hf {teacher.resolve()}" in other.stderr

    _run(train_cmd(tiny_base, run, *flags, "--load", str(run / "ckpt"), "--export-hf", str(run / "hf"), steps=STEPS))
    resumed = read_jsonl(run / "log" / "metrics.jsonl")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(2, STEPS + 1):
        for key in (*COMPARED, "distill/reverse_kl", "distill/teacher_logprob"):
            assert resumed[step][key] == pytest.approx(metrics[step][key], rel=1e-5, abs=1e-7), (step, key)
    a, b = Qwen2ForCausalLM.from_pretrained(ref / "hf"), Qwen2ForCausalLM.from_pretrained(run / "hf")
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"{name} differs after the resume")
