"""The real trainer on the tool task (--tool-template code_fence: each sample a conversation with the sandboxed Python
interpreter), the short version of examples/run_tool_demo.sh: the tool runs (calls in the rollout and the
evaluation), a tool's tokens stay out of the loss and its token count (train/num_tokens is exactly the policy's own
tokens, the loss's denominator), and a run SIGKILLed after a save resumes to the uninterrupted run's metrics
(--tool-schedule rounds: the embedded engine's batches, and so every conversation, are reproducible)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, train_env
from tests.e2e.test_trainer_e2e import COMPARED, die_at_log, read_jsonl
from tests.rewards import PARITY_REWARD

pytestmark = pytest.mark.slow
STEPS = 3
TOOL_KEYS = ("rollout/tool_call_rate", "rollout/tool_calls_mean", "rollout/tool_token_share",
             "rollout/generated_len_mean")


@pytest.fixture(scope="module")
def tool_base(tmp_path_factory) -> Path:
    """A barely warmed-up tool-task base (hidden 32, 200 SFT steps, ~12 s) whose warm-up always calls the tool: about
    half its samples make a call the sandbox runs."""
    out = tmp_path_factory.mktemp("tool-base")
    cmd = [sys.executable, "tools/make_tiny_base.py", "--task", "tool", "--out", str(out), "--sft-steps", "200",
           "--num-train", "300", "--num-eval", "16", "--hidden-size", "32", "--ffn-hidden-size", "64",
           "--sft-batch-size", "16", "--call-prob", "1.0"]
    subprocess.run(cmd, cwd=REPO, env=train_env(), check=True, capture_output=True, timeout=300)
    return out


def tool_cmd(base: Path, run: Path, *extra: str) -> list[str]:
    """STEPS of 4 prompts x 4 conversations of up to 72 tokens with the tool, one mini-batch a step, a length-parity
    reward (tests/rewards.py: rewards differ inside a group, every step updates), saved every step."""
    return [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", str(base / "model"),
            "--prompt-data", str(base / "train.jsonl"), "--eval-prompt-data", str(base / "eval.jsonl"),
            "--eval-interval", str(STEPS), "--n-samples-per-eval-prompt", "2", "--num-steps", str(STEPS),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--no-dynamic-sampling", *PARITY_REWARD,
            "--max-response-length", "72", "--overlong-buffer-length", "8", "--lr", "1e-3", "--lr-warmup-steps", "0",
            "--tool-template", "code_fence", "--max-turns", "2", "--tool-output-max-chars", "64",
            "--tool-schedule", "rounds", "--tool-workers", "2", "--tool-timeout-s", "5", "--tool-cpu-s", "2",
            "--log-dir", str(run / "log"), "--save", str(run / "ckpt"), "--save-interval", "1", "--no-progress",
            "--no-wandb", "--seed", "7", "--max-prompt-length", "16", *extra]


def test_conversations_train_without_their_tool_tokens_and_resume_after_sigkill(tool_base, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "killed"
    out = subprocess.run(tool_cmd(tool_base, ref), cwd=REPO, env=train_env(), capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    metrics = read_jsonl(ref / "log" / "metrics.jsonl")
    assert sum(metrics[s]["rollout/tool_calls_mean"] for s in range(1, STEPS + 1)) > 0, "no call ran"
    assert "eval/tool_call_rate" in metrics[STEPS] and metrics[STEPS]["eval/turns"] >= 16
    for step in range(1, STEPS + 1):
        m = metrics[step]
        generated = m["rollout/generated_len_mean"] * m["rollout/responses"]
        assert m["train/num_tokens"] == pytest.approx(generated, abs=0.5), step  # tool tokens: not in the loss
        if m["rollout/tool_calls_mean"]:
            assert m["rollout/tool_token_share"] > 0 and m["rollout/response_len_mean"] > m[
                "rollout/generated_len_mean"]
            assert m["multi_turn/tool_calls"] == pytest.approx(m["rollout/tool_calls_mean"] * m["rollout/responses"])

    assert die_at_log(tool_cmd(tool_base, run), run, 2) == 2
    out = subprocess.run(tool_cmd(tool_base, run, "--load", str(run / "ckpt")), cwd=REPO, env=train_env(),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    resumed = read_jsonl(run / "log" / "metrics.jsonl")
    assert sorted(resumed) == list(range(0, STEPS + 1))  # step 0: the evaluation before the first step
    for key in (*COMPARED, *TOOL_KEYS):
        assert resumed[STEPS][key] == pytest.approx(metrics[STEPS][key], rel=1e-5, abs=1e-7), key
