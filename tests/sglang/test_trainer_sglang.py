"""The trainer with a real SGLang 0.5.23 server (CPU) as its rollout engine.

Every step's rollouts come from the server; after each step the actor's weights go to it through
update_weights_from_tensor. The rollout-vs-actor log-prob mismatch staying at fp32 noise on steps
2 and 3 shows the server really serves the updated weights (a stale server would differ by the
size of an update). Needs .venv-sglang (`make sglang-env`); skipped otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO, train_env
from tests.rewards import PARITY_REWARD

SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(not SGLANG_PY.exists(), reason="no .venv-sglang: run `make sglang-env`"),
]


def test_training_steps_with_an_sglang_server_follow_the_actor(tiny_base, tmp_path):
    cmd = [sys.executable, "-m", "megatron_dapo.train", "--hf-checkpoint", str(tiny_base / "model"),
           "--prompt-data", str(tiny_base / "train.jsonl"), "--num-steps", "3", "--rollout-batch-size", "4",
           "--n-samples-per-prompt", "4", "--no-dynamic-sampling", *PARITY_REWARD, "--max-response-length", "12",
           "--overlong-buffer-length", "10", "--lr", "1e-3", "--log-dir", str(tmp_path / "log"), "--no-wandb",
           "--no-progress", "--seed", "7", "--rollout-engine", "sglang", "--sglang-python", str(SGLANG_PY),
           "--sglang-extra-args", "--dtype float32", "--sglang-base-port", "31200", "--weight-sync-mode", "tensor",
           "--max-prompt-length", "16"]
    out = subprocess.run(cmd, cwd=REPO, env=train_env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["mismatch/logprob_abs_diff_mean"] < 1e-4, r
        assert r["train/grad_norm"] > 0
    assert records[1]["train/pg_loss"] != records[0]["train/pg_loss"]
